"""[loop] A Responses API request (``POST /v1/responses``) as the chat request the engine already serves.

Input items map one to one: messages with ``input_text``/``input_image``/``output_text`` parts,
``function_call`` items (the assistant's earlier calls) and ``function_call_output`` items (their
results: a string, or ``input_text``/``input_image`` parts, kept in the tool message, as the Messages
API keeps a tool result's); ``instructions`` and the system or developer items right after them
become one system message (templates such as Qwen3.5's refuse a second one, and Codex sends
its permissions as a developer item), function tools the chat tools, ``text.format`` the
``response_format``, and ``reasoning.effort: "none"`` the template's ``enable_thinking: false``.
Earlier ``reasoning`` items are not sent back to the model; ``include``, ``prompt_cache_key`` and
``text.verbosity`` need nothing here (the prefix cache finds a conversation by its tokens). Nothing is
stored server-side: a request carries its whole conversation (``store: true`` and
``previous_response_id`` are refused).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlmserve.api.errors import bad_request
from vlmserve.api.messages import chat_request, extensions
from vlmserve.api.schemas import ChatCompletionRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's sampling extensions among them (messages.extensions)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.store:
        raise bad_request("store: this server stores no responses; leave store false and send the whole "
                          "conversation as input", "store", "unsupported_value")
    if req.previous_response_id:
        raise bad_request("previous_response_id: this server stores no responses; send the whole conversation "
                          "as input", "previous_response_id", "unsupported_value")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input.{i}")
    body: dict[str, Any] = {"model": req.model, "messages": _one_system_message(messages), "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "chat_template_kwargs": _template_kwargs(req.reasoning, req.chat_template_kwargs)}
    body.update(extensions(req.model_extra, body))
    if req.tools:
        body["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text and req.text.get("format"):
        body["response_format"] = _format(req.text["format"])
    return chat_request(body)


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"{where}: an input item must be an object", where, "invalid_value")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"{where}.role: {role!r} is not user, system, developer or assistant", f"{where}.role")
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)  # parallel calls of one turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        _add_output(messages, item, f"{where}.output")
    elif kind != "reasoning":  # earlier reasoning is not sent back to the model
        raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                          "function_call_output)", where, "unsupported_value")


def _add_output(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A call's result as a tool message: its text, or with images its text and image parts in order."""
    output = item.get("output") or ""
    if not isinstance(output, (str, list)):
        raise bad_request(f"{where}: a function_call_output's output is a string or a list of input_text and "
                          "input_image parts", where, "invalid_value")
    parts = [{"type": "text", "text": output}] if isinstance(output, str) else _content(output, where)
    images = any(p["type"] != "text" for p in parts)
    content = parts if images else "".join(p["text"] for p in parts)
    messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})


def _one_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instructions and the system or developer items that open the input, as one system message."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    contents = [m["content"] for m in messages[:lead]]
    if lead < 2 or any(p.get("type") != "text" for c in contents if not isinstance(c, str) for p in c):
        return messages  # one message, or an image in one: the chat request says what is wrong with it
    texts = [c if isinstance(c, str) else "".join(p["text"] for p in c) for c in contents]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *messages[lead:]]


def _template_kwargs(reasoning: dict[str, Any] | None, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """``reasoning.effort: "none"`` as the templates that reason take it; any other effort: the model's default."""
    if (reasoning or {}).get("effort") != "none":
        return given
    return {"enable_thinking": False, **(given or {})}


def _content(content: Any, where: str) -> Any:
    if isinstance(content, str) or content is None:
        return content or ""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(f"{where}.{j}: input_image needs an image_url (file_id is not supported)",
                                  f"{where}.{j}", "unsupported_value")
            detail = {"detail": part["detail"]} if part.get("detail") is not None else {}
            parts.append({"type": "image_url", "image_url": {"url": url, **detail}})
        elif kind == "input_audio":  # the chat part's shape: {data, format}, checked there
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
        else:
            raise bad_request(f"{where}.{j}: content part type {kind!r} is not supported (input_text, input_image, "
                              "input_audio, output_text)", f"{where}.{j}", "unsupported_value")
    return parts


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(f"{where}: tools of type {tool.get('type')!r} are not supported (function)", where,
                          "unsupported_value")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"tool_choice: {choice!r} is not supported", "tool_choice", "unsupported_value")


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(f"text.format: type {kind!r} is not supported (text, json_object, json_schema)",
                      "text.format", "unsupported_value")
