"""[any] What every tool-call format shares: the call, the stream events and a format's contract."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

JSONObject = dict[str, Any]
# (name, arguments) as a format's body parser finds them, before schema checks.
RawCall = tuple[str, JSONObject]


class ToolParseError(ValueError):
    """A call's text cannot be read as a call; its raw text goes back to the content."""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One parsed call, arguments already checked against the request's tools."""

    name: str
    arguments: JSONObject
    id: str

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_openai(self) -> JSONObject:
        function = {"name": self.name, "arguments": self.arguments_json}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(slots=True, frozen=True)
class ContentDelta:
    text: str


@dataclass(slots=True, frozen=True)
class ToolCallDelta:
    """One `choices[0].delta.tool_calls[i]` chunk; id, name and type only on a call's first."""

    index: int
    arguments_json: str
    id: str | None = None
    name: str | None = None
    type: Literal["function"] | None = None

    def to_openai(self) -> JSONObject:
        out: JSONObject = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": self.type}
        function = {"arguments": self.arguments_json}
        if self.name is not None:
            function = {"name": self.name} | function
        return out | {"function": function}


StreamEvent = ContentDelta | ToolCallDelta


@dataclass(slots=True, frozen=True)
class ToolFormat:
    """A format: the markers around one call and how to read the text between them.

    `parse_body` returns the calls in the body (a format may put several in one)
    and raises ToolParseError, and only that, on anything it cannot repair.
    """

    name: str
    start: str
    end: str
    parse_body: Callable[[str], list[RawCall]]
    # Text only this format's templates write, where its markers are another format's too (GLM's
    # ``<arg_key>`` inside Hermes's ``<tool_call>``); "": the start marker tells it
    signature: str = ""
    # The id of a reply's ``index``-th call where the format's templates write ids the model reads back
    # (Kimi's ``functions.NAME:IDX``); None: an opaque one (``new_call_id``)
    call_id: Callable[[str, int], str] | None = None
    # The ids the model wrote for a body's calls, in order (None where it wrote none of the format's form): kept
    # as the calls' ids, so that the history sent back holds what the model wrote (Kimi's global call counter)
    written_ids: Callable[[str], list[str | None]] | None = None


# JSON's number grammar: a zip code like 02134 stays a string.
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def parse_number(text: str) -> int | float | None:
    if not _NUMBER.fullmatch(text):
        return None
    return int(text) if text.lstrip("-").isdigit() else float(text)


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that some marker starts with (and is not all of):
    text a stream must hold back until the next delta says whether a marker begins there."""
    longest = min(len(text), max(map(len, markers), default=1) - 1)
    for size in range(longest, 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0
