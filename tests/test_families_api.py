"""Each family's tool-call format, round trip through one real ``vlmserve serve`` of all families.

The micro models are tuned (vlmserve.testing.tool_tuning) to answer the weather question with a
``get_weather`` call and the tool's result with a sentence, in whatever syntax their own chat
template writes: Gemma 4's ``call:NAME{...}``, Hermes JSON, Qwen3.5's XML after its reasoning,
Mistral's ``[TOOL_CALLS]NAME[ARGS]``, or the Hermes prompt vlmserve writes for templates without
tools. The official ``openai`` client reads the calls, streamed (its own accumulator) and not,
and sends them back with the result.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import NOT_GIVEN
from server_utils import ServerProcess, start_server

from vlmserve.testing import ARCHS, build_model
from vlmserve.testing.tool_tuning import ANSWER, ASK, RESULT, WEATHER_TOOL


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    return {arch: build_model(arch, "micro", tools=True) for arch in ARCHS}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Every family at once: one worker thread and MLX stream per model, in one process."""
    args = [arg for path in models.values() for arg in ("--model", str(path))]
    proc = start_server(args, tmp_path_factory.mktemp("logs") / "families.log", timeout=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):  # noqa: ANN201 - openai.OpenAI
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _call_of(message) -> tuple[str, dict]:  # noqa: ANN001 - an openai message
    (call,) = message.tool_calls
    assert call.type == "function" and call.id
    return call.function.name, json.loads(call.function.arguments)


@pytest.mark.parametrize("arch", ARCHS)
def test_tool_call_round_trip(client, models: dict[str, Path], arch: str) -> None:  # noqa: ANN001
    model, request = models[arch].name, {"tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 64}
    first = client.chat.completions.create(model=model, messages=ASK, **request)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message
    assert _call_of(first.choices[0].message) == ("get_weather", {"location": "Tokyo"})

    with client.chat.completions.stream(model=model, messages=ASK, **request) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _call_of(streamed.choices[0].message) == ("get_weather", {"location": "Tokyo"})

    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(model=model, messages=history, **request)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content.strip() == ANSWER
    assert not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_reasoning_is_kept_apart_from_the_answer(client, models: dict[str, Path], arch: str) -> None:  # noqa: ANN001
    """Qwen3.5's prompt opens <think>: the reply's reasoning goes to reasoning_content, never content."""
    first = client.chat.completions.create(model=models[arch].name, messages=ASK, tools=[WEATHER_TOOL],
                                           temperature=0, max_tokens=64)
    message = first.choices[0].message
    assert "think>" not in (message.content or "") and message.model_extra.get("reasoning_content") is not None


def test_models_lists_every_family(client, models: dict[str, Path]) -> None:  # noqa: ANN001
    assert {m.id for m in client.models.list()} == {str(p) for p in models.values()}


FORECAST = {"type": "object", "additionalProperties": False, "required": ["sky", "warm"],
            "properties": {"sky": {"enum": ["clear", "cloudy", "rain"]}, "warm": {"type": "boolean"}}}


@pytest.mark.parametrize("arch", ARCHS)
def test_constrained_output_in_every_family(client, models: dict[str, Path], arch: str) -> None:  # noqa: ANN001
    """A forced call in the family's own syntax comes back as a call, and a JSON schema is met."""
    model = models[arch].name
    hello = [{"role": "user", "content": "Say hello."}]
    # A micro model rambles inside a free string: the schema bounds it, as a client's may.
    bounded = json.loads(json.dumps(WEATHER_TOOL))
    bounded["function"]["parameters"]["properties"]["location"]["maxLength"] = 12
    forced = client.chat.completions.create(model=model, messages=hello, tools=[bounded], max_tokens=64,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            temperature=0)
    name, args = _call_of(forced.choices[0].message)
    assert name == "get_weather" and isinstance(args.get("location"), str), forced.choices[0].message
    shaped = client.chat.completions.create(model=model, messages=hello, max_tokens=64, temperature=0,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "forecast", "schema": FORECAST, "strict": True}})
    assert shaped.choices[0].finish_reason == "stop", shaped.choices[0].message
    assert set(json.loads(shaped.choices[0].message.content)) == {"sky", "warm"}


def test_a_grammar_the_matcher_cannot_follow_fails_the_request_not_the_constraint(client, models) -> None:  # noqa: ANN001
    """Written as text, Qwen's ``<tool_call>`` (an added token) is allowed by llguidance's mask as the
    token, then refused when it comes: the request fails with a clear error instead of going on
    unconstrained."""
    import openai

    with pytest.raises(openai.InternalServerError, match="constrained decoding failed"):
        client.chat.completions.create(model=models["qwen2_5_vl"].name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=16, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": 'start: "<tool_call>" "done"'}})
    ok = client.chat.completions.create(model=models["qwen2_5_vl"].name, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")



SCREENSHOT_TOOL = {"type": "function", "function": {"name": "screenshot", "description": "Take a screenshot.",
                                                    "parameters": {"type": "object", "properties": {}}}}
ASKED = {"role": "user", "content": "Check the page."}


def _messages_turn(server: ServerProcess, model: str, url: str, image: bool, tools: bool) -> int:
    """Claude Code's shape: the result's blocks inside a user message."""
    import anthropic

    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    result = [{"type": "text", "text": "The page:"}, *([{"type": "image", "source": source}] if image else [])]
    use = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}
    function = SCREENSHOT_TOOL["function"]
    offered = [{"name": function["name"], "description": function["description"],
                "input_schema": function["parameters"]}] if tools else anthropic.NOT_GIVEN
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    usage = claude.messages.create(model=model, max_tokens=2, tools=offered, messages=[
        ASKED, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]).usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def _chat_turn(client, model: str, url: str, image: bool, tools: bool) -> int:  # noqa: ANN001 - openai.OpenAI
    """OpenCode's shape: a tool message with image parts."""
    parts = [{"type": "text", "text": "The page:"}, *([{"type": "image_url", "image_url": {"url": url}}] * image)]
    call = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    c = client.chat.completions.create(model=model, max_tokens=2, temperature=0, messages=[
        ASKED, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": parts}], tools=[SCREENSHOT_TOOL] if tools else NOT_GIVEN)
    return c.usage.prompt_tokens


def _responses_turn(client, model: str, url: str, image: bool, tools: bool) -> int:  # noqa: ANN001 - openai.OpenAI
    """Codex's shape: a function_call_output with an input_image."""
    output = [{"type": "input_text", "text": "The page:"}, *([{"type": "input_image", "image_url": url}] * image)]
    r = client.responses.create(model=model, max_output_tokens=2, temperature=0, input=[
        ASKED, {"type": "function_call", "call_id": "call_1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": output}],
        tools=[{"type": "function", **SCREENSHOT_TOOL["function"]}] if tools else NOT_GIVEN)
    return r.usage.input_tokens


@pytest.mark.parametrize("api", ["messages", "chat", "responses"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_screenshot_in_a_tool_result_reaches_every_family(server, client, models,  # noqa: ANN001
                                                            arch: str, api: str) -> None:
    """[user, the assistant's screenshot call, its result: text and the picture], with tools offered and without.
    Was a 400 on Gemma 3, Mistral 3.2, Pixtral and LLaVA-NeXT ("roles must alternate"): their templates take no
    tool message, no two user turns in a row, or no user turn after results. The picture adds its tokens."""
    from PIL import Image
    from server_utils import image_data_url

    model, url = models[arch].name, image_data_url(Image.new("RGB", (64, 48), (200, 30, 30)))
    if api == "messages":
        turn = functools.partial(_messages_turn, server, model, url)
    else:
        turn = functools.partial(_chat_turn if api == "chat" else _responses_turn, client, model, url)
    text_only = turn(image=False, tools=False)
    if arch == "paligemma":  # its template keeps the last turn only: the picture's user turn, not the result
        assert turn(image=True, tools=False) == turn(image=True, tools=True) != text_only
        return
    assert turn(image=True, tools=False) > text_only
    assert turn(image=True, tools=True) > text_only


def _replayed_turn(server: ServerProcess, model: str, tools: bool, region: str = "top", result: str = "Done.",
                   words: str = "") -> int:
    """Claude Code's shape: a user message of the tool_result and, with ``words``, a text block after it."""
    import anthropic

    function = SCREENSHOT_TOOL["function"]
    offered = [{"name": function["name"], "description": function["description"],
                "input_schema": function["parameters"]}] if tools else anthropic.NOT_GIVEN
    use = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {"region": region}}
    blocks = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result},
              *([{"type": "text", "text": words}] if words else [])]
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    usage = claude.messages.create(model=model, max_tokens=1, tools=offered, messages=[
        ASKED, {"role": "assistant", "content": [use]}, {"role": "user", "content": blocks}]).usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_call_its_result_and_the_users_words_reach_every_family(server, models, arch: str,  # noqa: ANN001
                                                                    tools: bool) -> None:
    """Each adds its tokens. Without tools (a follow-up turn, a harness replaying history) Qwen2-VL's, LFM2-VL's and
    InternVL's templates dropped the call, SmolVLM's and LLaVA's the result too; Mistral 3.2's refused the user's
    words after a result (a 400, "roles must alternate"). PaliGemma's keeps the last turn only: not the call."""
    turn = functools.partial(_replayed_turn, server, models[arch].name, tools)
    base = turn()
    assert turn(result="Done. The settings page shows three toggles, all switched off.") > base
    assert turn(words="Now open the network tab and look for failed requests.") > turn(words="Go on.")
    assert turn(region="the whole window, including the browser's address bar") > base or arch == "paligemma"
