"""[any] A JSON schema as constrained decoding enforces it: the form models write, and closed objects.

Both the ``response_format`` grammars (preprocess/guided.py) and the tool-call grammars
(preprocess/tool_grammar.py) write their schemas through ``tidy_json``.
"""

from __future__ import annotations

from typing import Any


def tidy_json(schema: Any) -> Any:
    """The schema as it is enforced: written as models write JSON (``", "`` and ``": "``) with no
    other whitespace, and, as vLLM's xgrammar strict mode does, objects that declare properties take
    no others unless the schema allows them. A model can wander into neither endless blank space nor
    keys of its own."""
    if not isinstance(schema, dict):
        return schema
    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    closed = _closed(schema)
    return {**closed, "x-guidance": {**style, **schema.get("x-guidance", {})}}


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def _closed(schema: Any) -> Any:
    """Every object with declared properties, at any depth, closed unless it says otherwise."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
