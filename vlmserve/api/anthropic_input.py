"""[loop] An Anthropic Messages API request (``POST /v1/messages``) as the chat request the engine already serves.

Blocks map one to one: ``text`` and ``image`` blocks (base64 or URL) become chat parts, an
assistant's ``tool_use`` blocks its tool calls, a user's ``tool_result`` blocks tool messages (a
result's images in it: the prompt builder moves them to a user turn where a template wants them there),
``system`` the system message, ``tools`` (``input_schema``) function tools, ``tool_choice`` (auto, any,
tool, none) the chat's, ``stop_sequences`` the stop strings, ``output_config.format`` (a JSON schema) the
``response_format`` and ``thinking`` the template's ``enable_thinking``. Earlier ``thinking`` blocks
are not sent back to the model. ``cache_control`` breakpoints (on tools, system blocks, content blocks,
or the request itself) keep the prompt's cached prefix from eviction for the longest TTL among them
(``cache_ttl``): the prefix cache keeps whole prompts, each holding every breakpoint's prefix.
``temperature``, ``top_p`` and ``top_k`` are taken as the API took them (its SDKs since 2.x send them
only through ``extra_body``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vlmserve.api.errors import bad_request
from vlmserve.api.messages import chat_request, extensions
from vlmserve.api.schemas import ChatCompletionRequest

IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


class MessagesRequest(BaseModel):
    # service_tier, container: nothing to do here; cache_control (automatic caching): as on a block;
    # vLLM's sampling extensions: as on chat
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema the reply follows; effort: ignored
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat requests


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: a Messages request's prompt, without sampling."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": _system(req.system)}] if req.system else []
    for i, message in enumerate(req.messages):
        messages += _message(message, f"messages.{i}")
    body: dict[str, Any] = {"model": req.model, "messages": messages,
                            "chat_template_kwargs": _template_kwargs(req.thinking, req.chat_template_kwargs)}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stop=req.stop_sequences)
        body["response_format"] = _format((req.output_config or {}).get("format"))
        body["cache_ttl"] = cache_ttl(req)
        body.update(extensions(req.model_extra, body))
    if req.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
        body["parallel_tool_calls"] = False if req.tool_choice.get("disable_parallel_tool_use") else None
    return chat_request(body)


TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache_control TTLs, in seconds


def cache_ttl(req: MessagesRequest) -> float | None:
    """The longest TTL of the request's ``cache_control`` breakpoints (None: it has none); one that is not
    ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` is a 400, as Anthropic's."""
    marked: list[tuple[str, Any]] = [("cache_control", (req.model_extra or {}).get("cache_control"))]
    blocks = [(f"tools.{i}", t) for i, t in enumerate(req.tools or [])]
    blocks += [(f"system.{i}", b) for i, b in enumerate(req.system if isinstance(req.system, list) else [])]
    for i, message in enumerate(req.messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            inner = block.get("content") if isinstance(block, dict) else None
            blocks += [(f"messages.{i}.content.{j}", block)]
            blocks += [(f"messages.{i}.content.{j}.content.{k}", b) for k, b in
                       enumerate(inner if isinstance(inner, list) else [])]
    marked += [(f"{where}.cache_control", b.get("cache_control")) for where, b in blocks if isinstance(b, dict)]
    ttls = [_ttl(control, where) for where, control in marked if control is not None]
    return max(ttls) if ttls else None


def _ttl(control: Any, where: str) -> float:
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise bad_request(f"{where}: cache_control is {{\"type\": \"ephemeral\"}}, with an optional ttl",
                          where, "invalid_value")
    ttl = control.get("ttl", "5m")
    if ttl not in TTLS:
        raise bad_request(f"{where}.ttl: {ttl!r} is not one of 5m, 1h", f"{where}.ttl", "invalid_value")
    return TTLS[ttl]


def _system(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise bad_request(f"system.{i}: system blocks must be text", f"system.{i}", "invalid_value")
        texts.append(str(block.get("text", "")))
    return "\n\n".join(texts)


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn may start with tool results."""
    if not isinstance(message, dict):
        raise bad_request(f"{where}: a message must be an object", where, "invalid_value")
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role: {role!r} is not user or assistant (the system prompt is the top-level "
                          "system field)", f"{where}.role", "invalid_value")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: a string or a list of content blocks", f"{where}.content",
                          "invalid_value")
    if role == "assistant":
        return [_assistant(content, f"{where}.content")]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(block, at)
        if kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _tool_result(block, at)})
        else:
            parts.append(_part(block, kind, at))
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = _kind(block, at)
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input: a tool_use block's input is an object", f"{at}.input", "invalid_value")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(arguments)}})
        elif kind not in ("thinking", "redacted_thinking"):  # earlier reasoning is not sent back to the model
            raise bad_request(f"{at}: assistant content blocks of type {kind!r} are not supported (text, tool_use, "
                              "thinking)", at, "unsupported_value")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where}: a content block is an object with a type", where, "invalid_value")
    return str(block["type"])


def _part(block: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    if kind == "text":
        return {"type": "text", "text": str(block.get("text", ""))}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{where}.source")}}
    raise bad_request(f"{where}: content blocks of type {kind!r} are not supported (text, image, tool_result)",
                      where, "unsupported_value")


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the URL the chat path fetches: a data URL for base64."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media = source.get("media_type")
        if media not in IMAGE_TYPES:
            raise bad_request(f"{where}.media_type: {media!r} is not one of {', '.join(sorted(IMAGE_TYPES))}",
                              f"{where}.media_type", "invalid_value")
        return f"data:{media};base64,{source.get('data', '')}"
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return str(source["url"])
    raise bad_request(f"{where}: an image source is base64 (media_type, data) or url (file sources are not "
                      "supported)", where, "unsupported_value")


def _tool_result(block: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    """A tool result's content for the tool message: its text, or with images its text and image parts in
    order (the text blocks' texts joined by newlines, as a result without images has them)."""
    content = block.get("content", "")
    prefix = "Error: " if block.get("is_error") else ""
    if isinstance(content, str):
        return prefix + content
    parts: list[dict[str, Any]] = [{"type": "text", "text": prefix}] if prefix else []
    texts = 0
    for k, inner in enumerate(content if isinstance(content, list) else []):
        at = f"{where}.content.{k}"
        kind = _kind(inner, at)
        if kind == "image":
            parts.append(_part(inner, kind, at))
        elif kind == "text":
            parts.append({"type": "text", "text": "\n" * (texts > 0) + str(inner.get("text", ""))})
            texts += 1
        else:
            raise bad_request(f"{at}: tool_result blocks of type {kind!r} are not supported (text, image)", at,
                              "unsupported_value")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type", "custom") != "custom":
        raise bad_request(f"{where}: server tools ({tool.get('type')!r}) are not supported; give custom tools "
                          "(name, description, input_schema)", where, "unsupported_value")
    function: dict[str, Any] = {"name": tool.get("name"), "parameters": tool.get("input_schema") or
                                {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> Any:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"tool_choice: type {kind!r} is not one of auto, any, tool, none", "tool_choice.type",
                      "invalid_value")


def _format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format: give {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config.format", "invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _template_kwargs(thinking: dict[str, Any] | None, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """``thinking`` as the templates that reason take it (``enable_thinking``); absent: the model's default."""
    kind = thinking.get("type") if thinking else None
    if kind is None:
        return given
    if kind not in ("enabled", "adaptive", "between_tools", "disabled"):
        raise bad_request(f"thinking.type: {kind!r} is not enabled, adaptive, between_tools or disabled",
                          "thinking.type", "invalid_value")
    return {"enable_thinking": kind != "disabled", **(given or {})}
