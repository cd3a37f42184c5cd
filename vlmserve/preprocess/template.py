"""[pool] What a model's published chat template does with our messages, found once by rendering probes.

Published templates differ in ways that silently lose input: SmolVLM's and LLaVA's iterate
``message['content']`` as a list, so a plain-string message renders without its text; many
templates (Gemma 3, LLaVA, PaliGemma, Qwen2-VL) ignore ``tools`` entirely, and write an earlier call without
its name and arguments (Qwen2-VL, LFM2-VL, InternVL) or its result without its text (SmolVLM, LLaVA); only some
(Qwen3-VL, Qwen3.5, GLM-4.xV) write an image inside a tool's result; some refuse a turn order (Gemma 3, Pixtral
and LLaVA-NeXT a tool message, Gemma 3 and Pixtral two user turns in a row, Mistral 3.2 a user turn after
tool results); with tools, Llama 4's writes the first user turn as a string (parts as Python data, no image);
Kimi's writes a call's id where the model reads its name.
Probing once at load turns those into facts the prompt builder acts on, for any template.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vlmserve.preprocess.call_ids import named_call_ids, renumbered_calls
from vlmserve.preprocess.hermes import hermes_history, text_of, tools_preamble

PROBE = "vlmserve-probe-7a1c"
PROBE_ARGUMENT = "vlmserve-argument-3f9b"  # a probe call's argument: its rendering must keep the call's words
TEXT = {"type": "text", "text": PROBE}  # on both sides of a probe image: where its placeholder ends is plain
PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "vlmserve_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}}}

@dataclass(slots=True, frozen=True)
class TemplateInfo:
    """Facts about one chat template; the defaults describe a template that needs no help."""

    parts_roles: frozenset[str] = frozenset()  # roles whose plain-string content must become text parts
    renders_tools: bool = True  # False: tools are written into a system message, Hermes style
    system_role: bool = True  # False: system text goes at the start of the first user message
    text_in_content: bool = False  # text parts read as part["content"] (Pixtral's template), not part["text"]
    nine_char_call_ids: bool = False  # Mistral's templates refuse any other tool-call id: ours are renumbered
    opens_reasoning: bool = False  # the generation prompt ends inside <think> (Qwen3.5): replies start reasoning
    tool_images: bool = False  # a tool result's images stay in its tool message; else they follow it as a user turn
    # False: a call and its result are refused or lose their words: both are written as plain turns even without tools
    renders_calls: bool = True
    user_runs: bool = True  # False: two user turns in a row are refused (Gemma 3, Pixtral): they are joined into one
    user_after_results: bool = True  # False (Mistral 3.2): a user turn after tool results joins the last result
    tool_image_text: str = ""  # where no user turn may follow results (Mistral 3.2): an image is this text in the result
    # With tools, the first turn is written as the string of its content (Llama 4's ``messages[0]['content']|trim``
    # writes a list as Python data): we write its parts as one string, an image as ``image_text``
    tools_first_text: bool = False
    image_text: str = ""  # what an image part writes in a user turn, where we write one ourselves
    ids_as_names: bool = False  # a call's id is written where its name belongs (Kimi's): ids become functions.NAME:IDX


def inspect_template(templater: Any) -> TemplateInfo:
    """Render probe conversations through the template (``templater.apply_chat_template``)."""
    conversations: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
        "system": lambda c: [{"role": "system", "content": c}, {"role": "user", "content": "hi"}],
        "user": lambda c: [{"role": "user", "content": c}],
        "assistant": lambda c: [{"role": "user", "content": "hi"}, {"role": "assistant", "content": c},
                                {"role": "user", "content": "ok"}],
    }
    parts_roles, seen = set(), set()
    for role, make in conversations.items():
        as_string = _render(templater, make(PROBE)) or ""
        as_parts = "" if PROBE in as_string else _render(templater, make([{"type": "text", "text": PROBE}])) or ""
        if PROBE in as_parts:
            parts_roles.add(role)
        if PROBE in as_string + as_parts:
            seen.add(role)
    with_tools = _render(templater, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [PROBE_TOOL])
    renders_tools = PROBE_TOOL["function"]["name"] in (with_tools or "")
    by_text = _render(templater, [{"role": "user", "content": [{"type": "text", "text": PROBE}]}]) or ""
    by_content = _render(templater, [{"role": "user", "content": [{"type": "text", "content": PROBE}]}]) or ""
    text_in_content = PROBE not in by_text and PROBE in by_content
    nine_chars = _render(templater, _call_chat("call_probe_7a1c")) is None and _render(templater, _call_chat("a1b2c3d4e"))
    opens = (_render(templater, [{"role": "user", "content": "hi"}]) or "").rstrip().endswith("<think>")
    # A template with no tool syntax, or one losing calls, gets results as user turns we write (hermes_history):
    # images follow them
    tool_images = renders_tools and _writes_tool_images(templater)
    info = TemplateInfo(frozenset(parts_roles), renders_tools, "system" in seen, text_in_content, bool(nine_chars),
                        opens, tool_images)
    return _call_shapes(templater, _turn_order(templater, info))


def _turn_order(templater: Any, info: TemplateInfo) -> TemplateInfo:
    """Which turn orders the template refuses, probed as ``adapt_messages`` sends turns (SmolVLM's need parts)."""
    called = _call_chat("a1b2c3d4e")
    calls = _renders_calls(templater, info)
    user_runs = _renders(templater, info, [{"role": "user", "content": "hi"}, {"role": "user", "content": "ok"}])
    results_last = calls and not _renders(templater, info, [*called, {"role": "user", "content": "ok"}])
    inline = _tool_image_text(templater) if results_last and not info.tool_images else ""
    return replace(info, tool_images=info.tool_images and calls, renders_calls=calls, user_runs=user_runs,
                   user_after_results=not results_last, tool_image_text=inline)


def _call_shapes(templater: Any, info: TemplateInfo) -> TemplateInfo:
    """Where the template writes a request's content in a form of its own: the first turn with tools
    (Llama 4's: as a string), a call as its id alone (Kimi's)."""
    first = [{"role": "user", "content": [TEXT]}]
    as_data = str(first[0]["content"]) in (_render(templater, first, [PROBE_TOOL]) or "")
    called = _render(templater, _call_chat("a1b2c3d4e")) or ""
    by_id = "a1b2c3d4e" in called and PROBE_TOOL["function"]["name"] not in called
    return replace(info, tools_first_text=as_data, image_text=_image_placeholder(templater) if as_data else "",
                   ids_as_names=by_id)


def _renders_calls(templater: Any, info: TemplateInfo) -> bool:
    """Whether a call's arguments and its result's text reach the prompt (Qwen2-VL's drops the call, SmolVLM's
    and LLaVA's both, Gemma 3's refuses the tool message): else both are ours to write."""
    called = _call_chat("a1b2c3d4e", PROBE, {"q": PROBE_ARGUMENT})
    text = _render(templater, [_with_parts(m, info) for m in called]) or ""
    return PROBE in text and PROBE_ARGUMENT in text


def _renders(templater: Any, info: TemplateInfo, messages: list[dict[str, Any]]) -> bool:
    return _render(templater, [_with_parts(m, info) for m in messages]) is not None


def _writes_tool_images(templater: Any) -> bool:
    """Whether an image part in a tool message renders as the placeholder an image in a user message
    does (Qwen3.5's ``<|vision_start|><|image_pad|><|vision_end|>``), not dropped (Gemma 4) or quoted as
    data (Mistral, Llama 4, Kimi)."""
    placeholder = _image_placeholder(templater)
    in_tool = _inserted(_render(templater, _call_chat("a1b2c3d4e", [TEXT, TEXT])),
                        _render(templater, _call_chat("a1b2c3d4e", [TEXT, {"type": "image"}, TEXT])))
    return bool(placeholder) and in_tool == placeholder


def _image_placeholder(templater: Any) -> str:
    """What an image part adds to a user message (empty where the template fails or writes nothing)."""
    return _inserted(_render(templater, [{"role": "user", "content": [TEXT, TEXT]}]),
                     _render(templater, [{"role": "user", "content": [TEXT, {"type": "image"}, TEXT]}]))


def _tool_image_text(templater: Any) -> str:
    """The image placeholder, for a template that refuses a user turn after tool results but writes a result's
    text as given (Mistral 3.2's): written there, the processor expands it as in a user turn. Mistral's own
    format puts a tool result's images inside it (mistral-common >= 1.11.4, its v15 templates)."""
    placeholder = _image_placeholder(templater)
    in_tool = _render(templater, _call_chat("a1b2c3d4e", PROBE + placeholder + PROBE)) or ""
    return placeholder if placeholder and PROBE + placeholder + PROBE in in_tool else ""


def _inserted(before: str | None, after: str | None) -> str:
    """What ``after`` adds to ``before`` in one place (empty where either failed to render)."""
    if before is None or after is None:
        return ""
    head = len(os.path.commonprefix([before, after]))
    tail = len(os.path.commonprefix([before[head:][::-1], after[head:][::-1]]))
    return after[head:len(after) - tail]


def _call_chat(call_id: str, result: str | list[dict[str, Any]] = "ok",
               arguments: dict[str, str] | None = None) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": "vlmserve_probe_tool", "arguments": arguments or {}}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def _render(templater: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str | None:
    try:
        text: str = templater.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return text
    except Exception:  # noqa: BLE001 - a template may refuse a probe (e.g. no system role): no fact
        return None


def adapt_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, info: TemplateInfo,
                   instructions: str = "") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as this template needs them to lose nothing; ``instructions`` join the
    system message, wherever this template keeps it."""
    out = _tool_images_placed(messages, info)
    out = renumbered_calls(out) if info.nine_char_call_ids else out
    out = named_call_ids(out) if info.ids_as_names else out
    if not info.renders_calls or (tools and not info.renders_tools):
        out = hermes_history(out)
    out = out if info.user_after_results else _user_words_in_results(out, info.tool_image_text)
    if tools and not info.renders_tools:
        instructions = f"{tools_preamble(tools)}\n\n{instructions}".strip()
        tools = None
    out = out if info.user_runs else _user_runs_joined(out)
    if instructions:
        out = _with_system_text(out, instructions, info)
    out = [_with_parts(m, info) for m in out]
    out = _first_turn_written(out, info.image_text) if tools and info.tools_first_text else out
    return out, list(tools) if tools else None


def _with_parts(message: dict[str, Any], info: TemplateInfo) -> dict[str, Any]:
    content = message.get("content")
    if message["role"] in info.parts_roles and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if info.text_in_content and isinstance(content, list):
        content = [{**p, "content": p["text"]} if p.get("type") == "text" else p for p in content]
    return message if content is message.get("content") else {**message, "content": content}


def _tool_images_placed(messages: Sequence[dict[str, Any]], info: TemplateInfo) -> list[dict[str, Any]]:
    if info.tool_images:
        return list(messages)
    if info.tool_image_text:
        return [_with_images_written(m, info.tool_image_text) if m["role"] == "tool" else m for m in messages]
    return _tool_images_after(messages)


def _with_images_written(message: dict[str, Any], placeholder: str) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "".join(placeholder if p.get("type") == "image" else p.get("text", "") for p in content)
    return {**message, "content": text}


def _tool_images_after(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool messages with only their text, their images in a user turn right after the run:
    at the start of the user message that follows, or a new one."""
    out: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    for m in messages:
        if held and m["role"] == "user":
            out.append(_with_images_first(m, held))
            held = []
            continue
        if held and m["role"] != "tool":
            out.append({"role": "user", "content": held})
            held = []
        if m["role"] == "tool" and isinstance(m.get("content"), list):
            held += [p for p in m["content"] if p.get("type") != "text"]
            m = {**m, "content": text_of(m["content"])}
        out.append(m)
    return [*out, {"role": "user", "content": held}] if held else out


def _with_images_first(message: dict[str, Any], images: list[dict[str, Any]]) -> dict[str, Any]:
    return {**message, "content": [*images, *_parts(message.get("content"))]}


def _user_words_in_results(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """A user turn right after tool results, for a template that takes none there (Mistral 3.2): its words join
    the last result after a blank line, its images written as ``placeholder`` (none known: the turn stays)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and out[-1]["role"] == "tool" and m["role"] == "user" and _writable(m, placeholder):
            words = _with_images_written(m, placeholder)["content"]
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), words)}
            continue
        out.append(m)
    return out


def _writable(message: dict[str, Any], placeholder: str) -> bool:
    """Whether a message's content can be written as text: text parts, and images where a placeholder is known."""
    content, kinds = message.get("content"), {"text", "image"} if placeholder else {"text"}
    return not isinstance(content, list) or all(p.get("type") in kinds for p in content)


def _user_runs_joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of user turns as one: results written as user turns, the images after them, the user's words."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if out and m["role"] == "user" and out[-1]["role"] == "user":
            first = out.pop()
            m = {**first, "content": _joined(first.get("content"), m.get("content"))}
        out.append(m)
    return out


def _joined(first: Any, then: Any) -> str | list[dict[str, Any]]:
    """Two turns' contents as one, a blank line between their texts."""
    if isinstance(first, str) and isinstance(then, str):
        return f"{first}\n\n{then}"
    head, tail = _parts(first), _parts(then)
    if head and tail and head[-1].get("type") == tail[0].get("type") == "text":
        return [*head[:-1], {**head[-1], "text": f"{head[-1]['text']}\n\n{tail[0]['text']}"}, *tail[1:]]
    return [*head, *tail]


def _parts(content: Any) -> list[dict[str, Any]]:
    return list(content) if isinstance(content, list) else [{"type": "text", "text": content}] if content else []


def _first_turn_written(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """The first turn after the system message as one string, for a template that writes it as a string when
    tools are offered (Llama 4's): its text parts joined as the template joins them, an image as ``placeholder``,
    which the processor expands as in any user turn (none known: the turn stays)."""
    i = 1 if messages and messages[0]["role"] == "system" else 0
    if i >= len(messages) or not isinstance(messages[i].get("content"), list) or not _writable(messages[i], placeholder):
        return messages
    return [*messages[:i], _with_images_written(messages[i], placeholder), *messages[i + 1:]]


def _with_system_text(messages: list[dict[str, Any]], text: str, info: TemplateInfo) -> list[dict[str, Any]]:
    """Add ``text`` to the system message, or where a template without one keeps it: the first user turn."""
    if messages and messages[0]["role"] == "system":
        text = f"{text_of(messages[0]['content'])}\n\n{text}".strip()
        messages = messages[1:]
    if info.system_role:
        return [{"role": "system", "content": text}, *messages]
    for i, m in enumerate(messages):
        if m["role"] == "user":
            content = m["content"]
            merged = [{"type": "text", "text": text + "\n\n"}, *content] if isinstance(content, list) else f"{text}\n\n{content}"
            return [*messages[:i], {**m, "content": merged}, *messages[i + 1:]]
    return [{"role": "user", "content": text}, *messages]
