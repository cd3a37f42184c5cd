"""[loop] POST /v1/responses: the Responses API over the chat path, streamed as its event sequence.

The request runs as a chat request (``responses_input``); its outputs go through the same
``ChoiceBuilder`` (tool calls, reasoning) and come back as Responses output items: ``reasoning``,
``message`` with ``output_text``, and ``function_call``. Streams send ``response.created``,
``response.in_progress``, then per item ``output_item.added`` ... deltas ... ``output_item.done``,
and end with ``response.completed`` (or ``response.incomplete`` at ``max_output_tokens``, or
``response.failed``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from vlmserve.api.chat import Call, serve_call
from vlmserve.api.errors import APIError
from vlmserve.api.flight import sse_event
from vlmserve.api.openai_format import delta_events
from vlmserve.api.responses_input import ResponsesRequest, to_chat_request
from vlmserve.api.state import ServerState
from vlmserve.frontend.output import RequestOutput


async def create_response(req: ResponsesRequest, http: Request, state: ServerState) -> Any:
    shape = _Shape(req, f"resp_{uuid.uuid4().hex}")

    def events(call: Call) -> AsyncIterator[str]:
        shape.model = call.served.name
        return _events(call, shape)

    def whole(call: Call, _: RequestOutput) -> dict[str, Any]:
        shape.model = call.served.name
        return shape.response(call, _status(call.finish), shape.items(call))

    return await serve_call(to_chat_request(req), http, state, shape.id, events, whole)


def _status(finish: str) -> str:
    return "incomplete" if finish == "length" else "completed"


class _Shape:
    """The response object and its items, the same in the stream and at its end."""

    def __init__(self, req: ResponsesRequest, response_id: str) -> None:
        self.req, self.id, self.model, self.created = req, response_id, req.model, int(time.time())

    def items(self, call: Call) -> list[dict[str, Any]]:
        b = call.builder
        items = [self.reasoning(b.reasoning)] if b.reasoning else []
        if b.content or not b.calls:
            items.append(self.message(b.content))
        items += [self.function_call(c.id, c.name, c.arguments_json) for c in b.calls]
        return items

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{self.id[5:]}", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def message(self, text: str | None, status: str = "completed") -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text)]
        return {"type": "message", "id": f"msg_{self.id[5:]}", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def function_call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def response(self, call: Call | None, status: str, output: list[dict[str, Any]],
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        req = self.req
        usage = call.builder.usage if call is not None else {}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": error, "instructions": req.instructions, "metadata": req.metadata or {},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "store": False, "text": req.text or {"format": {"type": "text"}},
            "usage": _usage(usage) if usage and status != "in_progress" else None,
        }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


class _Events:
    """Numbered SSE events, and the one output item open at a time."""

    def __init__(self, shape: _Shape) -> None:
        self.shape, self.seq = shape, 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed: its kind and its text so far

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(payload, kind)

    def start(self, kind: str, item: dict[str, Any], text: str = "") -> list[str]:
        events = self.close()
        self.open = {"kind": kind, "item": item, "text": text, "index": len(self.items)}
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=self.open["index"], item=item))
        if kind == "message":
            events.append(self._part("response.content_part.added", self.shape.text_part("")))
        return events

    def text(self, kind: str, delta: str) -> list[str]:
        s = self.shape
        events = [] if self.open and self.open["kind"] == kind else self.start(
            kind, s.message(None, "in_progress") if kind == "message" else s.reasoning("", "in_progress"))
        assert self.open is not None
        self.open["text"] += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self.event(name, item_id=self.open["item"]["id"], output_index=self.open["index"],
                                 content_index=0, delta=delta, **({"logprobs": []} if kind == "message" else {})))
        return events

    def arguments(self, delta: str) -> list[str]:
        assert self.open is not None and self.open["kind"] == "function_call"
        self.open["text"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=self.open["item"]["id"],
                           output_index=self.open["index"], delta=delta)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        o, s, events = self.open, self.shape, []
        item_id, index = o["item"]["id"], o["index"]
        if o["kind"] == "message":
            final = s.message(o["text"])
            events += [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                  text=o["text"], logprobs=[]),
                       self._part("response.content_part.done", s.text_part(o["text"]))]
        elif o["kind"] == "reasoning":
            final = s.reasoning(o["text"])
            events.append(self.event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                     content_index=0, text=o["text"]))
        else:
            item = o["item"]
            final = s.function_call(item["call_id"], item["name"], o["text"])
            events.append(self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                     name=item["name"], arguments=o["text"]))
        self.items[index] = final
        events.append(self.event("response.output_item.done", output_index=index, item=final))
        self.open = None
        return events

    def _part(self, kind: str, part: dict[str, Any]) -> str:
        assert self.open is not None
        return self.event(kind, item_id=self.open["item"]["id"], output_index=self.open["index"], content_index=0,
                          part=part)


async def _events(call: Call, shape: _Shape) -> AsyncIterator[str]:
    ev, b, status = _Events(shape), call.builder, "disconnected"
    try:
        yield ev.event("response.created", response=shape.response(None, "in_progress", []))
        yield ev.event("response.in_progress", response=shape.response(None, "in_progress", []))
        out, sink = call.first, _DeltaSink(ev)
        async for out in call.flight.outputs():
            for chunk in delta_events(b.step(out), sink):
                yield chunk
        for chunk in ev.close():
            yield chunk
        status = call.finish = b.finish_reason(out.finish_reason)
        final = _status(call.finish)
        yield ev.event(f"response.{final}", response=shape.response(call, final, ev.items))
    except APIError as error:  # the stream has begun: it ends failed
        status = "error"
        yield ev.event("response.failed", response=shape.response(
            call, "failed", ev.items, {"code": error.code or "server_error", "message": error.message}))
    finally:
        call.done(status)
        await call.flight.close()


class _DeltaSink:
    """delta_events' sink (openai_format.DeltaEvents) for the Responses API's items."""

    def __init__(self, ev: _Events) -> None:
        self.ev = ev

    def reasoning(self, text: str) -> list[str]:
        return self.ev.text("reasoning", text)

    def content(self, text: str) -> list[str]:
        return self.ev.text("message", text)

    def call_started(self, call_id: str, name: str) -> list[str]:  # its arguments come in later deltas
        return self.ev.start("function_call", self.ev.shape.function_call(call_id, name, "", "in_progress"))

    def arguments(self, text: str) -> list[str]:
        return self.ev.arguments(text)
