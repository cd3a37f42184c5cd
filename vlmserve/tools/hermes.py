"""[any] Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re
from typing import Any

from vlmserve.tools.base import RawCall, ToolFormat, ToolParseError

START = "<tool_call>"
END = "</tool_call>"

# A whole string literal (kept) or a comma right before a closing bracket (dropped),
# so a comma inside a string is never touched.
_TRAILING_COMMA = re.compile(r'("(?:\\.|[^"\\])*")|,(?=\s*[}\]])')


def parse_body(body: str) -> list[RawCall]:
    """The calls in one `<tool_call>` body: a JSON object, or a list of them."""
    data = _loads(body)
    return [_read_call(item) for item in (data if isinstance(data, list) else [data])]


def _read_call(item: Any) -> RawCall:
    if not isinstance(item, dict):
        raise ToolParseError(f"a tool call is a JSON object, got {type(item).__name__}")
    name = item.get("name")
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments JSON-encoded once more
        args = _loads(args) if args.strip() else {}
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        raise ToolParseError("a tool call needs a string name and object arguments")
    return name.strip(), args


def _loads(text: str) -> Any:
    try:
        return json.loads(_TRAILING_COMMA.sub(lambda m: m.group(1) or "", text))
    except (ValueError, RecursionError) as exc:
        raise ToolParseError(f"not JSON: {exc}") from None


FORMAT = ToolFormat(name="hermes", start=START, end=END, parse_body=parse_body)
