"""Coding agents' sessions, replayed through their own SDKs (issue 57): Claude Code's request shape through
the ``anthropic`` SDK and Codex's through the ``openai`` SDK's Responses client, each with a long system
prompt, a dozen tools and a history that grows by one tool call and its result a turn, streamed as those
agents stream. Every later request must find at least 95% of the previous request's whole prompt cached:
with a screenshot in the first tool result and ``--mm-prefix-cache``, on an image family (thinking off)
and on a reasoning family (thinking on, earlier thinking sent back); text only with the default flags."""

from __future__ import annotations

import base64
import io
import json
import secrets
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image, ImageDraw

from vlmserve.api.errors import APIError
from vlmserve.api.responses_input import ResponsesRequest, to_chat_request
from vlmserve.testing import build_model

REUSED = 0.95  # the Done-when: of the previous request's whole prompt
GREEDY = {"temperature": 0}  # the anthropic SDK's create() has no sampling parameters since 2.x
TURNS = 6
SESSION = uuid.uuid4()

# A system prompt shaped like Claude Code's and Codex's, shorter: ~1.2K tokens on these models' tokenizer
GUIDES = {
    "Tone and style": "Be concise, direct and to the point. Answer in fewer than four lines unless asked for "
                      "detail. Do not add a preamble or a summary of what you did unless the user asks for it.",
    "Proactiveness": "Do what was asked, nothing more. When you are asked how to approach something, answer "
                     "the question first, before you take any action on the files in the workspace.",
    "Following conventions": "Mimic the code style of the files around you, use the libraries already in use "
                             "and never assume a library is available: check the package manifest first.",
    "Code style": "Do not add comments unless asked. Keep functions small and their names precise.",
    "Task management": "Use the TodoWrite tool to plan a task of several steps and mark each one done as "
                       "soon as it is, not in a batch at the end of the work.",
    "Doing tasks": "Search the code to understand it, implement the change, verify it with the project's "
                   "tests, then run the lint and type-check commands the repository documents.",
    "Tool usage policy": "Prefer the dedicated tools over shell commands for reading and searching files. "
                         "Call several independent tools in one reply when you can.",
    "Screenshots": "When the task is about a user interface, take a screenshot after each change and look at "
                   "it before you say that the change works.",
}
SYSTEM = "\n\n".join(f"# {title}\n{text}\n- {text.split('. ')[0]}.\n- Check it again before you reply."
                     for title, text in GUIDES.items())
TASK = "The settings page shows the wrong title. Find where it is set, fix it and check the page."
STRING = {"type": "string"}


def _screenshot() -> str:
    """A small window (a title bar, two form rows) as base64 PNG."""
    image = Image.new("RGB", (96, 64), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 95, 10), fill=(40, 60, 120))
    for y in (20, 36):
        draw.rectangle((8, y, 87, y + 9), outline=(120, 120, 120), fill=(255, 255, 255))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


SCREENSHOT = _screenshot()


def _start(tmp_path_factory, arch: str, *flags: str):
    from server_utils import start_server

    server = start_server(["--model", str(build_model(arch, "micro")), *flags],
                          tmp_path_factory.mktemp("logs") / f"agents-{arch}.log")
    server.model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return server


@pytest.fixture(scope="module")
def image_family(tmp_path_factory):
    """An image family with the image-keyed prefix cache on, as agents that send screenshots want it."""
    server = _start(tmp_path_factory, "qwen2_5_vl", "--mm-prefix-cache")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reasoning_family(tmp_path_factory):
    """A reasoning family with the default flags."""
    server = _start(tmp_path_factory, "qwen3_5")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reasoning_family_images(tmp_path_factory):
    server = _start(tmp_path_factory, "qwen3_5", "--mm-prefix-cache")
    yield server
    server.stop()


# (server fixture, thinking on, screenshots): each shape's sessions
SESSIONS = [pytest.param("image_family", False, True, id="image-family-screenshot"),
            pytest.param("reasoning_family_images", True, True, id="reasoning-family-screenshot"),
            pytest.param("reasoning_family", True, False, id="reasoning-family-text-default-flags")]


def _check_reuse(prompts: list[tuple[int, int]]) -> None:
    """(whole prompt, cached) per request: each later one finds the previous whole prompt cached."""
    for k, ((previous, _), (_, cached)) in enumerate(zip(prompts, prompts[1:]), start=2):
        assert cached >= REUSED * previous, (k, prompts)


def _steps(steps: list[tuple[str, dict[str, Any], str]], shot: int) -> list[tuple[str, dict[str, Any], str]]:
    """The replayed steps with the screenshot's (the first) moved to the ``shot``-th tool result."""
    return [*steps[1:shot + 1], steps[0], *steps[shot + 1:]]


# Claude Code: the Messages API through the anthropic SDK

IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."


def _tool(name: str, description: str, required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict:
    return {"name": name, "description": description, "input_schema": {
        "type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
        "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}


TOOLS = [
    _tool("Task", "Launch a new agent to handle a complex, multi-step task autonomously.",
          {"description": STRING, "prompt": STRING, "subagent_type": STRING}),
    _tool("Bash", "Executes a given bash command in a persistent shell session with an optional timeout.",
          {"command": STRING}, {"timeout": {"type": "number"}, "description": STRING}),
    _tool("Glob", "Fast file pattern matching tool that works with any codebase size.", {"pattern": STRING},
          {"path": STRING}),
    _tool("Grep", "A powerful search tool built on ripgrep.", {"pattern": STRING}, {
        "path": STRING, "glob": STRING,
        "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]}}),
    _tool("Read", "Reads a file from the local filesystem.", {"file_path": STRING},
          {"offset": {"type": "number"}, "limit": {"type": "number"}}),
    _tool("Edit", "Performs exact string replacements in files.",
          {"file_path": STRING, "old_string": STRING, "new_string": STRING},
          {"replace_all": {"type": "boolean", "default": False}}),
    _tool("Write", "Writes a file to the local filesystem.", {"file_path": STRING, "content": STRING}),
    _tool("WebFetch", "Fetches content from a specified URL and processes it using an AI model.",
          {"url": {"type": "string", "format": "uri"}, "prompt": STRING}),
    _tool("TodoWrite", "Use this tool to create and manage a structured task list for your current session.",
          {"todos": {"type": "array", "items": {"type": "object", "properties": {
              "content": STRING, "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}},
              "required": ["content", "status"]}}}),
    _tool("mcp__browser__screenshot", "Take a screenshot of the current page.",
          {"format": {"type": "string", "enum": ["png", "jpeg"]}, "fullPage": {"type": "boolean"}}),
]
# Each turn's replayed call and the tool's result; the first is the screenshot's
STEPS: list[tuple[str, dict[str, Any], str]] = [
    ("mcp__browser__screenshot", {"format": "png", "fullPage": False}, "Screenshot taken (800x600)."),
    ("Grep", {"pattern": "Settigns", "path": "src"}, "src/pages/settings.tsx:12:  <h1>Settigns</h1>"),
    ("Read", {"file_path": "src/pages/settings.tsx"},
     "     1\timport { Page } from '../layout';\n    12\t  <h1>Settigns</h1>\n    13\t  <Form />"),
    ("Edit", {"file_path": "src/pages/settings.tsx", "old_string": "Settigns", "new_string": "Settings"},
     "The file src/pages/settings.tsx has been updated."),
    ("Bash", {"command": "npm test -- settings", "description": "Run the settings tests"},
     "PASS src/pages/settings.test.tsx\nTests: 4 passed, 4 total"),
]


def _header() -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"


def _said(i: int, name: str, arguments: dict[str, Any], thinking: bool) -> list[dict[str, Any]]:
    """An assistant turn as Claude Code sends it back: thinking blocks (signed, or redacted) with thinking on."""
    said = [{"type": "text", "text": f"Next: {name}."},
            {"type": "tool_use", "id": f"toolu_01{i:022d}", "name": name, "input": arguments}]
    signed = base64.b64encode(secrets.token_bytes(96)).decode()
    blocks = [{"type": "thinking", "thinking": f"I should call {name} now.", "signature": signed},
              {"type": "redacted_thinking", "data": signed}]
    return [*blocks[:1 + (i == 1)], *said] if thinking else said


def _claude_history(thinking: bool, screenshots: bool, shot: int = 0) -> Iterator[list[dict[str, Any]]]:
    """Each request's messages: the task, then one replayed tool_use and its tool_result more per turn."""
    reminder = "<system-reminder>\nAs you answer, you can use the context in CLAUDE.md.\n</system-reminder>"
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": reminder}, {"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}}]}]
    yield messages
    for i, (name, arguments, result) in enumerate(_steps(STEPS, shot)[:TURNS - 1]):
        content: Any = result
        if screenshots and name == "mcp__browser__screenshot":
            content = [{"type": "text", "text": result},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": SCREENSHOT}}]
        result_block = {"type": "tool_result", "tool_use_id": f"toolu_01{i:022d}", "content": content}
        messages = [*messages, {"role": "assistant", "content": _said(i, name, arguments, thinking)},
                    {"role": "user", "content": [result_block]}]
        yield messages


def _claude_session(server, thinking: bool, screenshots: bool, shot: int = 0) -> list[tuple[int, int]]:
    """Each request's (whole prompt, cached); on the third, a forced call on the same history besides, not a
    turn of the session (a forced call's prompt keeps only the named tool and says so in its system message,
    so it parts from the session's there)."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    think = {"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"}
    prompts = []
    for k, messages in enumerate(_claude_history(thinking, screenshots, shot)):
        system = [{"type": "text", "text": _header()},
                  {"type": "text", "text": IDENTITY, "cache_control": {"type": "ephemeral"}},
                  {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        kwargs = dict(model=server.model, max_tokens=8, system=system, tools=TOOLS, messages=messages,
                      thinking=think, metadata={"user_id": f"user_{'0' * 64}_account__session_{SESSION}"},
                      extra_body=GREEDY)
        with claude.messages.stream(**kwargs) as stream:
            m = stream.get_final_message()
        u = m.usage
        prompts.append((u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens,
                        u.cache_read_input_tokens))
        if k == 2 and not thinking:  # Anthropic refuses a forced tool_choice with thinking on
            _forced_tool_use(claude, **{**kwargs, "max_tokens": 60, "tool_choice": {
                "type": "tool", "name": "mcp__browser__screenshot"}})
    counted = claude.messages.count_tokens(**{k: v for k, v in kwargs.items() if k in ("model", "system", "tools",
                                                                                       "messages", "thinking")})
    assert counted.input_tokens == prompts[-1][0]  # Claude Code's count is the prompt the request paid for
    return prompts


def _forced_tool_use(claude: anthropic.Anthropic, **kwargs: Any) -> None:
    """A forced call's input arrives as input_json_delta events whose JSON is the final message's input."""
    partial: dict[int, str] = {}
    with claude.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        m = stream.get_final_message()
    uses = {i: b for i, b in enumerate(m.content) if b.type == "tool_use"}
    assert m.stop_reason == "tool_use" and len(uses) == 1 and set(partial) == set(uses), m.content
    (i, use), = uses.items()
    assert use.name == "mcp__browser__screenshot" and json.loads(partial[i]) == use.input
    assert set(use.input) == {"format", "fullPage"} and use.input["format"] in ("png", "jpeg")


@pytest.mark.parametrize(("server", "thinking", "screenshots"), SESSIONS)
def test_a_claude_code_session_keeps_its_cache(request, server, thinking, screenshots):
    _check_reuse(_claude_session(request.getfixturevalue(server), thinking, screenshots))


# Codex: the Responses API through the openai SDK

CODEX_INSTRUCTIONS = ("You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a "
                      "user's computer.\n\n" + SYSTEM.replace("TodoWrite", "update_plan"))
PERMISSIONS = "<permissions instructions>\nFilesystem sandboxing: workspace-write.\n</permissions instructions>"
CONTEXT = "<environment_context>\n  <cwd>/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": description, "strict": False, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}


CODEX_TOOLS = [
    _function("shell_command", "Runs a shell command and returns its output.",
              {"command": STRING, "workdir": STRING, "timeout_ms": {"type": "number"}}, ["command"]),
    _function("update_plan", "Updates the task plan.", {"explanation": STRING, "plan": {"type": "array", "items": {
        "type": "object", "properties": {"step": STRING, "status": STRING}, "required": ["step", "status"]}}},
              ["plan"]),
    _function("apply_patch", "Use the `apply_patch` tool to edit files.", {"input": STRING}, ["input"]),
    _function("view_image", "Attach a local image (by filesystem path) to the conversation context for this turn.",
              {"path": STRING}, ["path"]),
    _function("list_mcp_resources", "Lists resources provided by MCP servers.", {"server": STRING, "cursor": STRING},
              []),
    _function("browser__screenshot", "Take a screenshot of the current page (an MCP server's tool).",
              {"format": {"type": "string", "enum": ["png", "jpeg"]}, "full_page": {"type": "boolean"}},
              ["format", "full_page"]),
    _function("read_mcp_resource", "Read a specific resource from an MCP server.", {"server": STRING, "uri": STRING},
              ["server", "uri"]),
]
CODEX_STEPS: list[tuple[str, dict[str, Any], str]] = [
    ("view_image", {"path": "/repo/screenshots/settings.png"}, "Viewed an image (800x600)."),
    ("shell_command", {"command": "rg -n Settigns src", "workdir": "/repo"},
     "src/pages/settings.tsx:12:  <h1>Settigns</h1>"),
    ("apply_patch", {"input": "*** Begin Patch\n*** Update File: src/pages/settings.tsx\n-  <h1>Settigns</h1>\n"
                              "+  <h1>Settings</h1>\n*** End Patch"},
     "Success. Updated the following files:\nM src/pages/settings.tsx"),
    ("shell_command", {"command": "npm test -- settings", "workdir": "/repo"}, "Tests: 4 passed, 4 total"),
    ("update_plan", {"plan": [{"step": "Fix the title", "status": "completed"}]}, "Plan updated"),
]


def _message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def _codex_history(screenshots: bool, shot: int = 0) -> Iterator[list[dict[str, Any]]]:
    """Each request's input items as Codex sends them: its developer and context messages, the task, then
    per turn a reasoning item (a summary and encrypted content), a function_call and its output (the
    screenshot's: ``input_image`` parts, the current API's shape)."""
    items = [_message("developer", PERMISSIONS), _message("user", CONTEXT), _message("user", TASK)]
    yield items
    for i, (name, arguments, result) in enumerate(_steps(CODEX_STEPS, shot)[:TURNS - 1]):
        output: Any = result
        if screenshots and name == "view_image":
            output = [{"type": "input_image", "image_url": f"data:image/png;base64,{SCREENSHOT}"}]
        reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"**Calling {name}**"}],
                     "encrypted_content": "gAAAAA" + base64.b64encode(secrets.token_bytes(120)).decode()}
        items = [*items, reasoning,
                 {"type": "function_call", "name": name, "arguments": json.dumps(arguments), "call_id": f"call_{i}"},
                 {"type": "function_call_output", "call_id": f"call_{i}", "output": output}]
        yield items


def _codex_request(server, items: list[dict[str, Any]], thinking: bool = False, **changes: Any) -> dict[str, Any]:
    """Every field Codex sends; ``text.verbosity``, ``include`` and ``prompt_cache_key`` need nothing here."""
    effort = "medium" if thinking else "none"  # "none": the template's enable_thinking false
    return dict(model=server.model, instructions=CODEX_INSTRUCTIONS, input=items, tools=CODEX_TOOLS,
                tool_choice="auto", parallel_tool_calls=False, reasoning={"effort": effort, "summary": "auto"},
                store=False, include=["reasoning.encrypted_content"], prompt_cache_key=str(SESSION),
                max_output_tokens=8, temperature=0, text={"verbosity": "low"}, **changes)


def _codex_session(server, thinking: bool, screenshots: bool, shot: int = 0) -> list[tuple[int, int]]:
    """Each request's (prompt, cached); on the third, a forced call on the same history besides."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = []
    for k, items in enumerate(_codex_history(screenshots, shot)):
        r = _streamed(client, _codex_request(server, items, thinking))
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        prompts.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
        if k == 2:
            _forced_call(client, _codex_request(server, items, thinking) | {"max_output_tokens": 60, "tool_choice": {
                "type": "function", "name": "browser__screenshot"}})
    return prompts


def _streamed(client: openai.OpenAI, kwargs: dict[str, Any], events: list[Any] | None = None) -> Any:
    """A streamed response as its last event has it (the SDK's stream helper wants response.completed, and a
    response cut at max_output_tokens ends with response.incomplete)."""
    events = [] if events is None else events
    events += client.responses.create(stream=True, **kwargs)
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    return events[-1].response


def _forced_call(client: openai.OpenAI, kwargs: dict[str, Any]) -> None:
    """A forced call's arguments arrive as function_call_arguments.delta events whose JSON is the final call's."""
    events: list[Any] = []
    r = _streamed(client, kwargs, events)
    deltas: dict[str, str] = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and {c.id for c in calls} == set(deltas), r.output
    arguments = json.loads(deltas[calls[0].id])
    assert arguments == json.loads(calls[0].arguments) and calls[0].name == "browser__screenshot"
    assert arguments["format"] in ("png", "jpeg") and isinstance(arguments["full_page"], bool)


@pytest.mark.parametrize(("server", "thinking", "screenshots"), SESSIONS)
def test_a_codex_session_keeps_its_cache(request, server, thinking, screenshots):
    _check_reuse(_codex_session(request.getfixturevalue(server), thinking, screenshots))


def test_a_function_call_output_image_reaches_the_model(image_family):
    """An image in a function_call_output is the prompt of the same image sent in a user message after
    the result (Codex's older view_image shape): the same tokens, the image's among them, found cached."""
    client = openai.OpenAI(base_url=image_family.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    *_, items = _codex_history(screenshots=True)
    calls = items[:6]  # the context, then the first call and its output (the screenshot)
    shot = calls[-1]["output"][0]
    inside = [*calls[:-1], {**calls[-1], "output": [{"type": "input_text", "text": "Viewed:"}, shot]}]
    after = [*calls[:-1], {**calls[-1], "output": "Viewed:"}, {"type": "message", "role": "user", "content": [shot]}]
    without = after[:-1]
    r_inside, r_after, r_without = (_streamed(client, _codex_request(image_family, items))
                                    for items in (inside, after, without))
    assert r_inside.usage.input_tokens == r_after.usage.input_tokens > r_without.usage.input_tokens + 8
    assert r_after.usage.input_tokens_details.cached_tokens >= r_inside.usage.input_tokens - 2  # the image too


@pytest.mark.parametrize("server", ["image_family", "reasoning_family_images"])
def test_a_chat_tool_message_with_an_image_is_the_function_call_outputs_prompt(request, server):
    """A chat ``tool`` message whose content holds image parts (some clients send them) takes the
    function_call_output's path: the same prompt, found cached, the image's tokens among it."""
    server = request.getfixturevalue(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    url = f"data:image/png;base64,{SCREENSHOT}"
    items = [_message("user", TASK), {"type": "function_call", "name": "view_image", "arguments": "{}", "call_id": "c1"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Viewed:"},
                                                                           {"type": "input_image", "image_url": url}]}]
    r = _streamed(client, dict(model=server.model, input=items, max_output_tokens=1, temperature=0))
    call = {"id": "c1", "type": "function", "function": {"name": "view_image", "arguments": "{}"}}
    chat = [{"role": "user", "content": TASK}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Viewed:"},
                                                                {"type": "image_url", "image_url": {"url": url}}]}]
    c = client.chat.completions.create(model=server.model, messages=chat, max_tokens=1, temperature=0)
    text_only = [*chat[:2], {**chat[2], "content": "Viewed:"}]
    t = client.chat.completions.create(model=server.model, messages=text_only, max_tokens=1, temperature=0)
    assert c.usage.prompt_tokens == r.usage.input_tokens > t.usage.prompt_tokens + 8
    assert c.usage.prompt_tokens_details.cached_tokens >= c.usage.prompt_tokens - 2


# Qwen3.5's template keeps the think blocks of the replies since the last user turn: a screenshot after the
# first tool result stays in its result (the template writes it there), not in a new user turn that would
# re-render every earlier reply without them (that turn reused only the system prompt and the task)

def test_a_claude_code_session_with_a_later_screenshot_on_qwen3_5(reasoning_family_images):
    _check_reuse(_claude_session(reasoning_family_images, thinking=True, screenshots=True, shot=2))


def test_a_codex_session_with_a_later_screenshot_on_qwen3_5(reasoning_family_images):
    _check_reuse(_codex_session(reasoning_family_images, thinking=True, screenshots=True, shot=2))


# Codex's items as the chat request the engine serves

def _chat(**body: Any) -> list[dict[str, Any]]:
    req = to_chat_request(ResponsesRequest.model_validate({"model": "m", **body}))
    return [m.model_dump(exclude_none=True) for m in req.messages]


def test_instructions_and_the_developer_items_after_them_are_one_system_message():
    task = _message("user", TASK)
    assert _chat(instructions="Be brief.", input=[_message("developer", PERMISSIONS), task])[:1] == [
        {"role": "system", "content": f"Be brief.\n\n{PERMISSIONS}"}]
    assert [m["role"] for m in _chat(input=[_message("developer", "A"), _message("system", "B"), task])] == \
        ["system", "user"]
    later = _chat(instructions="Be brief.", input=[task, _message("developer", PERMISSIONS)])
    assert [m["role"] for m in later] == ["system", "user", "developer"]  # only the ones that open the input


def test_the_images_of_parallel_calls_stay_in_their_results():
    """The prompt builder moves them to a user turn after the results for the templates that want it."""
    image = {"type": "input_image", "image_url": f"data:image/png;base64,{SCREENSHOT}"}
    calls = [{"type": "function_call", "name": "view_image", "arguments": "{}", "call_id": c} for c in "abc"]
    outputs = [{"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "A"}, image]},
               {"type": "function_call_output", "call_id": "b", "output": [image]},
               {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "C"}]}]
    messages = _chat(input=[_message("user", TASK), *calls, *outputs])
    assert [(m["role"], m.get("tool_call_id")) for m in messages] == [
        ("user", None), ("assistant", None), ("tool", "a"), ("tool", "b"), ("tool", "c")]
    assert [[p["type"] for p in m["content"]] for m in messages[2:4]] == [["text", "image_url"], ["image_url"]]
    assert messages[4]["content"] == "C"


@pytest.mark.parametrize(("output", "says"), [
    ({"content": "x", "success": False}, "a string or a list"),
    ([{"type": "input_file", "file_id": "f"}], "'input_file'"),
])
def test_an_output_this_server_cannot_read_is_a_400(output, says):
    with pytest.raises(APIError) as error:
        _chat(input=[{"type": "function_call_output", "call_id": "a", "output": output}])
    assert says in error.value.message and error.value.status == 400


@pytest.mark.parametrize(("reasoning", "kwargs"), [
    ({"effort": "none"}, {"enable_thinking": False}),
    ({"effort": "medium", "summary": "auto"}, None),  # the model's own default
    (None, None),
])
def test_reasoning_effort_none_turns_thinking_off(reasoning, kwargs):
    req = to_chat_request(ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": reasoning}))
    assert req.chat_template_kwargs == kwargs
