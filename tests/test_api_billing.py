"""Claude Code's billing block (``api/billing.py``): dropped from system messages on every API, so that
a session's later requests find their previous prompt in the prefix cache. A table of the stripping
function's cases, then a real server on a micro model driven by the ``anthropic`` and ``openai`` SDKs
in Claude Code's, OpenCode's and Codex's request shapes."""

from __future__ import annotations

import json
import re
import secrets

import anthropic
import httpx
import openai
import pytest

from vlmserve.api.billing import strip_billing_header, without_billing_header
from vlmserve.api.messages import to_chat_input
from vlmserve.api.schemas import ChatCompletionRequest, Message
from vlmserve.preprocess.media import MediaPolicy
from vlmserve.testing import build_model

HEADER = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch=36ee5;"


@pytest.mark.parametrize(("text", "rest", "dropped"), [
    (HEADER, "", HEADER),  # the block alone
    (HEADER + "\n", "", HEADER),
    (HEADER + "\n\nYou are Claude Code.", "You are Claude Code.", HEADER),  # blocks joined, as Messages' system
    (HEADER + "\nline two\n\nthree", "line two\n\nthree", HEADER),  # one block: only its first line goes
    (HEADER + " cc_workload=x;\nrest", "rest", HEADER + " cc_workload=x;"),  # fields we do not know go with it
    ("You are Claude Code.\n" + HEADER, "You are Claude Code.\n" + HEADER, None),  # not at the start: kept
    (" " + HEADER, " " + HEADER, None),
    ("X-Anthropic-Billing-Header: cch=1;", "X-Anthropic-Billing-Header: cch=1;", None),  # only as Claude Code sends it
    ("x-anthropic-billing-header", "x-anthropic-billing-header", None),  # no colon: not the header
    ("", "", None),
])  # fmt: skip
def test_strip_billing_header(text, rest, dropped):
    assert strip_billing_header(text) == (rest, dropped)


@pytest.mark.parametrize(("message", "kept"), [
    ({"role": "system", "content": HEADER}, None),
    ({"role": "developer", "content": HEADER + "\n\nBe brief."}, {"role": "developer", "content": "Be brief."}),
    ({"role": "system", "content": [{"type": "text", "text": HEADER}, {"type": "text", "text": "Be brief."}]},
     {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}),
    ({"role": "system", "content": [{"type": "text", "text": HEADER}]}, None),
    ({"role": "system", "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": HEADER}]},
     "same"),  # a later part: not the start of the message
    ({"role": "user", "content": HEADER}, "same"),  # the user's own words are never rewritten
    ({"role": "assistant", "content": HEADER}, "same"),
])  # fmt: skip
def test_without_billing_header(message, kept):
    m = Message.model_validate(message)
    out, header = without_billing_header(m)
    assert header == (None if kept == "same" else HEADER)
    assert out is m if kept == "same" else (out is None if kept is None else out.model_dump(exclude_none=True) == kept)


def test_the_chat_input_has_no_empty_system_message_and_names_what_it_dropped():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": HEADER}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": HEADER}]})
    chat = to_chat_input(req, MediaPolicy())
    assert chat.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": HEADER}]
    assert chat.billing_headers == (HEADER,)


# A real server: a Claude Code session's shape, its history growing by one tool call and result a turn

SYSTEM = "You are a coding agent. Follow the repository's conventions and explain what you change. " * 40
TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i}: reads or edits files in the workspace.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
         for i in range(4)]


def _header(entrypoint: str = "cli") -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint={entrypoint}; cch={secrets.token_hex(3)[:5]};"


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    from server_utils import start_server

    server = start_server(["--model", str(build_model("qwen2_5_vl", "micro"))],
                          tmp_path_factory.mktemp("logs") / "billing.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(qwen_server) -> str:
    return httpx.get(qwen_server.url + "/v1/models").json()["data"][0]["id"]


def _turns(count: int) -> list[list[dict]]:
    """Each turn's messages: the task, then one tool call and its result more per turn."""
    history: list[dict] = [{"role": "user", "content": "Find where the config is read and fix the typo."}]
    turns = [list(history)]
    for i in range(1, count):
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "tool_0", "input": {"path": f"src/file_{i}.py"}}
        history += [{"role": "assistant", "content": [use]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                  "content": f"def read_{i}():\n    return open('config.toml')\n"}]}]
        turns.append(list(history))
    return turns


def _session(claude: anthropic.Anthropic, model: str, first_block) -> list[tuple[int, int]]:
    """Three turns of Claude Code's shape: (prompt tokens, cached tokens) of each."""
    counts = []
    for messages in _turns(3):
        system = [{"type": "text", "text": first_block()},
                  {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        m = claude.messages.create(model=model, max_tokens=2, system=system, tools=TOOLS, messages=messages)
        u = m.usage
        counts.append((u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens,
                       u.cache_read_input_tokens))
    return counts


def _dropped(server, model: str) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    found = re.search(rf'^vlmserve_billing_header_dropped_total\{{model="{re.escape(model)}"\}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_claude_code_session_keeps_its_cache(qwen_server, model):
    claude = anthropic.Anthropic(base_url=qwen_server.url, api_key="unused", max_retries=0, timeout=120)
    before = _dropped(qwen_server, model)
    counts = _session(claude, model, _header)
    for (previous, _), (_, cached) in zip(counts, counts[1:]):
        assert cached >= 0.95 * previous, counts  # the whole previous prompt, not the ~20 tokens before the block
    assert _dropped(qwen_server, model) - before == 3
    # The same session with a block the server keeps (its nonce where the header was) misses every time
    kept = _session(claude, model, lambda: f"session-nonce: cch={secrets.token_hex(3)[:5]};")
    assert all(cached < 0.1 * prompt for prompt, cached in kept), kept
    assert [prompt for prompt, _ in kept] > [prompt for prompt, _ in counts]  # it is in the prompt: longer


def test_the_block_is_logged_once_per_client(qwen_server, model):
    claude = anthropic.Anthropic(base_url=qwen_server.url, api_key="unused", max_retries=0, timeout=120)
    for entrypoint in ("cli", "cli", "sdk-ts", "sdk-ts", "cli"):
        claude.messages.create(model=model, max_tokens=1, system=[{"type": "text", "text": _header(entrypoint)}],
                               messages=[{"role": "user", "content": "hi"}])
    lines = [line for line in qwen_server.log.splitlines() if "x-anthropic-billing-header" in line]
    assert [re.search(r"cc_entrypoint=(\S+) \(", line).group(1) for line in lines] == ["cli", "sdk-ts"], lines
    assert "cch=..." in lines[0] and "vlmserve_billing_header_dropped_total" in lines[0]


def _tokens(server, model: str, messages: list[dict]) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_prompt_is_the_one_without_the_block(qwen_server, model):
    user = {"role": "user", "content": "hi"}
    without = _tokens(qwen_server, model, [{"role": "system", "content": "Be brief."}, user])
    assert _tokens(qwen_server, model, [{"role": "system", "content": _header() + "\n\nBe brief."}, user]) == without
    assert _tokens(qwen_server, model, [{"role": "system", "content": _header()},
                                        {"role": "system", "content": "Be brief."}, user]) == without
    assert _tokens(qwen_server, model, [{"role": "system", "content": _header()}, user]) == \
        _tokens(qwen_server, model, [user])  # no empty system message: the template's default one
    counted = anthropic.Anthropic(base_url=qwen_server.url, api_key="unused").messages.count_tokens(
        model=model, system=[{"type": "text", "text": _header()}, {"type": "text", "text": "Be brief."}],
        messages=[user])
    assert counted.input_tokens == len(without)


def _chat_turns() -> list[list[dict]]:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "tool_0", "arguments": json.dumps({"path": "a"})}}]
    first = [{"role": "user", "content": "Find where the config is read."}]
    return [first, [*first, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": "call_1", "content": "def read():\n    return 1\n"}]]


def test_the_chat_api_drops_it_from_the_system_message(qwen_server, model):
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    counts = []
    for messages in _chat_turns():
        system = {"role": "system", "content": _header("opencode") + "\n" + SYSTEM}
        r = client.chat.completions.create(model=model, max_tokens=2, messages=[system, *messages], tools=tools)
        counts.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    assert counts[1][1] >= 0.95 * counts[0][0], counts


def test_the_responses_api_drops_it_from_the_instructions(qwen_server, model):
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    calls = [{"type": "function_call", "call_id": "call_1", "name": "tool_0", "arguments": json.dumps({"path": "a"})},
             {"type": "function_call_output", "call_id": "call_1", "output": "def read():\n    return 1\n"}]
    task = {"role": "user", "content": "Find where the config is read."}
    counts = []
    for items in ([task], [task, *calls]):
        r = client.responses.create(model=model, max_output_tokens=2, store=False, input=items,
                                    instructions=_header("codex") + "\n\n" + SYSTEM)
        counts.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
    assert counts[1][1] >= 0.95 * counts[0][0], counts
    developer = {"role": "developer", "content": [{"type": "input_text", "text": _header("codex")}]}
    r = client.responses.create(model=model, max_output_tokens=2, store=False, input=[developer, task])
    assert r.usage.input_tokens == len(_tokens(qwen_server, model, [task]))  # the item held only the block
