"""[loop] POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The request runs as a chat request (``anthropic_input``); its outputs go through the same
``ChoiceBuilder`` (tool calls, reasoning) and come back as content blocks: ``thinking``, ``text``
and ``tool_use``. Streams send ``message_start``, then per block ``content_block_start`` ...
``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) ...
``content_block_stop``, then ``message_delta`` with the stop reason and usage, and ``message_stop``;
an engine fault mid-stream is an ``error`` event. Errors on these paths have Anthropic's shape
(``errors.APIError.body``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from vlmserve.api.anthropic_input import CountTokensRequest, MessagesRequest, to_chat_request
from vlmserve.api.chat import Call, serve_call
from vlmserve.api.errors import APIError
from vlmserve.api.flight import sse_event
from vlmserve.api.openai_format import Delta, delta_events
from vlmserve.api.state import ServerState
from vlmserve.api.tokenize import chat_prompt_ids
from vlmserve.frontend.output import RequestOutput


async def create_message(req: MessagesRequest, http: Request, state: ServerState) -> Any:
    return await serve_call(to_chat_request(req), http, state, f"msg_{uuid.uuid4().hex}", _events,
                            lambda call, last: message(call, blocks(call), *stop_reason(call.finish, last), usage(last)))


async def count_tokens(req: CountTokensRequest, state: ServerState) -> dict[str, int]:
    """What a Messages request with these messages, system prompt and tools costs in prompt tokens."""
    return {"input_tokens": len(await chat_prompt_ids(to_chat_request(req), state))}


def message(call: Call, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
            counts: dict[str, int]) -> dict[str, Any]:
    return {"id": call.builder.id, "type": "message", "role": "assistant", "model": call.served.name,
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": counts}


def blocks(call: Call) -> list[dict[str, Any]]:
    """The reply's content blocks: its reasoning, its text, its tool calls."""
    b = call.builder
    out: list[dict[str, Any]] = [{"type": "thinking", "thinking": b.reasoning, "signature": ""}] if b.reasoning else []
    if b.content or not b.calls:
        out.append({"type": "text", "text": b.content})
    out += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments_json)} for c in b.calls]
    return out


def stop_reason(finish: str, last: RequestOutput) -> tuple[str, str | None]:
    """Anthropic's stop reason (and the stop sequence that matched) for the chat path's finish."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if last.stop_string is not None:
        return "stop_sequence", last.stop_string
    return "end_turn", None


def usage(out: RequestOutput) -> dict[str, int]:
    """Anthropic counts the prompt in three: read from the cache, newly written to it (every prompt the
    prefix cache keeps, with or without a breakpoint: this server caches on its own), and the rest."""
    written = out.num_cache_written_tokens
    return {"input_tokens": out.num_prompt_tokens - out.num_cached_tokens - written,
            "output_tokens": out.num_completion_tokens, "cache_read_input_tokens": out.num_cached_tokens,
            "cache_creation_input_tokens": written}


class _Blocks:
    """The stream's content blocks, one open at a time, numbered from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def feed(self, delta: Delta) -> list[str]:
        return delta_events(delta, self)

    # delta_events' sink (openai_format.DeltaEvents)
    def reasoning(self, text: str) -> list[str]:
        return self._text("thinking", text)

    def content(self, text: str) -> list[str]:
        return self._text("text", text)

    def call_started(self, call_id: str, name: str) -> list[str]:  # its input comes in later deltas
        return self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def arguments(self, text: str) -> list[str]:
        return [self._delta({"type": "input_json_delta", "partial_json": text})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _text(self, kind: str, text: str) -> list[str]:
        """``kind`` is thinking or text: the block's type, the field its text is in, and its delta's prefix."""
        block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        events = [] if self.open == kind else self._start(block)
        events.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return events

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        events.append(sse_event({"type": "content_block_start", "index": self.index, "content_block": block},
                                "content_block_start"))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")


async def _events(call: Call) -> AsyncIterator[str]:
    b, status, open_blocks = call.builder, "disconnected", _Blocks()
    try:
        start = {**usage(call.first), "output_tokens": 0}
        yield sse_event({"type": "message_start", "message": message(call, [], None, None, start)}, "message_start")
        yield sse_event({"type": "ping"}, "ping")
        out = call.first
        async for out in call.flight.outputs():
            for event in open_blocks.feed(b.step(out)):
                yield event
        for event in open_blocks.close():
            yield event
        status = call.finish = b.finish_reason(out.finish_reason)
        reason, sequence = stop_reason(call.finish, out)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": usage(out)}, "message_delta")
        yield sse_event({"type": "message_stop"}, "message_stop")
    except APIError as error:  # the stream has begun: the error is its last event
        status = "error"
        yield sse_event(error.body(anthropic=True), "error")
    finally:
        call.done(status)
        await call.flight.close()
