"""n > 1 on chat completions (issue 32) through the official openai client: the choices share one
prefill and sample as rows of their own; each has its index, and usage counts the prompt once and
every choice's completion. Seeded choices are the requests with seed, seed + 1, ... (as vLLM's)."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

from vlmserve.config import DEFAULT_MODEL_NAME
from vlmserve.testing.demo.dialogues import WEATHER_TOOL

CAPTION = "A red circle, a blue triangle and a yellow star."
EXAMPLE = "assets/example.png"


def _image_message(text: str = "Describe this image.") -> list[dict]:
    import base64
    from pathlib import Path

    data = base64.b64encode((Path(__file__).resolve().parents[1] / EXAMPLE).read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                         {"type": "text", "text": text}]}]


def test_greedy_choices_are_the_one_answer_and_usage_counts_the_prompt_once(demo_client):
    one = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_image_message(), temperature=0)
    three = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_image_message(), temperature=0,
                                                n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [CAPTION] * 3 == [one.choices[0].message.content] * 3
    assert {c.finish_reason for c in three.choices} == {"stop"}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_the_sdk_stream_accumulator_gets_every_choice(demo_client):
    state = ChatCompletionStreamState()
    usage = []
    for chunk in demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_image_message(),
                                                     temperature=0, n=3, stream=True,
                                                     stream_options={"include_usage": True}):
        state.handle_chunk(chunk)
        usage += [chunk.usage] if chunk.usage else []
    final = state.get_final_completion()
    assert [(c.index, c.message.content, c.finish_reason) for c in final.choices] == [(i, CAPTION, "stop")
                                                                                       for i in range(3)]
    (total,) = usage  # once, after every choice ended
    assert total.completion_tokens == 3 * len(demo_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=_image_message(), temperature=0, logprobs=True).choices[0].logprobs.content)


def test_seeded_choices_are_the_requests_with_seed_plus_their_index(client, model_name):
    ask = dict(model=model_name, messages=[{"role": "user", "content": "Say something."}], temperature=1.0,
               max_tokens=8, extra_body={"ignore_eos": True})
    four = client.chat.completions.create(n=4, seed=100, **ask)
    alone = [client.chat.completions.create(seed=100 + i, **ask).choices[0].message.content for i in range(4)]
    assert [c.message.content for c in four.choices] == alone
    assert len(set(alone)) > 1


def test_each_choice_parses_its_own_tool_call(demo_client):
    r = demo_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, temperature=0, n=2, tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What's the weather in Tokyo in celsius?"}])
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"location": "Tokyo", "unit": "celsius"}


def test_too_many_choices_is_a_400(client, model_name):
    try:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], n=257)
    except openai.BadRequestError as exc:
        assert exc.body["param"] == "n" and "takes 1 to 256" in exc.body["message"]
    else:
        raise AssertionError("n=257 was taken")


def test_a_client_that_leaves_mid_stream_frees_every_choices_slot(server, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 3000,
            "ignore_eos": True, "n": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        indexes = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                indexes.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(indexes) == 3 and _running(server) == 3:
                break
    deadline = time.monotonic() + 30
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(server) == 0


def _running(server) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^vlmserve_running_requests\{.*\} (\S+)$", metrics, re.M).group(1))


def test_each_choice_keeps_its_own_grammar(demo_client):
    """Every fork gets its own copy of the response_format matcher: each sampled choice is valid JSON."""
    schema = {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "triangle", "star"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["shape", "count"], "additionalProperties": False}
    r = demo_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=_image_message("Describe one shape."), n=3, temperature=1.0, seed=3,
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    for choice in r.choices:
        reply = json.loads(choice.message.content)
        assert set(reply) == {"shape", "count"} and reply["shape"] in schema["properties"]["shape"]["enum"], reply
