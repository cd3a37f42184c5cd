"""[loop] Bounds on client JSON the server walks or re-encodes: schemas and tool-call arguments.

Python's ``json`` and Jinja's ``tojson`` recurse, so a schema nested 900 deep would end in a
``RecursionError`` deep inside the chat template. Everything is measured here without recursion
first, and refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from vlmserve.api.errors import bad_request

MAX_DEPTH = 32  # real tool schemas nest under 10
MAX_NODES = 20_000  # values, keys included, in one schema


def json_shape(value: Any) -> tuple[int, int]:
    """``(depth, nodes)`` of a parsed JSON value, walked with a stack."""
    depth = nodes = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        nodes += 1
        depth = max(depth, level)
        if isinstance(item, dict):
            nodes += len(item)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return depth, nodes


def check_json(value: Any, param: str) -> None:
    """A 400 when ``value`` nests deeper than MAX_DEPTH or has more than MAX_NODES values."""
    depth, nodes = json_shape(value)
    if depth > MAX_DEPTH:
        raise bad_request(f"{param} nests {depth} levels deep; at most {MAX_DEPTH} are allowed", param, "json_too_deep")
    if nodes > MAX_NODES:
        raise bad_request(f"{param} has {nodes} values; at most {MAX_NODES} are allowed", param, "json_too_large")
