"""[any] Kimi tool calls (Moonshot's templates: Kimi-K2, and Kimi-VL served with them): one section of calls,
each an id and JSON arguments.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"location": "Tokyo"}<|tool_call_end|><|tool_calls_section_end|>

The template writes each call's ``id`` where the call's name would be, and the model was trained on ids of
the form ``functions.NAME:IDX``: the name is read from it, and the calls this server returns carry such ids
(``call_id``), so that a client sending them back gives the model the history it was trained on.
"""

from __future__ import annotations

import re

from vlmserve.tools.base import RawCall, ToolFormat, ToolParseError
from vlmserve.tools.hermes import loads

START = "<|tool_calls_section_begin|>"
END = "<|tool_calls_section_end|>"
CALL, ARGUMENTS, END_CALL = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|\Z)", re.S)
_ID = re.compile(r"(?:functions\.)?([^\s:]+)(?::\d+)?")


def parse_body(body: str) -> list[RawCall]:
    """Every call in one section; a section with text outside its calls is not Kimi's."""
    calls = list(_CALL.finditer(body))
    if not calls or _CALL.sub("", body).strip():
        raise ToolParseError("a Kimi tool call is <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}")
    return [_read_call(m.group(1), m.group(2)) for m in calls]


def _read_call(call_id: str, arguments: str) -> RawCall:
    named = _ID.fullmatch(call_id.strip())
    if named is None:
        raise ToolParseError(f"a Kimi tool call's id is functions.NAME:IDX, got {call_id!r}")
    args = loads(arguments) if arguments.strip() else {}
    if not isinstance(args, dict):
        raise ToolParseError("a Kimi tool call's arguments are a JSON object")
    return named.group(1), args


def call_id(name: str, index: int) -> str:
    """The id Kimi's templates write for a reply's ``index``-th call, where the model wrote none of that form."""
    return f"functions.{name}:{index}"


def written_ids(body: str) -> list[str | None]:
    """The ids the model wrote, as it wrote them where they are ``functions.NAME:IDX`` (IDX counts the
    conversation's calls, as Moonshot trains it: the history sent back must hold the same)."""
    return [m.group(1).strip() if _WRITTEN.fullmatch(m.group(1).strip()) else None for m in _CALL.finditer(body)]


_WRITTEN = re.compile(r"functions\.[^\s:]+:\d+")
FORMAT = ToolFormat(name="kimi", start=START, end=END, parse_body=parse_body, call_id=call_id, written_ids=written_ids)
