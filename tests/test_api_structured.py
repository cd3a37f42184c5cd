"""Constrained decoding through the real server and the openai SDK on the demo model: JSON schemas,
JSON objects, regexes and choices, and forced tool calls always come out valid."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Literal

import httpx
import pytest
from conftest import running_engine
from pydantic import BaseModel, Field

from vlmserve.config import DEFAULT_MODEL_NAME
from vlmserve.engine.params import SamplingParams
from vlmserve.preprocess.guided import GuideSpec
from vlmserve.testing.demo.dialogues import WEATHER_TOOL

EXAMPLE = Path(__file__).resolve().parents[1] / "assets" / "example.png"
IMAGE_URL = "data:image/png;base64," + base64.b64encode(EXAMPLE.read_bytes()).decode()


class Shape(BaseModel):
    shape: Literal["circle", "square", "triangle", "star"]
    colour: Literal["red", "green", "blue", "yellow", "purple"]
    count: int = Field(ge=0, le=9)


STRICT = {**Shape.model_json_schema(), "additionalProperties": False}  # else any extra key may follow


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
                                         {"type": "text", "text": text}]}]






def test_parse_returns_a_schema_valid_object_ten_of_ten(demo_client):
    for seed in range(10):
        r = demo_client.chat.completions.parse(model=DEFAULT_MODEL_NAME, messages=_ask("Describe one shape as JSON."),
                                          response_format=Shape, temperature=1.0, seed=seed, max_tokens=80)
        assert isinstance(r.choices[0].message.parsed, Shape), r.choices[0].message.content


def test_the_sdk_stream_parses_the_same_object_ten_of_ten(demo_client):
    for seed in range(10):
        kwargs = {"model": DEFAULT_MODEL_NAME, "messages": _ask("Describe one shape as JSON."), "response_format": Shape,
                  "temperature": 1.0, "seed": seed, "max_tokens": 80}
        whole = demo_client.chat.completions.parse(**kwargs).choices[0].message.parsed
        with demo_client.chat.completions.stream(**kwargs) as stream:
            streamed = stream.get_final_completion().choices[0].message.parsed
        assert isinstance(streamed, Shape) and streamed == whole  # the same seed: the same object


def test_json_object_regex_and_choice(demo_client):
    # Any object: the demo model, which never saw JSON, writes a key that never ends; the object opens,
    # and whatever it finishes parses.
    r = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_ask("Answer in JSON."), max_tokens=60,
                                       response_format={"type": "json_object"}, temperature=0)
    content = r.choices[0].message.content
    assert content.startswith('{"')
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    r = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_ask("Describe one."), max_tokens=80,
                                       temperature=0, extra_body={"structured_outputs": {"json": STRICT}})
    Shape.model_validate_json(r.choices[0].message.content)
    r = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_ask("How many shapes?"), max_tokens=10,
                                       temperature=0, extra_body={"structured_outputs": {"regex": "[0-9]{1,2} shapes"}})
    assert re.fullmatch(r"[0-9]{1,2} shapes", r.choices[0].message.content)
    r = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_ask("Is there a star?"), max_tokens=10,
                                       temperature=0, extra_body={"structured_outputs": {"choice": ["maybe", "nope"]}})
    assert r.choices[0].message.content in ("maybe", "nope") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_always_comes_with_schema_valid_arguments(demo_client, choice):
    # An unbounded string ends when the model closes it: sampled at 1.0 on a prompt it would answer
    # in words, the demo model once wrote JSON into `location` until max_tokens. A bound makes the
    # grammar close it, so the call always comes.
    tool = json.loads(json.dumps(WEATHER_TOOL))
    tool["function"]["parameters"]["properties"]["location"]["maxLength"] = 24
    for seed in range(3):  # a prompt the model would answer in words: the call comes anyway
        r = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=_ask("Describe this image."),
                                           tools=[tool], tool_choice=choice, temperature=1.0, seed=seed,
                                           max_tokens=60)
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        assert isinstance(args["location"], str) and len(args["location"]) <= 24
        assert args.get("unit", "celsius") in ("celsius", "fahrenheit")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_it(demo_server, extra, param):
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(demo_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_constrained_row_leaves_its_unconstrained_batch_neighbour_unchanged(gemma4_micro):
    text = [{"role": "user", "content": "Tell me a story about shapes."}]
    free = SamplingParams(max_tokens=16, ignore_eos=True)

    async def tokens(engine, rid, params):
        out = []
        async for step in engine.generate_chat(rid, text, [], None, params):
            out += step.token_ids
        return out

    async def run():
        async with running_engine(gemma4_micro, max_batch_size=4) as engine:
            alone = await tokens(engine, "alone", free)
            guide = await engine.guide(GuideSpec("json_schema", Shape.model_json_schema()))
            bound = SamplingParams(max_tokens=40, guide=guide)
            together = await asyncio.gather(tokens(engine, "free", free), tokens(engine, "bound", bound))
            stats = await engine.stats()
            return alone, together, stats, engine.loaded.tokenizer

    alone, (free_tokens, bound_tokens), stats, tokenizer = asyncio.run(run())
    assert free_tokens == alone
    assert stats.steps > 0
    text_out = tokenizer.decode(bound_tokens, skip_special_tokens=True)
    if len(bound_tokens) < 40:  # finished by itself: the JSON is complete and valid
        Shape.model_validate_json(text_out)


def test_two_calls_in_one_turn_stream_as_two_whole_calls(demo_client, demo_server):
    """A grammar makes the demo model write two Gemma 4 calls; the SDK's own accumulator sees two
    whole calls, and no chunk carries two entries of one index."""
    from transformers import AutoTokenizer  # the ids of the markers

    from vlmserve.config import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    start, end, quote = (f"<[{tokenizer.convert_tokens_to_ids(t)}]>" for t in ("<|tool_call>", "<tool_call|>", '<|"|>'))

    def call(city: str) -> str:
        return f'{start} "call:get_weather{{location:" {quote} "{city}" {quote} ",unit:" {quote} "celsius" {quote} "}}" {end}'

    kwargs = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Tokyo and Paris?"}],
              "tools": [WEATHER_TOOL], "max_tokens": 80, "temperature": 0,
              "extra_body": {"structured_outputs": {"grammar": f"start: {call('Tokyo')} {call('Paris')}"}}}
    with demo_client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)["location"]) for c in calls] == [
        ("get_weather", "Tokyo"), ("get_weather", "Paris")]
    assert len({c.id for c in calls}) == 2 and final.choices[0].finish_reason == "tool_calls"
    body = {k: v for k, v in kwargs.items() if k != "extra_body"} | kwargs["extra_body"] | {"stream": True}
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    entries = [c["choices"][0]["delta"].get("tool_calls") or [] for c in chunks if c["choices"]]
    assert all(len(e) <= 1 for e in entries)
    firsts = [e[0] for e in entries if e and "id" in e[0]]
    assert [f["index"] for f in firsts] == [0, 1] and all(f["function"]["name"] == "get_weather" for f in firsts)


def test_vllms_older_guided_fields_constrain_as_structured_outputs_does(demo_client, demo_server):
    ask = {"model": DEFAULT_MODEL_NAME, "max_tokens": 10, "temperature": 0}
    r = demo_client.chat.completions.create(messages=_ask("Is there a star?"), **ask,
                                            extra_body={"guided_choice": ["maybe", "nope"]})
    assert r.choices[0].message.content in ("maybe", "nope")
    r = demo_client.chat.completions.create(messages=_ask("How many shapes?"), **ask,
                                            extra_body={"guided_regex": "[0-9]{1,2} shapes"})
    assert re.fullmatch(r"[0-9]{1,2} shapes", r.choices[0].message.content)
    r = demo_client.chat.completions.create(messages=_ask("Describe one."), **{**ask, "max_tokens": 80},
                                            extra_body={"guided_json": json.dumps(STRICT)})  # a string, as vLLM took it
    Shape.model_validate_json(r.choices[0].message.content)
    for extra in ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, {"guided_json": "{not json"},
                  {"guided_choice": ["a"], "guided_whitespace_pattern": " "}):
        body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **extra}
        refused = httpx.post(demo_server.url + "/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", refused.text


def test_a_forced_call_cut_by_max_tokens_says_length(demo_client):
    """Streamed and not, with the openai client: finish_reason length, and no call closed for the model."""
    ask = {"model": DEFAULT_MODEL_NAME, "messages": _ask("What's the weather in Tokyo?"), "tools": [WEATHER_TOOL],
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 4,
           "temperature": 0}
    reply = demo_client.chat.completions.create(**ask)
    assert reply.choices[0].finish_reason == "length" and not reply.choices[0].message.tool_calls
    finishes = [c.choices[0].finish_reason for c in demo_client.chat.completions.create(stream=True, **ask) if c.choices]
    assert finishes[-1] == "length"


BOUNDED_TOOL = {"type": "function", "function": {"name": "book_trip", "parameters": {
    "type": "object", "required": ["city", "day", "code"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
NUMBERED_TOOL = {"type": "function", "function": {"name": "book_room", "parameters": {
    "type": "object", "required": ["guests", "nights", "budget", "rating", "floor"], "properties": {
        "guests": {"type": "integer", "minimum": 1, "maximum": 4000}, "nights": {"type": "integer", "minimum": 1},
        "budget": {"type": "number", "minimum": 10.5, "maximum": 99.5},
        "rating": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
        "floor": {"type": "integer", "minimum": -3, "maximum": 40, "multipleOf": 2}}}}}


@pytest.mark.parametrize("seed", [0, 5])
def test_a_forced_gemma4_call_keeps_the_schemas_string_bounds(demo_client, seed):
    """Issue 32: Gemma 4's tool grammar wrote strings free (a 304-character city); now maxLength,
    format and pattern bound them, as response_format does, at temperature 1."""
    r = demo_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=_ask("Book me a trip."), tools=[BOUNDED_TOOL], temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "book_trip"}}, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert len(args["city"]) <= 20
    assert re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", args["day"])
    assert re.fullmatch(r"[A-Z]{3}", args["code"])


@pytest.mark.parametrize("seed", [0, 5, 11])
def test_a_forced_gemma4_call_keeps_the_schemas_numeric_bounds(demo_client, seed):
    """Issue 32: integer ranges of 256 or more, one-sided bounds, exclusive bounds, multipleOf and bounded
    numbers (floats) were written free in a forced Gemma 4 call; now they hold as in response_format."""
    r = demo_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=_ask("Book me a room."), tools=[NUMBERED_TOOL], temperature=1.0,
        seed=seed, tool_choice={"type": "function", "function": {"name": "book_room"}}, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert isinstance(args["guests"], int) and 1 <= args["guests"] <= 4000, args
    assert isinstance(args["nights"], int) and args["nights"] >= 1, args
    assert 10.5 <= args["budget"] <= 99.5 and 0 < args["rating"] < 5, args
    assert isinstance(args["floor"], int) and -3 <= args["floor"] <= 40 and args["floor"] % 2 == 0, args
