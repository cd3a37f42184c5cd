"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``)
on the demo model, through the official ``ollama`` client as the local apps use it; its translation of
options, images and messages as tables."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path

import httpx
import ollama
import pytest

from vlmserve.api.app import create_app
from vlmserve.api.errors import APIError
from vlmserve.api.ollama_input import (
    PENALTY_WINDOW,
    ChatRequest,
    GenerateRequest,
    data_url,
    generate_request,
    sampling,
    to_chat_request,
)
from vlmserve.api.state import ServerState
from vlmserve.config import DEFAULT_MODEL_NAME, ServeConfig
from vlmserve.testing.demo.dialogues import WEATHER_TOOL

EXAMPLE = Path(__file__).resolve().parents[1] / "assets" / "example.png"
CAPTION = "A red circle, a blue triangle and a yellow star."
TOKYO = "What's the weather in Tokyo in celsius?"
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def client(demo_server):
    return ollama.Client(host=demo_server.url, timeout=120)


def _ask(text: str, *images: bytes) -> list[dict]:
    return [{"role": "user", "content": text, **({"images": list(images)} if images else {})}]


def test_a_streamed_chat_joins_to_the_whole_reply(client):
    whole = client.chat(model=DEFAULT_MODEL_NAME, messages=_ask("What can you do?"), options=GREEDY)
    parts = list(client.chat(model=DEFAULT_MODEL_NAME, messages=_ask("What can you do?"), options=GREEDY, stream=True))
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].message.content == ""
    last = parts[-1]
    assert (last.done_reason, last.prompt_eval_count, last.eval_count) == (
        whole.done_reason, whole.prompt_eval_count, whole.eval_count)
    assert whole.done_reason == "length" and whole.eval_count == GREEDY["num_predict"]
    assert 0 < whole.prompt_eval_duration <= whole.total_duration and whole.eval_duration > 0


def test_the_counts_are_the_engines_usage(client, demo_client):
    asked = _ask("Describe this image.", EXAMPLE.read_bytes())
    mine = client.chat(model=DEFAULT_MODEL_NAME, messages=asked, options={"temperature": 0})
    url = "data:image/png;base64," + base64.b64encode(EXAMPLE.read_bytes()).decode()
    chat = demo_client.chat.completions.create(model=DEFAULT_MODEL_NAME, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "Describe this image."}]}])
    assert mine.message.content == chat.choices[0].message.content == CAPTION and mine.done_reason == "stop"
    assert (mine.prompt_eval_count, mine.eval_count) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_an_image_is_prompt_tokens(client):
    text = client.chat(model=DEFAULT_MODEL_NAME, messages=_ask("Describe this image."), options=GREEDY)
    seen = client.chat(model=DEFAULT_MODEL_NAME, messages=_ask("Describe this image.", EXAMPLE.read_bytes()),
                       options=GREEDY)
    assert seen.prompt_eval_count > text.prompt_eval_count and seen.message.content == CAPTION


def test_generate_is_a_one_turn_chat(client, demo_server):
    r = client.generate(model=DEFAULT_MODEL_NAME, prompt="Describe this image.", images=[EXAMPLE.read_bytes()],
                        options={"temperature": 0})
    assert r.response == CAPTION and r.done and r.done_reason == "stop" and r.eval_count > 0
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "What can you do?", "options": GREEDY}
    with httpx.stream("POST", demo_server.url + "/api/generate", json=body, timeout=60) as s:
        lines = [json.loads(line) for line in s.iter_lines()]  # streams by default, one object a line
    assert s.headers["content-type"] == "application/x-ndjson" and lines[-1]["done"] is True
    whole = client.generate(model=DEFAULT_MODEL_NAME, prompt="What can you do?", options=GREEDY)
    assert "".join(line["response"] for line in lines) == whole.response != ""
    loads = client.generate(model=DEFAULT_MODEL_NAME)  # no prompt: Ollama's way to load a model
    assert loads.done and loads.done_reason == "load" and loads.response == ""


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_and_its_result(client, stream):
    kwargs = dict(model=DEFAULT_MODEL_NAME, tools=[WEATHER_TOOL], options={"temperature": 0, "num_predict": 60})
    asked = _ask(TOKYO)
    if stream:
        parts = list(client.chat(messages=asked, stream=True, **kwargs))
        (called,) = [p.message for p in parts if p.message.tool_calls]
        assert parts[-1].done_reason == "stop"
    else:
        called = client.chat(messages=asked, **kwargs).message
    (call,) = called.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"location": "Tokyo", "unit": "celsius"}
    result = {"role": "tool", "tool_name": "get_weather", "content": json.dumps({"temperature": 21, "unit": "celsius"})}
    answer = client.chat(messages=[*asked, called, result], **kwargs)
    assert re.fullmatch(r"It is -?\d+ degrees in Tokyo\.", answer.message.content), answer.message


def test_tags_show_ps_and_version(client, demo_server):
    (listed,) = client.list().models
    assert listed.model == DEFAULT_MODEL_NAME and listed.size > 0 and listed.details.format == "mlx"
    shown = client.show(DEFAULT_MODEL_NAME)
    assert shown.capabilities == ["completion", "vision", "tools"] and shown.details.family == "gemma4"
    assert shown.modelinfo["gemma4.context_length"] > 0
    (running,) = client.ps().models
    assert running.model == DEFAULT_MODEL_NAME and running.size_vram >= listed.size
    assert running.context_length == shown.modelinfo["gemma4.context_length"]
    assert httpx.get(demo_server.url + "/api/version").json()["version"]
    assert client.show(DEFAULT_MODEL_NAME + ":latest").details.family == "gemma4"  # the default tag Ollama's names have


@pytest.mark.parametrize("kwargs, status, says", [
    ({"messages": _ask("hi", b"not an image")}, 400, "messages.0.images.0: not a PNG, JPEG, GIF or WebP image"),
    ({"messages": _ask("hi", b"\x89PNG\r\n\x1a\nbroken")}, 400, "image 1: not an image"),
    ({"messages": _ask("hi"), "options": {"mirostat": 2}}, 400, "options.mirostat: this server does not run it"),
    ({"messages": _ask("hi"), "options": {"typical_p": 0.5}}, 400, "options.typical_p"),
    ({"messages": _ask("hi"), "options": {"temprature": 0}}, 400, "options.temprature: not an option"),
    ({"messages": _ask("hi"), "model": "nope"}, 404, "model 'nope' does not exist"),
])  # fmt: skip
def test_refusals_are_ollama_errors(client, kwargs, status, says):
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(**{"model": DEFAULT_MODEL_NAME, **kwargs})
    assert raised.value.status_code == status and raised.value.error.startswith(says), raised.value.error


def test_a_raw_generate_is_refused_by_name(demo_server):
    said = httpx.post(demo_server.url + "/api/generate", json={"model": DEFAULT_MODEL_NAME, "prompt": "x", "raw": True})
    assert said.status_code == 400 and said.json()["error"].startswith("raw: not supported")


def test_the_api_key_guards_ollamas_paths_too():
    app = create_app(ServerState([], config=ServeConfig(api_key="s3cret")))

    async def ask(headers: dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await http.get("/api/tags", headers=headers)

    refused, allowed = asyncio.run(ask({})), asyncio.run(ask({"Authorization": "Bearer s3cret"}))
    assert refused.status_code == 401 and refused.json() == {"error": refused.json()["error"]}
    assert "API key" in refused.json()["error"] and allowed.json() == {"models": []}


# -- translation ----------------------------------------------------------------------------


@pytest.mark.parametrize("options, fields", [
    ({"temperature": 0, "num_predict": 12, "top_k": 5, "seed": 3, "stop": ["\n"]},
     {"temperature": 0, "max_tokens": 12, "top_k": 5, "seed": 3, "stop": ["\n"]}),
    ({"num_predict": -1, "seed": -1}, {}),  # no limit: the server's default; a random seed
    ({"repeat_penalty": 1.2, "repeat_last_n": PENALTY_WINDOW}, {"repetition_penalty": 1.2}),
    ({"num_ctx": 8192, "num_gpu": 99, "mirostat": 0, "tfs_z": 1.0, "mirostat_tau": 5.0}, {}),  # knobs: ignored
    ({"min_p": 0.1, "min_tokens": 2}, {"min_p": 0.1, "min_tokens": 2}),  # vLLM's extensions, as on chat
])  # fmt: skip
def test_options_become_sampling_fields(options, fields):
    assert sampling(options) == fields


@pytest.mark.parametrize("options, named", [
    ({"mirostat": 1}, "options.mirostat"), ({"tfs_z": 0.9}, "options.tfs_z"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 128}, "options.repeat_last_n"),
    ({"num_predict": 0}, "options.num_predict"),
    ({"use_beam_search": True}, "use_beam_search"), ({"nonsense": 1}, "options.nonsense"),
])  # fmt: skip
def test_options_that_would_change_the_output_are_refused_by_name(options, named):
    with pytest.raises(APIError) as raised:
        sampling(options)
    assert raised.value.status == 400 and raised.value.param == named


def test_the_penalty_window_is_the_samplers():
    from vlmserve.engine.sampler import PENALTY_CONTEXT

    assert PENALTY_WINDOW == PENALTY_CONTEXT


@pytest.mark.parametrize("head, kind", [
    (b"\x89PNG\r\n\x1a\n\0\0\0\0", "png"), (b"\xff\xd8\xff\xe0\0\0\0\0\0\0\0\0", "jpeg"),
    (b"GIF89a\0\0\0\0\0\0", "gif"), (b"RIFF\0\0\0\0WEBPVP8 ", "webp"),
])  # fmt: skip
def test_an_image_is_a_data_url_of_its_format(head, kind):
    image = base64.b64encode(head + b"rest").decode()
    assert data_url(image, "images.0") == f"data:image/{kind};base64,{image}"


def test_messages_become_the_chat_request():
    req = ChatRequest(model="m", think=False, format="json", messages=[
        {"role": "user", "content": TOKYO},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"location": "Tokyo"}}}]},
        {"role": "tool", "content": "21", "tool_name": "get_weather"}])
    chat = to_chat_request(req)
    call = chat.messages[1].tool_calls[0]
    assert json.loads(call.function.arguments) == {"location": "Tokyo"} and chat.messages[2].tool_call_id == call.id
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.response_format.type == "json_object"
    assert chat.stream is True  # Ollama streams unless told not to
    one = generate_request(GenerateRequest(model="m", prompt="hi", system="Be brief.", stream=False))
    assert [(m.role, m.content) for m in one.messages] == [("system", "Be brief."), ("user", "hi")]
    assert one.stream is False
