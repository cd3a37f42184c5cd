"""Anthropic's ``cache_control`` breakpoints on a real server, through the ``anthropic`` SDK: a session's prompt
sent with one survives a burst of other long prompts in a small prefix cache, and without one it does not;
``cache_creation_input_tokens`` counts what a request newly stored; a malformed breakpoint is Anthropic's 400.
A forced tool call's prompt is the one ``auto`` renders, so an agent's forced turn reuses its session too."""

from __future__ import annotations

import re

import anthropic
import httpx
import pytest

from vlmserve.testing import build_model

ENTRIES = 4  # the prefix cache's bound here: 20 other prompts go through it five times over
SYSTEM = "You are a coding agent working in a large repository. Read before you edit; run the tests. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_utils import start_server

    server = start_server(["--model", str(build_model("qwen2_5_vl", "micro")), "--prefix-cache-entries", str(ENTRIES)],
                          tmp_path_factory.mktemp("logs") / "cache_control.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def _ask(claude, model: str, system: str, text: str, control: dict | None = None):
    block = {"type": "text", "text": system, **({"cache_control": control} if control else {})}
    return claude.messages.create(model=model, max_tokens=2, system=[block],
                                  messages=[{"role": "user", "content": text}]).usage


def _burst(claude, model: str, label: str) -> None:
    """20 other long prompts, none sharing more than the chat header with the session."""
    for i in range(20):
        _ask(claude, model, f"Agent {label}-{i} of another team. " * 40, f"task {i}")


def _pinned(server) -> float:
    found = re.search(r"^vlmserve_prefix_cache_pinned_entries\{.*\} (\S+)$", httpx.get(server.url + "/metrics").text,
                      re.M)
    return float(found.group(1)) if found else -1.0


@pytest.mark.parametrize("control", [{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}])
def test_a_prefix_sent_with_a_breakpoint_survives_twenty_other_long_requests(server, claude, model, control):
    first = _ask(claude, model, SYSTEM + control.get("ttl", ""), "Fix the failing test.", control)
    whole = first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens
    assert first.cache_creation_input_tokens == whole - first.cache_read_input_tokens  # all of it newly stored
    assert _pinned(server) >= 1
    _burst(claude, model, "pinned")
    again = _ask(claude, model, SYSTEM + control.get("ttl", ""), "Fix the failing test.", control)
    assert again.cache_read_input_tokens == whole - 1  # all but the last token, which is computed for its logits
    assert again.cache_creation_input_tokens == 1 and again.input_tokens == 0


def test_the_same_prefix_without_a_breakpoint_is_evicted_by_them(claude, model):
    first = _ask(claude, model, "Unpinned. " + SYSTEM, "Fix the failing test.")
    whole = first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens
    _burst(claude, model, "unpinned")
    again = _ask(claude, model, "Unpinned. " + SYSTEM, "Fix the failing test.")
    assert again.cache_read_input_tokens < 0.1 * whole  # the chat header at most
    assert again.cache_creation_input_tokens > 0.9 * whole  # stored again


def test_a_breakpoint_on_a_tool_result_or_the_request_itself_pins_too(server, claude, model):
    before = _pinned(server)
    messages = [{"role": "user", "content": "Read the config."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "cache_control":
                                              {"type": "ephemeral"}, "content": "debug = true"}]}]
    tools = [{"name": "read", "description": "Read a file.", "input_schema": {"type": "object", "properties": {}}}]
    claude.messages.create(model=model, max_tokens=2, system="Tool session. " * 30, tools=tools, messages=messages)
    claude.messages.create(model=model, max_tokens=2, system="Automatic caching. " * 30, messages=messages[:1],
                           extra_body={"cache_control": {"type": "ephemeral"}})
    assert _pinned(server) >= before + 2


@pytest.mark.parametrize(("control", "says"), [
    ({"type": "persistent"}, "cache_control is"),
    ({"type": "ephemeral", "ttl": "10m"}, "is not one of 5m, 1h"),
    ("ephemeral", "cache_control is"),
])
def test_a_malformed_breakpoint_is_an_anthropic_400(claude, model, control, says):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _ask(claude, model, "Be brief.", "hi", control)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert says in caught.value.body["error"]["message"] and "system.0.cache_control" in caught.value.body["error"]["message"]


def test_the_chat_api_takes_cache_ttl_in_seconds(server, claude, model):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Chat session. " * 30}, {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=model, max_tokens=2, messages=messages, extra_body={"cache_ttl": 3600})
    _burst(claude, model, "chat")
    again = client.chat.completions.create(model=model, max_tokens=2, messages=messages)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    for bad in (0, 7200):
        with pytest.raises(openai.BadRequestError, match="cache_ttl"):
            client.chat.completions.create(model=model, max_tokens=2, messages=messages, extra_body={"cache_ttl": bad})


def test_a_forced_tool_call_reuses_the_sessions_cached_prompt(server, model):
    """Where a grammar forces the call (the model has a tool parser), a forced turn's prompt is the one
    ``auto`` renders: every tool, no instruction line. An agent's forced turn then reuses its session."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}} for i in range(4)]
    messages = [{"role": "system", "content": "Forced session. " * 30}, {"role": "user", "content": "Open a file."}]
    # pinned: the earlier tests' pins fill this small cache, where an unpinned prompt would go at once
    auto = client.chat.completions.create(model=model, max_tokens=2, messages=messages, tools=tools,
                                          extra_body={"cache_ttl": 3600})
    for choice in ("required", {"type": "function", "function": {"name": "tool_2"}}):
        r = client.chat.completions.create(model=model, max_tokens=2, messages=messages, tools=tools,
                                           tool_choice=choice)
        assert r.usage.prompt_tokens == auto.usage.prompt_tokens
        assert r.usage.prompt_tokens_details.cached_tokens == auto.usage.prompt_tokens - 1
