"""[loop] An Ollama request (``POST /api/chat``, ``/api/generate``) as the chat request the engine already serves.

Messages map one to one: ``images`` (base64, no ``data:`` prefix) become data-URL image parts, an
assistant's ``tool_calls`` (arguments as an object) the chat's, and ``tool`` messages answer those
calls in order (``tool_name`` names the function). A generate is a one-turn chat: ``system``, then the
``prompt`` with its ``images``. ``format`` ("json" or a JSON schema) is the ``response_format``,
``think`` the template's ``enable_thinking``, and ``options`` the sampling: Ollama's names
(``num_predict``, ``repeat_penalty``) and vLLM's extensions as on chat (``messages.extensions``);
Ollama's load-time knobs are accepted and ignored, and what would change the output but cannot be
run here (``mirostat``, ``tfs_z``, ``typical_p``, another penalty window) is a 400 naming it.
"""

from __future__ import annotations

import binascii
import json
from collections import deque
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlmserve.api.errors import bad_request
from vlmserve.api.messages import HONOURED_EXTENSIONS, UNHONOURED_EXTENSIONS, chat_request, extensions
from vlmserve.api.schemas import ChatCompletionRequest

PENALTY_WINDOW = 64  # the recent tokens the penalties look at (engine/sampler.py's PENALTY_CONTEXT; tested equal)

# Ollama's server-side knobs (memory, threads, context size, deprecated ones): accepted, nothing to do here
IGNORED_OPTIONS = frozenset({"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                             "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
                             "penalize_newline", "mirostat_tau", "mirostat_eta"})
# Ollama's samplers this server does not run, with the value that turns each off: another is a 400
NEUTRAL_OPTIONS: dict[str, float] = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
RENAMED_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "num_predict": "max_tokens",
                   "repeat_penalty": "repetition_penalty"}
PENALTIES = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # and their neutral values
KNOWN_OPTIONS = frozenset({*IGNORED_OPTIONS, *NEUTRAL_OPTIONS, *RENAMED_OPTIONS, "repeat_last_n",
                           *HONOURED_EXTENSIONS, *UNHONOURED_EXTENSIONS})  # vLLM's extensions: as on chat
THINK_LEVELS = ("low", "medium", "high")

# What each image format's file starts with (WebP: RIFF, then the size, then WEBP)
MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF87a", "gif"), (b"GIF89a", "gif"))


class ToolFunction(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    id: str | None = None  # newer Ollama versions number their calls
    function: ToolFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None  # earlier reasoning: not sent back to the model


class _Generation(BaseModel):
    """What chat and generate share."""

    model_config = ConfigDict(extra="ignore")  # as Ollama's server does

    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    think: bool | str | None = None
    keep_alive: float | str | None = None  # how long Ollama keeps a model loaded: here --idle-unload-s says
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)  # none: just load the model
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generation):
    prompt: str = ""  # empty, without images: just load the model
    system: str | None = None
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None


class ShowRequest(BaseModel):
    model: str | None = None
    name: str | None = None  # what older clients send


def to_chat_request(req: ChatRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    pending: deque[dict[str, Any]] = deque()  # the assistant's calls still waiting for their results
    for i, m in enumerate(req.messages):
        message: dict[str, Any] = {"role": m.role, "content": _content(m.content, m.images, f"messages.{i}.images")}
        if m.role == "assistant" and m.tool_calls:
            message["tool_calls"] = [_call(c, f"call_{i}_{j}") for j, c in enumerate(m.tool_calls)]
            pending = deque(message["tool_calls"])
        elif m.role == "tool":
            answered = pending.popleft() if pending else None
            message["tool_call_id"] = m.tool_call_id or (answered["id"] if answered else None)
            message["name"] = m.tool_name or (answered["function"]["name"] if answered else None)
        messages.append(message)
    body = _body(req, messages)
    if req.tools:
        body["tools"] = req.tools
    return chat_request(body)


def generate_request(req: GenerateRequest) -> ChatCompletionRequest:
    """A generate as a one-turn chat; what only a raw prompt can do is refused."""
    for name, wants in (("raw", req.raw), ("suffix", req.suffix), ("template", req.template),
                        ("context", req.context)):
        if wants:
            raise bad_request(f"{name}: not supported here (a generate runs as one chat turn through the model's "
                              "own template; send the conversation to /api/chat instead)", name, "unsupported_value")
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": _content(req.prompt, req.images, "images")})
    return chat_request(_body(req, messages))


def _body(req: _Generation, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "response_format": _format(req.format), "chat_template_kwargs": _thinking(req.think),
                            "logprobs": req.logprobs, "top_logprobs": req.top_logprobs}
    body.update(sampling(req.options or {}))
    return body


def sampling(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as the chat request's sampling fields; a 400 naming one this server cannot honour."""
    given = {k: v for k, v in options.items() if v is not None}
    _refuse_unrunnable(given)
    out = {field: given[name] for name, field in RENAMED_OPTIONS.items() if name in given}
    predict = out.get("max_tokens")
    if predict is not None and (not isinstance(predict, int) or predict == 0):
        raise bad_request("options.num_predict: a whole number of tokens, or -1 for the server's default",
                          "options.num_predict", "invalid_value")
    if isinstance(predict, int) and predict < 0:  # -1 (no limit), -2 (fill the context): the server's default
        del out["max_tokens"]
    if isinstance(given.get("seed"), int) and given["seed"] < 0:  # Ollama's -1: a random seed
        del given["seed"]
    return {**out, **extensions(given, out)}


def _refuse_unrunnable(given: dict[str, Any]) -> None:
    """A 400 for an option that would change the output and is not run here, or one nobody knows."""
    for name, off in NEUTRAL_OPTIONS.items():
        if name in given and given[name] != off:
            raise bad_request(f"options.{name}: this server does not run it (give {off:g} or leave it out)",
                              f"options.{name}", "unsupported_value")
    penalized = any(given.get(name, off) != off for name, off in PENALTIES.items())
    if penalized and given.get("repeat_last_n", PENALTY_WINDOW) != PENALTY_WINDOW:
        raise bad_request(f"options.repeat_last_n: the penalties here look at the last {PENALTY_WINDOW} tokens "
                          f"(give {PENALTY_WINDOW} or leave it out)", "options.repeat_last_n", "unsupported_value")
    unknown = sorted(set(given) - KNOWN_OPTIONS)
    if unknown:
        raise bad_request(f"options.{unknown[0]}: not an option this server knows", f"options.{unknown[0]}",
                          "invalid_value")


def _content(text: str, images: list[str] | None, where: str) -> Any:
    """A message's text, with its images before it as data-URL parts."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(image, f"{where}.{k}")}}
                                   for k, image in enumerate(images)]
    return [*parts, {"type": "text", "text": text}]


def data_url(image: str, where: str) -> str:
    """A base64 image as a data URL of its format (PNG, JPEG, GIF, WebP: read from its first bytes)."""
    if image.startswith("data:image/"):  # some clients send the URL itself
        return image
    try:
        head = binascii.a2b_base64(image[:16])
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: not base64 image data", where, "invalid_image") from None
    kind = "webp" if head[:4] == b"RIFF" and head[8:12] == b"WEBP" else next(
        (name for magic, name in MAGIC if head.startswith(magic)), None)
    if kind is None:
        raise bad_request(f"{where}: not a PNG, JPEG, GIF or WebP image", where, "invalid_image")
    return f"data:image/{kind};base64,{image}"


def _call(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call.id or call_id, "type": "function",
            "function": {"name": call.function.name, "arguments": json.dumps(call.function.arguments)}}


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if not fmt:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt, "strict": True}}
    raise bad_request(f"format: {fmt!r} is not \"json\" or a JSON schema", "format", "invalid_value")


def _thinking(think: bool | str | None) -> dict[str, Any] | None:
    """``think`` as the templates that reason take it (``enable_thinking``); absent: the model's default."""
    if think is None:
        return None
    if isinstance(think, str) and think not in THINK_LEVELS:
        raise bad_request(f"think: {think!r} is not true, false or one of {', '.join(THINK_LEVELS)}", "think",
                          "invalid_value")
    return {"enable_thinking": think if isinstance(think, bool) else True}
