"""[any] Split a generation, delta by delta, into content and OpenAI tool-call deltas."""

from __future__ import annotations

from typing import Any

from vlmserve.tools.base import (
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolParseError,
    new_call_id,
    partial_marker_len,
)
from vlmserve.tools.registry import get_format
from vlmserve.tools.schema import check_call


class ToolCallStreamParser:
    """Turns text deltas into content and tool-call events, as OpenAI clients expect them.

    Content streams once it cannot be the start of a marker. A call goes out whole
    when its end marker, the next call's start or finish() arrives; one that cannot
    be read goes out as content where it stood. Markers never reach the content;
    whitespace is trimmed as `_content` says. The result is the same however the
    text was split: `parse_tool_calls` is this parser fed once.
    """

    def __init__(self, parser: str, tools: list[dict[str, Any]] | None) -> None:
        self._format = get_format(parser)
        self._tools = tools
        self._buffer = ""  # text not yet decided on: a possible marker prefix, or an open call
        self._in_call = False
        self._scanned = 0  # how far into an open call's text no marker can start
        self._pending_space = ""  # trailing whitespace, sent only if more content follows
        self._started = False
        self._after_call = False
        self.calls: list[ToolCall] = []

    @property
    def has_tool_calls(self) -> bool:
        """Whether finish_reason should be "tool_calls"."""
        return bool(self.calls)

    def feed(self, delta: str) -> list[StreamEvent]:
        self._buffer += delta
        events: list[StreamEvent] = []
        while self._step_call(events) if self._in_call else self._step_text(events):
            pass
        return events

    def finish(self, cut: bool = False) -> list[StreamEvent]:
        """Flush at the end of generation: an unclosed call is parsed as it stands, unless the token
        limit ``cut`` it: then it stays what the model wrote, as content (never a call closed for it)."""
        events: list[StreamEvent] = []
        if self._in_call and cut:
            self._content(self._format.start + self._buffer, events)
        elif self._in_call:
            self._end_call(self._buffer, "", events)
        else:
            self._content(self._buffer, events)
        self._buffer, self._in_call, self._pending_space = "", False, ""
        return events

    def _step_text(self, events: list[StreamEvent]) -> bool:
        start, end = self._format.start, self._format.end
        at, marker = _first_marker(self._buffer, (start, end))
        if marker is None:
            keep = partial_marker_len(self._buffer, (start, end))
            self._content(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._content(self._buffer[:at], events)
        self._buffer = self._buffer[at + len(marker) :]
        self._in_call = marker == start  # a stray end marker is markup too: dropped
        return True

    def _step_call(self, events: list[StreamEvent]) -> bool:
        start, end = self._format.start, self._format.end
        at, marker = _first_marker(self._buffer, (end, start), self._scanned)
        if marker is None:
            # A long call arrives in many deltas: look only at new text (and a marker's width before it).
            self._scanned = max(0, len(self._buffer) - max(len(start), len(end)) + 1)
            return False
        self._scanned = 0
        # The next call's start also ends this one; it stays in the buffer to open that call.
        closing = end if marker == end else ""
        self._end_call(self._buffer[:at], closing, events)
        self._buffer = self._buffer[at + len(closing) :]
        self._in_call = False
        return True

    def _end_call(self, body: str, closing: str, events: list[StreamEvent]) -> None:
        try:
            raw_calls = self._format.parse_body(body)
            make_id, read = self._format.call_id, self._format.written_ids
            written = read(body) if read else [None] * len(raw_calls)
            calls = [
                ToolCall(name, check_call(name, args, self._tools),
                         given or (make_id(name, len(self.calls) + i) if make_id else new_call_id()))
                for i, ((name, args), given) in enumerate(zip(raw_calls, written))
            ]
        except ToolParseError:
            self._content(self._format.start + body + closing, events)
            return
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            self._after_call = True
            events.append(ToolCallDelta(index, "", call.id, call.name, "function"))
            events.append(ToolCallDelta(index, call.arguments_json))

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        # Space on both sides of a removed call collapses to the space before it: "a <call> b" -> "a b".
        if not self._started or (self._after_call and self._pending_space):
            text = text.lstrip()
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if body:
            self._started, self._after_call = True, False
            events.append(ContentDelta(body))


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None, parser: str) -> tuple[str, list[ToolCall]]:
    """The content without call markup (ends trimmed) and the calls, as the stream parser sees them."""
    stream = ToolCallStreamParser(parser, tools)
    events = stream.feed(text) + stream.finish()
    return "".join(e.text for e in events if isinstance(e, ContentDelta)), stream.calls


def _first_marker(text: str, markers: tuple[str, str], since: int = 0) -> tuple[int, str | None]:
    found = [(at, marker) for marker in markers if (at := text.find(marker, since)) >= 0]
    return min(found) if found else (-1, None)
