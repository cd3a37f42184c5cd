"""[loop] Ollama's API over the chat path, for the local apps that speak it (Open WebUI, Raycast, its clients).

``POST /api/chat`` and ``/api/generate`` run as chat requests (``ollama_input``); their outputs go
through the same ``ChoiceBuilder`` (tool calls, reasoning) and come back as Ollama's objects, one JSON
line each while streaming (NDJSON): ``message`` (chat) or ``response`` (generate) with the text, the
reasoning in ``thinking``, whole tool calls as they end; the last has ``done: true``, the
``done_reason`` and the counts and durations (ns). A fault mid-stream is an ``{"error"}`` line. A request
with nothing to say only loads the model (``done_reason: load``), as Ollama's does. ``/api/tags``,
``/api/show`` and ``/api/ps`` describe the served models; errors on ``/api/`` are ``{"error": "message"}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vlmserve.api.chat import Call, serve_call
from vlmserve.api.errors import APIError
from vlmserve.api.ollama_input import ChatRequest, GenerateRequest, ShowRequest, generate_request, to_chat_request
from vlmserve.api.registry import weights_on_disk
from vlmserve.api.schemas import ChatCompletionRequest
from vlmserve.api.state import ServedModel, ServerState
from vlmserve.frontend.async_engine import ModelInfo
from vlmserve.frontend.output import RequestOutput
from vlmserve.tools import ToolCall

NDJSON = "application/x-ndjson"
LISTED = ("loaded", "loading", "available")  # a model that cannot be served is not listed


async def chat(req: ChatRequest, http: Request, state: ServerState) -> Any:
    if not req.messages:
        return await _load(req.model, state, _Shape("message", False))
    return await _serve(to_chat_request(req), http, state, _Shape("message", bool(req.logprobs)))


async def generate(req: GenerateRequest, http: Request, state: ServerState) -> Any:
    if not req.prompt and not req.images:
        return await _load(req.model, state, _Shape("response", False))
    return await _serve(generate_request(req), http, state, _Shape("response", bool(req.logprobs)))


async def _serve(body: ChatCompletionRequest, http: Request, state: ServerState, shape: _Shape) -> Any:
    body = body.model_copy(update={"model": known_name(body.model, state)})
    return await serve_call(body, http, state, f"ollama-{uuid.uuid4().hex}", lambda call: _lines(call, shape),
                            lambda call, _: shape.whole(call), NDJSON)


async def _load(name: str, state: ServerState, shape: _Shape) -> JSONResponse:
    """An empty request: answered once the model serves (one of --model-dir loads, as for a request)."""
    async with state.using(known_name(name, state)) as served:
        return JSONResponse({**shape.head(served.name), "done": True, "done_reason": "load"})


def known_name(name: str, state: ServerState) -> str:
    """The model a name means: Ollama's clients may add the default tag ``:latest`` to a name without one."""
    if name.endswith(":latest"):
        try:
            state.model(name)
        except APIError:
            return name.removesuffix(":latest")
    return name


@dataclass(slots=True, frozen=True)
class _Shape:
    """Where a reply goes: chat's ``message`` or generate's ``response`` (its ``thinking`` beside it)."""

    key: str
    logprobs: bool

    def head(self, model: str, text: str = "", thinking: str = "", calls: Sequence[ToolCall] = (),
             first: int = 0) -> dict[str, Any]:
        """An object with this text, reasoning and tool calls (``first``: the first call's index)."""
        out: dict[str, Any] = {"model": model, "created_at": _iso(time.time())}
        if self.key == "response":
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
            return out
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments}}
                                     for i, c in enumerate(calls, first)]
        out["message"] = message
        return out

    def whole(self, call: Call) -> dict[str, Any]:
        b = call.builder
        out = {**self.head(call.served.name, b.content, b.reasoning, b.calls), **_end(call)}
        return {**out, "logprobs": b.logprobs} if self.logprobs else out


def _end(call: Call) -> dict[str, Any]:
    """The last object's fields: why it ended, its counts (the engine's usage) and durations in ns (the
    prompt's until the first token)."""
    total = time.perf_counter() - call.timing.start
    prompt = call.timing.ttft if call.timing.ttft is not None else total
    usage = call.builder.usage
    return {"done": True, "done_reason": "length" if call.finish == "length" else "stop",
            "total_duration": _ns(total), "load_duration": 0, "prompt_eval_count": usage.get("prompt_tokens", 0),
            "prompt_eval_duration": _ns(prompt), "eval_count": usage.get("completion_tokens", 0),
            "eval_duration": _ns(total - prompt)}


async def _lines(call: Call, shape: _Shape) -> AsyncIterator[str]:
    b, status, sent = call.builder, "disconnected", 0
    try:
        out: RequestOutput = call.first
        async for out in call.flight.outputs():
            delta = b.step(out)
            calls, first, sent = b.calls[sent:], sent, len(b.calls)  # a call goes out whole, once it has ended
            if delta.content or delta.reasoning or calls or delta.logprobs:
                piece = shape.head(call.served.name, delta.content, delta.reasoning, calls, first)
                yield _line({**piece, "done": False, **({"logprobs": delta.logprobs} if shape.logprobs else {})})
        status = call.finish = b.finish_reason(out.finish_reason)
        yield _line({**shape.head(call.served.name), **_end(call)})
    except APIError as error:  # the stream has begun: the error is its last line
        status = "error"
        yield _line(error.body(ollama=True))
    finally:
        call.done(status)
        await call.flight.close()


def _line(payload: dict[str, Any]) -> str:
    # ASCII JSON: U+2028 and the like stay escaped, so readers that split lines as str.splitlines does
    # (httpx's iter_lines, the ollama client's) never cut an object in two
    return json.dumps(payload, separators=(",", ":")) + "\n"


def tags(state: ServerState) -> dict[str, Any]:
    """Every model this server can serve, loaded or not (``--model-dir``'s as found now)."""
    if state.registry is not None:
        state.registry.rescan()
    return {"models": [_entry(m) for m in state.models if m.status in LISTED]}


def ps(state: ServerState) -> dict[str, Any]:
    """The loaded models, with the memory each holds now (weights and KV reserved: unified memory, all "VRAM")."""
    loaded = [m for m in state.models if m.status == "loaded"]
    return {"models": [{**_entry(m), "size": m.memory_bytes, "size_vram": m.memory_bytes,
                        "context_length": m.engine.info.max_context} for m in loaded]}


def show(req: ShowRequest, state: ServerState) -> dict[str, Any]:
    """What is known of a model without loading it; its family and context length once it has loaded."""
    served = state.model(known_name(req.model or req.name or "", state))
    info = _info(served)
    family = info.model_type if info else ""
    facts = {"general.architecture": family, f"{family}.context_length": info.max_context} if info else {}
    return {"modelfile": "", "parameters": "", "template": "", "details": _details(info), "model_info": facts,
            "modified_at": _iso(info.created if info else 0),
            # every model here takes images (its warm-up runs one); its tool syntax is known once it has loaded
            "capabilities": ["completion", "vision", *(["tools"] if served.tool_parser else [])]}


def _entry(served: ServedModel) -> dict[str, Any]:
    info = _info(served)
    size = info.weights_bytes if info else weights_on_disk(served.path) if served.path else 0
    # No digest: the weights are files in a folder, not a content-addressed blob
    return {"name": served.name, "model": served.name, "modified_at": _iso(info.created if info else 0),
            "size": size, "digest": "", "details": _details(info)}


def _info(served: ServedModel) -> ModelInfo | None:
    return served.engine.info if served.engine.ready else None


def _details(info: ModelInfo | None) -> dict[str, Any]:
    family = info.model_type if info else ""
    return {"parent_model": "", "format": "mlx", "family": family, "families": [family] if family else None,
            "parameter_size": "", "quantization_level": ""}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
