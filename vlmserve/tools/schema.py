"""[any] Check a parsed call against the request's `tools` and coerce its arguments to their schema.

Models write `"3"` for an integer or `3` for a string often enough that clients
break on it; when the JSON schema names the type, the value is converted to it.
A value that does not convert is left as the model wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vlmserve.tools.base import JSONObject, ToolParseError, parse_number

_MISS = object()  # a converter's "not this type"

_KIND_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


def check_call(name: str, arguments: JSONObject, tools: list[dict[str, Any]] | None) -> JSONObject:
    """The arguments coerced to the tool's schema; ToolParseError for a tool the request did not offer."""
    if tools is None:
        return arguments
    schema = find_parameters(tools, name)
    if schema is None:
        raise ToolParseError(f"unknown tool {name!r}")
    return _object_properties(arguments, schema)


def find_parameters(tools: list[dict[str, Any]], name: str) -> JSONObject | None:
    """The `parameters` schema of the tool called `name` ({} if it has none), None if not offered."""
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            params = function.get("parameters")
            return params if isinstance(params, dict) else {}
    return None


def coerce(value: Any, schema: JSONObject) -> Any:
    """`value` as the schema's type when it is that type written another way, else unchanged."""
    # A type the value already has wins over a conversion: ["string", "integer"] keeps 3 as 3.
    options = sorted(_options(schema), key=lambda option: not _is_kind(value, option[0]))
    for kind, sub in options:
        if (out := _CONVERTERS[kind](value, sub)) is not _MISS:
            return out
    return value


def _options(schema: JSONObject) -> list[tuple[str, JSONObject]]:
    """(type, schema) pairs the value may take; anyOf/oneOf as pydantic writes Optional[int]."""
    subs = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(subs, list):
        return [option for sub in subs if isinstance(sub, dict) for option in _options(sub)]
    kinds = schema.get("type", "object" if "properties" in schema else [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return [(kind, schema) for kind in kinds if isinstance(kind, str) and kind in _CONVERTERS]


def _is_kind(value: Any, kind: str) -> bool:
    # bool is an int in Python, never in JSON schema.
    return isinstance(value, _KIND_TYPES[kind]) and (kind == "boolean" or not isinstance(value, bool))


def _to_string(value: Any, _: JSONObject) -> Any:
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, (bool, int, float)) else _MISS


def _to_integer(value: Any, _: JSONObject) -> Any:
    number = _to_number(value, _)
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number if isinstance(number, int) else _MISS


def _to_number(value: Any, _: JSONObject) -> Any:
    if isinstance(value, bool):
        return _MISS
    if isinstance(value, (int, float)):
        return value
    number = parse_number(value.strip()) if isinstance(value, str) else None
    return _MISS if number is None else number


def _to_boolean(value: Any, _: JSONObject) -> Any:
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    return {"true": True, "false": False}.get(word, _MISS) if word else _MISS


def _to_null(value: Any, _: JSONObject) -> Any:
    return None if value is None or value == "null" else _MISS


def _to_array(value: Any, schema: JSONObject) -> Any:
    value = _json(value) if isinstance(value, str) else value
    if not isinstance(value, list):
        return _MISS
    items = schema.get("items")
    return [coerce(item, items) for item in value] if isinstance(items, dict) else value


def _to_object(value: Any, schema: JSONObject) -> Any:
    value = _json(value) if isinstance(value, str) else value
    return _object_properties(value, schema) if isinstance(value, dict) else _MISS


def _object_properties(value: JSONObject, schema: JSONObject) -> JSONObject:
    props = schema.get("properties")
    if not isinstance(props, dict):
        return value
    return {
        key: coerce(item, props[key]) if isinstance(props.get(key), dict) else item
        for key, item in value.items()
    }


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _MISS


_CONVERTERS: dict[str, Callable[[Any, JSONObject], Any]] = {
    "string": _to_string,
    "integer": _to_integer,
    "number": _to_number,
    "boolean": _to_boolean,
    "array": _to_array,
    "object": _to_object,
    "null": _to_null,
}
