"""Each family's tool-call format, round trip through one real ``vlmserve serve`` of all families.

The micro models are tuned (vlmserve.testing.tool_tuning) to answer the weather question with a
``get_weather`` call and the tool's result with a sentence, in whatever syntax their own chat
template writes: Gemma 4's ``call:NAME{...}``, Hermes JSON, Qwen3.5's XML after its reasoning,
Mistral's ``[TOOL_CALLS]NAME[ARGS]``, or the Hermes prompt vlmserve writes for templates without
tools. The official ``openai`` client reads the calls, streamed (its own accumulator) and not,
and sends them back with the result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
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
