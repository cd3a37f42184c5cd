"""[any] Llama 4 tool calls, as its published chat template writes them: the turn's content between
``<|python_start|>`` and ``<|python_end|>``, then one JSON object per call, back to back, then ``<|eot|>``:

    <|python_start|><|python_end|>{"name": "get_weather", "parameters": {"location": "Tokyo"}}<|eot|>

The call opens at ``<|python_start|>`` and runs to ``<|eot|>`` or the end of the text (generation stops at
``<|eot|>``). Whatever stands before ``<|python_end|>`` is the template's content slot, not a call.
"""

from __future__ import annotations

import json
from typing import Any

from vlmserve.tools.base import RawCall, ToolFormat, ToolParseError

START = "<|python_start|>"
CONTENT_END = "<|python_end|>"
END = "<|eot|>"

_DECODER = json.JSONDecoder()


def parse_body(body: str) -> list[RawCall]:
    """The calls after ``<|python_end|>``: JSON objects with ``name`` and ``parameters``, one after another."""
    _, marker, calls = body.partition(CONTENT_END)
    text = (calls if marker else body).strip()
    if not text:
        raise ToolParseError("a Llama 4 tool call is <|python_end|> then {\"name\": ..., \"parameters\": {...}}")
    out: list[RawCall] = []
    at = 0
    while at < len(text):
        try:
            item, at = _DECODER.raw_decode(text, at)
        except ValueError as exc:
            raise ToolParseError(f"not JSON: {exc}") from None
        out.append(_call(item))
        at = len(text) - len(text[at:].lstrip(" \n;,"))  # calls written one after another
    return out


def _call(item: Any) -> RawCall:
    if not isinstance(item, dict):
        raise ToolParseError(f"a tool call is a JSON object, got {type(item).__name__}")
    name, args = item.get("name"), item.get("parameters", item.get("arguments", {}))
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        raise ToolParseError("a Llama 4 tool call needs a string name and object parameters")
    return name.strip(), args


FORMAT = ToolFormat(name="llama4", start=START, end=END, parse_body=parse_body)
