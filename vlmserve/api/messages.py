"""[loop] An OpenAI chat request -> template messages, image sources, tools and sampling params."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from vlmserve.api.billing import without_billing_header
from vlmserve.api.errors import bad_request
from vlmserve.api.limits import check_json
from vlmserve.api.schemas import (
    AudioPart,
    ChatCompletionRequest,
    ImagePart,
    Message,
    NamedToolChoice,
    SamplingFields,
    VideoPart,
)
from vlmserve.engine.params import SamplingParams
from vlmserve.preprocess.guided import GuideSpec
from vlmserve.preprocess.media import MediaPolicy
from vlmserve.preprocess.video import VideoSampling

JSON_INSTRUCTION = "Respond only with a single valid JSON object."
REQUIRED_TOOL_INSTRUCTION = "You must answer by calling one of the available tools."


@dataclass(slots=True, frozen=True)
class ChatInput:
    """What phase 1 needs: messages for the chat template (images as ``{"type": "image"}``)."""

    messages: list[dict[str, Any]]
    image_urls: list[str]
    tools: list[dict[str, Any]] | None
    instructions: str = ""  # for the system message, wherever the model's template keeps it
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the chat template's own variables
    image_kwargs: dict[str, int] = field(default_factory=dict)  # the processor's min_pixels/max_pixels
    image_details: list[str | None] = field(default_factory=list)  # each image's detail (low, high, auto)
    video_urls: list[str] = field(default_factory=list)
    video_sampling: VideoSampling = VideoSampling()  # the request's fps/max_frames over the server's
    billing_headers: tuple[str, ...] = ()  # Claude Code's billing lines, dropped from system messages (api/billing.py)
    audio: list[tuple[str, str]] = field(default_factory=list)  # each input_audio's (base64 data, format)


# apply_chat_template's own arguments, and the template itself: never a template variable from a client
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict",
                                      "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
                                      "truncation", "max_length", "processor_kwargs"})


def template_kwargs(defaults: Mapping[str, Any], given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The server's default template variables with the request's over them; 400 for a reserved name."""
    merged = {**defaults, **(given or {})}
    for name in merged:
        if name in RESERVED_TEMPLATE_KWARGS or not name.isidentifier():
            raise bad_request(f"chat_template_kwargs: {name!r} cannot be set (it is not a template variable)",
                              "chat_template_kwargs", "invalid_value")
    return merged


# vLLM's sampling extensions, as a chat request takes them: Responses and Messages honour them the same way
HONOURED_EXTENSIONS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
                       "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")
# vLLM's sampling extensions this server does not run, with the value that asks for nothing: another is a 400
UNHONOURED_EXTENSIONS: dict[str, Any] = {
    "best_of": 1, "use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "bad_words": None, "prompt_logprobs": None,
}  # fmt: skip


def extensions(extra: Mapping[str, Any] | None, own: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM sampling extensions among another API's unknown fields ``extra``, to pass on to the chat
    request (``own``: what the API's own fields already set, which wins); a 400 naming one that asks for
    what no endpoint here does. Fields of neither kind are the API's own that need nothing here."""
    extra = extra or {}
    for name, nothing in UNHONOURED_EXTENSIONS.items():
        value = extra.get(name)
        if value not in (None, nothing, []):
            raise bad_request(f"{name}: this server does not support it (vLLM's sampling extension)", name,
                              "unsupported_value")
    return {name: extra[name] for name in HONOURED_EXTENSIONS if name in extra and own.get(name) is None}


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request built from another API's body (Responses, /tokenize); its first invalid field is a 400."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", where, "invalid_value") from None


IMAGE_KWARGS = ("min_pixels", "max_pixels")
VIDEO_KWARGS = ("fps", "max_frames")
MAX_VIDEO_FPS = 60.0


def image_kwargs(given: Mapping[str, int | float] | None, model_max_pixels: int | None, model: str) -> dict[str, int]:
    """A request's ``mm_processor_kwargs`` for images: ``min_pixels``/``max_pixels`` for processors that
    resize to a pixel budget (Qwen's), no more than the model's own ``max_pixels`` (the server's cap)."""
    given = {k: v for k, v in (given or {}).items() if k not in VIDEO_KWARGS}
    if not given:
        return {}
    unknown = sorted(set(given) - set(IMAGE_KWARGS))
    if unknown:
        raise bad_request(f"mm_processor_kwargs: {', '.join(unknown)} cannot be set ({', '.join(IMAGE_KWARGS)}, "
                          f"{', '.join(VIDEO_KWARGS)} can)", "mm_processor_kwargs", "invalid_value")
    if model_max_pixels is None:
        raise bad_request(f"mm_processor_kwargs: model {model!r}'s image processor takes no min_pixels/max_pixels",
                          "mm_processor_kwargs", "unsupported_value")
    if not all(isinstance(v, int) for v in given.values()):
        raise bad_request("mm_processor_kwargs: min_pixels and max_pixels are whole numbers", "mm_processor_kwargs",
                          "invalid_value")
    low, high = given.get("min_pixels", 1), given.get("max_pixels", model_max_pixels)
    if not 1 <= low <= high <= model_max_pixels:
        raise bad_request(f"mm_processor_kwargs: need 1 <= min_pixels <= max_pixels <= {model_max_pixels} (the "
                          f"model's own max_pixels)", "mm_processor_kwargs", "invalid_value")
    return {k: int(v) for k, v in given.items()}


def video_sampling(given: Mapping[str, int | float] | None, server: VideoSampling) -> VideoSampling:
    """A request's ``fps`` and ``max_frames`` (``mm_processor_kwargs``) over the server's defaults; the
    server's ``max_frames`` is also the most a request may ask for."""
    given = given or {}
    fps, most = given.get("fps"), given.get("max_frames")
    if fps is not None and not 0 < fps <= MAX_VIDEO_FPS:
        raise bad_request(f"mm_processor_kwargs: fps {fps} is not in (0, {MAX_VIDEO_FPS:g}]", "mm_processor_kwargs",
                          "invalid_value")
    cap = server.max_frames
    if most is not None and (not isinstance(most, int) or not 2 <= most <= (cap or most)):
        raise bad_request(f"mm_processor_kwargs: max_frames {most} is not a whole number in [2, {cap}] (the "
                          f"server's --video-max-frames)", "mm_processor_kwargs", "invalid_value")
    return VideoSampling(fps=float(fps) if fps is not None else None, max_frames=most).merge(server)


def to_chat_input(req: ChatCompletionRequest, media: MediaPolicy,
                  default_template_kwargs: Mapping[str, Any] | None = None,
                  model_max_pixels: int | None = None, tool_format: str | None = None) -> ChatInput:
    """``tool_format``: the model's tool-call syntax, where a grammar can force a call in it (then a forced
    call's prompt is the one ``auto`` would have: every tool, no instruction, so an agent's forced turn
    reuses its session's cached prompt)."""
    _check_structures(req)
    urls: list[str] = []
    details: list[str | None] = []
    videos: list[str] = []
    clips: list[tuple[str, str]] = []
    names = _tool_call_names(req.messages)
    sent = [without_billing_header(m) for m in req.messages]  # indices stay the request's, for errors
    messages = [_message(m, i, _Media(urls, details, videos, clips), names) for i, (m, _) in enumerate(sent)
                if m is not None]
    for kind, count, most in (("images", len(urls), media.max_images), ("videos", len(videos), media.max_videos),
                              ("audio clips", len(clips), media.max_audio)):
        if count > most:
            raise bad_request(f"messages: {count} {kind} is over the limit of {most} per request (the server's "
                              f"--limit-mm-per-prompt)", "messages", f"too_many_{kind.split()[0]}")
    enforced = tool_format is not None and _forced(req)
    return ChatInput(messages, urls, _tools_for_template(req, every=enforced), _instructions(req, enforced),
                     template_kwargs(default_template_kwargs or {}, req.chat_template_kwargs),
                     image_kwargs(req.mm_processor_kwargs, model_max_pixels, req.model), details, videos,
                     video_sampling(req.mm_processor_kwargs, media.video_sampling),
                     tuple(header for _, header in sent if header), clips)


@dataclass(slots=True, frozen=True)
class _Media:
    """Where one request's media parts are collected, in order."""

    image_urls: list[str]
    image_details: list[str | None]
    video_urls: list[str]
    audio: list[tuple[str, str]]


def _message(m: Message, index: int, media: _Media, names: dict[str, str]) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": _content(m, index, media)}
    if m.role == "assistant" and m.tool_calls:
        out["tool_calls"] = [_tool_call(tc, index, j) for j, tc in enumerate(m.tool_calls)]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        out["name"] = m.name or names.get(m.tool_call_id or "", "")
    return out


def _content(m: Message, index: int, media: _Media) -> str | list[dict[str, Any]]:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts: list[dict[str, Any]] = []
    for part in m.content:
        if isinstance(part, VideoPart) and m.role != "user":
            raise bad_request(f"messages.{index}: videos are only allowed in user messages", f"messages.{index}.content")
        if isinstance(part, ImagePart) and m.role not in ("user", "tool"):
            raise bad_request(f"messages.{index}: images are only allowed in user and tool messages",
                              f"messages.{index}.content")
        if isinstance(part, AudioPart) and m.role != "user":
            raise bad_request(f"messages.{index}: audio is only allowed in user messages", f"messages.{index}.content")
        if isinstance(part, AudioPart):
            media.audio.append((part.input_audio.data, part.input_audio.format))
            parts.append({"type": "audio"})
        elif isinstance(part, ImagePart):
            media.image_urls.append(part.image_url.url)
            media.image_details.append(part.image_url.detail)
            parts.append({"type": "image"})
        elif isinstance(part, VideoPart):
            media.video_urls.append(part.video_url.url)
            parts.append({"type": "video"})
        else:
            parts.append({"type": "text", "text": part.text})
    if m.role == "user" or (m.role == "tool" and any(p["type"] == "image" for p in parts)):
        return parts  # a tool result's images stay with it: the prompt builder moves them where a template needs
    return "".join(p.get("text", "") for p in parts)  # templates expect plain text outside user turns


def _check_structures(req: ChatCompletionRequest) -> None:
    """Schemas are bounded, and a tool choice names tools that were given."""
    for i, tool in enumerate(req.tools or ()):
        check_json(tool.function.parameters, f"tools.{i}.function.parameters")
    if req.response_format is not None and req.response_format.json_schema is not None:
        check_json(req.response_format.json_schema, "response_format.json_schema")
    if _forced(req) and not req.tools:
        raise bad_request("tool_choice requires tools, and none were given", "tool_choice", "missing_tools")


def _tool_call(tc: Any, index: int, j: int) -> dict[str, Any]:
    param = f"messages.{index}.tool_calls.{j}.function.arguments"
    try:
        arguments = json.loads(tc.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise bad_request(f"{param} is not valid JSON: {exc.msg}", param) from None
    except RecursionError:
        raise bad_request(f"{param} nests too deep", param, "json_too_deep") from None
    check_json(arguments, param)
    return {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": arguments}}


def _tool_call_names(messages: list[Message]) -> dict[str, str]:
    return {tc.id: tc.function.name for m in messages for tc in (m.tool_calls or []) if tc.id}


def _forced(req: ChatCompletionRequest) -> bool:
    return req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)


def _tools_for_template(req: ChatCompletionRequest, every: bool = False) -> list[dict[str, Any]] | None:
    """The tools the prompt (or a forced call's grammar) offers: the named one only, unless ``every``."""
    if not req.tools or req.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(req.tool_choice, NamedToolChoice):
        named = [t for t in tools if t["function"]["name"] == req.tool_choice.function.name]
        if not named:
            raise bad_request(f"tool_choice names {req.tool_choice.function.name!r}, which is not in tools", "tool_choice")
        tools = tools if every else named
    return tools


def _instructions(req: ChatCompletionRequest, enforced: bool = False) -> str:
    lines = []
    if req.response_format is not None and req.response_format.type in ("json_object", "json_schema"):
        lines.append(JSON_INSTRUCTION)
        if req.response_format.json_schema:
            lines.append("The JSON must match this schema: " + json.dumps(req.response_format.json_schema))
    if req.tools and _forced(req) and not enforced:  # a grammar that forces the call needs no words
        lines.append(REQUIRED_TOOL_INSTRUCTION)
    return " ".join(lines)


def guide_spec(req: ChatCompletionRequest, tool_format: str | None) -> tuple[GuideSpec, str] | None:
    """What to constrain the output to, and the parameter that asked: a forced tool call first, then
    ``structured_outputs``, then ``response_format``."""
    if req.tools and _forced(req) and tool_format:
        return GuideSpec("tool_call", {"format": tool_format, "tools": _tools_for_template(req)}), "tool_choice"
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.model_dump().items() if v is not None}
        if len(given) != 1:
            raise bad_request("structured_outputs: give exactly one of json, regex, choice, grammar",
                              "structured_outputs")
        (kind, value), = given.items()
        if kind == "json_schema":
            check_json(value, "structured_outputs.json")
        return GuideSpec(kind, value), "structured_outputs"
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        return (GuideSpec("json_schema", schema) if schema else GuideSpec("json_object")), "response_format"
    if fmt is not None and fmt.type == "json_object":
        return GuideSpec("json_object"), "response_format"
    return None


def to_sampling_params(req: ChatCompletionRequest, default_max_tokens: int, vocab_size: int) -> SamplingParams:
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    if req.prompt_logprobs and req.stream:  # vLLM's rule and words (0 streams, without them)
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens, logprobs=bool(req.logprobs),
                             top_logprobs=req.top_logprobs or 0, vocab_size=vocab_size,
                             default_max_tokens=default_max_tokens)
    scored = req.prompt_logprobs is not None and not req.stream
    return dataclasses.replace(params, prompt_logprobs=req.prompt_logprobs) if scored else params


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                    vocab_size: int, default_max_tokens: int) -> SamplingParams:
    """The engine's sampling parameters from the fields every API shares (``SamplingFields``: chat, and
    Responses and Messages as chat requests, and completions) and those each names its own way
    (``max_tokens``, ``logprobs``), OpenAI's defaults where a field is absent; what the engine refuses is
    a 400. A new sampling field is read here, once."""
    stop = req.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 8:
        raise bad_request("stop: at most 8 stop sequences", "stop")
    try:
        return SamplingParams(
            max_tokens=max_tokens or default_max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            stop=stops,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            logit_bias=_logit_bias(req.logit_bias or {}, vocab_size),
            cache_ttl_s=req.cache_ttl or 0.0,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings) as (id, bias) pairs, each id a token of the model's."""
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.strip().isdecimal() else -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                              "logit_bias", "invalid_value")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias: the bias of token {token} is {value}; biases are in [-100, 100]",
                              "logit_bias", "invalid_value")
        pairs.append((token, float(value)))
    return tuple(pairs)
