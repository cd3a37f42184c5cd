"""``vlmserve serve`` on its default model, the trained demo, driven by the official ``openai`` client.

The model's own (malformed, single-quoted) Gemma 4 tool calls come back as OpenAI ``tool_calls``
through the repair path, captions end by EOS with ``finish_reason: "stop"``, streamed and not.
"""

from __future__ import annotations

import json
import re

import pytest
from server_utils import image_data_url

from vlmserve.config import DEFAULT_MODEL_NAME
from vlmserve.testing.demo.dialogues import WEATHER_TOOL, weather_exchange
from vlmserve.testing.demo.render import render
from vlmserve.testing.demo.scenes import Scene, grid_shape

SCENE = Scene((grid_shape("triangle", "yellow", 7, 0.7), grid_shape("square", "red", 2), grid_shape("star", "blue", 4, 0.65)))
TOKYO = {"role": "user", "content": "What's the weather in Tokyo in celsius?"}
GREEDY = {"temperature": 0}  # OpenAI's default is 1: sampled, a less likely unit comes up now and then




@pytest.fixture
def client(demo_client):
    return demo_client


def test_default_model_is_the_demo(client) -> None:
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]


def test_malformed_tool_call_comes_back_as_tool_calls(client) -> None:
    response = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[TOKYO], tools=[WEATHER_TOOL], **GREEDY)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # no raw <|tool_call> markup leaks
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Tokyo", "unit": "celsius"}


def test_streamed_tool_call(client) -> None:
    stream = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[TOKYO], tools=[WEATHER_TOOL], stream=True,
                                            **GREEDY)
    content, arguments, names, finish = "", "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            names += [call.function.name] if call.function and call.function.name else []
            arguments += call.function.arguments or "" if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, names, finish) == ("", ["get_weather"], "tool_calls")
    assert json.loads(arguments) == {"location": "Tokyo", "unit": "celsius"}


def test_the_sdks_own_stream_accumulator_gets_one_whole_call(client, demo_server) -> None:
    """``client.chat.completions.stream`` (the SDK's accumulator) sees one call with a name and its
    arguments, and no chunk carries two entries of one index."""
    with client.chat.completions.stream(model=DEFAULT_MODEL_NAME, messages=[TOKYO], tools=[WEATHER_TOOL],
                                        **GREEDY) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    assert json.loads(call.function.arguments) == {"location": "Tokyo", "unit": "celsius"}
    import httpx

    body = {"model": DEFAULT_MODEL_NAME, "messages": [TOKYO], "tools": [WEATHER_TOOL], "stream": True, **GREEDY}
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    entries = [c["choices"][0]["delta"].get("tool_calls") or [] for c in chunks if c["choices"]]
    assert all(len(e) <= 1 for e in entries) and sum(len(e) for e in entries) >= 2
    first = next(e[0] for e in entries if e)
    assert first["id"] and first["type"] == "function" and first["function"]["name"] == "get_weather"


def test_answer_to_the_tool_result_ends_by_itself(client) -> None:
    call, result = weather_exchange("Tokyo", "celsius", 21)
    call["tool_calls"][0]["function"]["arguments"] = json.dumps(call["tool_calls"][0]["function"]["arguments"])
    response = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[TOKYO, call, result],
                                              tools=[WEATHER_TOOL], max_tokens=40, **GREEDY)  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(r"It is -?\d+ degrees in Tokyo\.", choice.message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_caption_ends_by_eos_with_stop(client, stream: bool) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(render(SCENE))}},
        {"type": "text", "text": "Describe this image."},
    ]}]  # fmt: skip
    if not stream:
        response = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=60, **GREEDY)
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
        assert response.usage.completion_tokens < 60
    else:
        chunks = list(client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=60, stream=True,
                                                     **GREEDY))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    assert (text, finish) == (SCENE.caption, "stop")
