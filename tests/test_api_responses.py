"""``POST /v1/responses`` and ``GET /v1/models/{id}`` on the demo model, through the ``openai`` SDK's
own Responses client and stream accumulator."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from vlmserve.config import DEFAULT_MODEL_NAME
from vlmserve.testing.demo.dialogues import WEATHER_TOOL

EXAMPLE = Path(__file__).resolve().parents[1] / "assets" / "example.png"
CAPTION = "A red circle, a blue triangle and a yellow star."
FUNCTION = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat tool shape
TOKYO = "What's the weather in Tokyo in celsius?"






def _image_input(text: str = "Describe this image.") -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(EXAMPLE.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": text}]}]


def test_an_image_caption_through_responses_create(demo_client):
    r = demo_client.responses.create(model=DEFAULT_MODEL_NAME, input=_image_input(), temperature=0, max_output_tokens=40)
    assert r.status == "completed" and r.output_text == CAPTION
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.store is False and r.id.startswith("resp_")


def test_the_sdk_stream_accumulator_gets_the_same_caption(demo_client):
    with demo_client.responses.stream(model=DEFAULT_MODEL_NAME, input=_image_input(), temperature=0,
                                 max_output_tokens=40) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == CAPTION and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added")


def test_text_input_instructions_and_max_output_tokens(demo_client):
    r = demo_client.responses.create(model=DEFAULT_MODEL_NAME, input="Hello!", instructions="Be brief.",
                                temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.instructions == "Be brief."


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_result(demo_client, stream):
    if stream:
        with demo_client.responses.stream(model=DEFAULT_MODEL_NAME, input=TOKYO, tools=[FUNCTION], temperature=0) as s:
            for _ in s:
                pass
            r = s.get_final_response()
    else:
        r = demo_client.responses.create(model=DEFAULT_MODEL_NAME, input=TOKYO, tools=[FUNCTION], temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"location": "Tokyo", "unit": "celsius"}
    assert call.call_id and call.status == "completed"
    answer = demo_client.responses.create(model=DEFAULT_MODEL_NAME, tools=[FUNCTION], temperature=0, max_output_tokens=40,
                                     input=[{"role": "user", "content": TOKYO},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"temperature": 21, "unit": "celsius"})}])
    assert re.fullmatch(r"It is -?\d+ degrees in Tokyo\.", answer.output_text), answer.output_text


@pytest.mark.parametrize("body, param, says", [
    ({"store": True}, "store", "stores no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0",
     "'input_file'"),
    ({"input": [{"type": "web_search_call"}]}, "input.0", "'web_search_call'"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "'web_search'"),
    ({"input": "hi", "temperature": 7}, "temperature", "less than or equal to 2"),
])
def test_what_this_server_does_not_take_is_a_clear_400(demo_server, body, param, says):
    r = httpx.post(demo_server.url + "/v1/responses", json={"model": DEFAULT_MODEL_NAME, "input": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_models_by_id(demo_client):
    assert demo_client.models.retrieve(DEFAULT_MODEL_NAME).id == DEFAULT_MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        demo_client.models.retrieve("no-such-model")


def test_text_format_json_schema_is_enforced(demo_client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Shape(BaseModel):
        shape: Literal["circle", "square", "triangle", "star"]
        count: int = Field(ge=0, le=9)

    r = demo_client.responses.parse(model=DEFAULT_MODEL_NAME, input=_image_input("Describe one shape."), text_format=Shape,
                               temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, Shape)


@pytest.mark.parametrize("parallel", [None, False])
def test_parallel_tool_calls_is_echoed_as_asked(demo_client, parallel):
    tools = [{"type": "function", "name": "look", "parameters": {"type": "object", "properties": {}}}]
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = demo_client.responses.create(model=DEFAULT_MODEL_NAME, input="hi", tools=tools, max_output_tokens=2,
                                     store=False, **extra)
    assert r.parallel_tool_calls is (parallel is not False)
