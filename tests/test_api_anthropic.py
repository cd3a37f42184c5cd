"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` on the demo model, through the official
``anthropic`` SDK: its client, its stream accumulator and its exceptions, as Claude Code's kin use them."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import anthropic
import httpx
import pytest

from vlmserve.config import DEFAULT_MODEL_NAME
from vlmserve.testing.demo.dialogues import WEATHER_TOOL

EXAMPLE = Path(__file__).resolve().parents[1] / "assets" / "example.png"
CAPTION = "A red circle, a blue triangle and a yellow star."
TOKYO = "What's the weather in Tokyo in celsius?"
GREEDY = {"temperature": 0}  # the SDK's create() has no sampling parameters since 2.x; the API still takes them
TOOL = {"name": WEATHER_TOOL["function"]["name"], "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture
def claude(demo_server):
    return anthropic.Anthropic(base_url=demo_server.url, api_key="unused", max_retries=0, timeout=120)


def _image(text: str = "Describe this image.") -> list[dict]:
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(EXAMPLE.read_bytes()).decode()}
    return [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": text}]}]


def test_an_image_caption(claude):
    m = claude.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=40, messages=_image(), extra_body=GREEDY)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == CAPTION
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.role == "assistant"
    assert m.id.startswith("msg_") and m.model == DEFAULT_MODEL_NAME
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0 and m.usage.cache_read_input_tokens == 0


def test_the_sdk_stream_accumulator_gets_the_same_caption(claude):
    with claude.messages.stream(model=DEFAULT_MODEL_NAME, max_tokens=40, messages=_image(), extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == CAPTION and final.stop_reason == "end_turn"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.index("content_block_start") < kinds.index("text") < kinds.index("content_block_stop")
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_and_its_result(claude, stream):
    kwargs = dict(model=DEFAULT_MODEL_NAME, max_tokens=60, tools=[TOOL], extra_body=GREEDY)
    asked = [{"role": "user", "content": TOKYO}]
    if stream:
        with claude.messages.stream(messages=asked, **kwargs) as s:
            kinds = {event.type for event in s}
            m = s.get_final_message()
        assert "input_json" in kinds  # the input arrives as input_json_delta, and the SDK parses it
    else:
        m = claude.messages.create(messages=asked, **kwargs)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input == {"location": "Tokyo", "unit": "celsius"} and use.id
    result = json.dumps({"temperature": 21, "unit": "celsius"})
    answer = claude.messages.create(messages=[
        *asked, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}], **kwargs)
    assert answer.stop_reason == "end_turn"
    assert re.fullmatch(r"It is -?\d+ degrees in Tokyo\.", answer.content[0].text), answer.content


def test_any_tool_forces_a_call(claude):
    m = claude.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=60, tools=[TOOL], extra_body=GREEDY,
                               tool_choice={"type": "any"}, messages=_image())
    assert m.stop_reason == "tool_use" and [b.type for b in m.content][-1] == "tool_use"


def test_max_tokens_and_stop_sequences(claude):
    cut = claude.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=3, messages=_image(), extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stopped = claude.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=40, messages=_image(), extra_body=GREEDY,
                                     stop_sequences=["triangle", "blue"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "blue"
    assert stopped.content[0].text == "A red circle, a "


def test_output_config_format_is_enforced(claude):
    schema = {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "triangle", "star"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["shape", "count"], "additionalProperties": False}
    m = claude.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=60, messages=_image("Describe one shape."),
                               output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    reply = json.loads(m.content[0].text)
    assert set(reply) == {"shape", "count"} and reply["shape"] in schema["properties"]["shape"]["enum"], reply


def test_a_system_prompt_and_count_tokens(claude, demo_server):
    kwargs = dict(model=DEFAULT_MODEL_NAME, system="You describe pictures.", messages=_image(), tools=[TOOL])
    counted = claude.messages.count_tokens(**kwargs)
    m = claude.messages.create(max_tokens=2, **kwargs)
    u = m.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens > 0
    plain = claude.messages.count_tokens(model=DEFAULT_MODEL_NAME, messages=_image())
    assert plain.input_tokens < counted.input_tokens  # the system prompt and the tool cost tokens


@pytest.mark.parametrize("body, status, kind, says", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "invalid_request_error",
     "messages.0.content.0: content blocks of type 'document'"),
    ({"messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error", "top-level system"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "server tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                              "media_type": "image/png", "data": "nope"}}]}]},
     400, "invalid_request_error", "image"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"output_config": {"format": {"type": "text"}}}, 400, "invalid_request_error", "output_config.format"),
    ({"thinking": {"type": "sometimes"}}, 400, "invalid_request_error", "thinking.type"),
])
def test_what_this_server_does_not_take_is_an_anthropic_error(demo_server, body, status, kind, says):
    request = {"model": DEFAULT_MODEL_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(demo_server.url + "/v1/messages", json={k: v for k, v in request.items() if v is not None},
                   timeout=60)
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind and says in r.json()["error"]["message"], r.text


def test_the_sdk_raises_its_own_exceptions(claude):
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="media_type"):
        claude.messages.create(model=DEFAULT_MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}])


def test_bad_json_on_the_messages_path_is_an_anthropic_error_and_chat_keeps_openai_s(demo_server):
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):
        r = httpx.post(demo_server.url + path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        if path.startswith("/v1/messages"):
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
        else:
            assert "type" not in r.json() and r.json()["error"]["type"] == "invalid_request_error", r.text
