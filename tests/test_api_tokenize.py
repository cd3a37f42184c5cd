"""/tokenize, /detokenize and /version in vLLM's shape, and chat_template_kwargs (issue 32), against one
real ``vlmserve serve`` of the micro Gemma 4 and Qwen3.5, with the official openai client for chats.

The server starts with ``--default-chat-template-kwargs '{"enable_thinking": false}'``; requests
turn thinking back on with their own ``chat_template_kwargs``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import scene
from server_utils import ServerProcess, image_data_url, start_server

from vlmserve import __version__
from vlmserve.testing import build_model

THINK_ON = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def qwen3_5_micro():
    return build_model("qwen3_5", "micro")


@pytest.fixture(scope="module")
def server(gemma4_micro, qwen3_5_micro, tmp_path_factory) -> Iterator[ServerProcess]:
    args = ["--model", str(gemma4_micro), "--model", str(qwen3_5_micro),
            "--default-chat-template-kwargs", json.dumps({"enable_thinking": False})]
    proc = start_server(args, tmp_path_factory.mktemp("tokenize") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_a_prompt_tokenizes_and_detokenizes_back(server, gemma4_micro):
    text = "Hello there, how are the shapes today?"
    plain = _post(server, "/tokenize", {"model": gemma4_micro.name, "prompt": text, "add_special_tokens": False})
    special = _post(server, "/tokenize", {"model": gemma4_micro.name, "prompt": text, "return_token_strs": True})
    assert plain.status_code == special.status_code == 200
    body, with_bos = plain.json(), special.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > body["count"]
    assert body["token_strs"] is None and len(with_bos["token_strs"]) == with_bos["count"]
    added = with_bos["count"] - body["count"]  # what the tokenizer adds itself (a BOS, or nothing)
    assert added >= 0 and with_bos["tokens"][added:] == body["tokens"]
    back = _post(server, "/detokenize", {"model": gemma4_micro.name, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize("with_image", [False, True])
def test_chat_messages_count_what_a_chat_request_costs(server, client, gemma4_micro, with_image):
    content: list[dict] = [{"type": "text", "text": "What is in the picture?"}]
    if with_image:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_data_url(scene("circle", (200, 30, 30)))}})
    messages = [{"role": "user", "content": content}]
    counted = _post(server, "/tokenize", {"model": gemma4_micro.name, "messages": messages})
    assert counted.status_code == 200, counted.text
    reply = client.chat.completions.create(model=gemma4_micro.name, messages=messages, max_tokens=1)
    assert counted.json()["count"] == reply.usage.prompt_tokens


def test_tokenizer_refusals_are_openai_shaped_400s(server, gemma4_micro):
    cases = [("/detokenize", {"model": gemma4_micro.name, "tokens": [5, 10**9]}, "tokens"),
             ("/tokenize", {"model": gemma4_micro.name, "prompt": "a", "messages": [{"role": "user", "content": "a"}]},
              None),
             ("/tokenize", {"model": gemma4_micro.name, "prompt": "a", "truncate_prompt_tokens": 3}, None),
             ("/tokenize", {"model": gemma4_micro.name, "messages": [{"role": "user", "content": "a"}],
                            "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs")]
    for path, body, param in cases:
        reply = _post(server, path, body)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if param:
            assert error["param"] == param
    assert _post(server, "/tokenize", {"model": "nope", "prompt": "a"}).status_code == 404


def test_version(server):
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def _prompt_text(server, model: str, extra: dict) -> str:
    messages = [{"role": "user", "content": "hi"}]
    ids = _post(server, "/tokenize", {"model": model, "messages": messages, **extra}).json()["tokens"]
    return _post(server, "/detokenize", {"model": model, "tokens": ids}).json()["prompt"]


def test_enable_thinking_false_closes_qwen3_5s_reasoning(server, client, qwen3_5_micro):
    """The server's default turns thinking off: the prompt ends after an empty think block and the
    whole reply is content. A request's own chat_template_kwargs turn it back on: the prompt ends
    inside <think> and the reply (the micro model never closes it) is all reasoning."""
    model = qwen3_5_micro.name
    assert _prompt_text(server, model, {}).rstrip().endswith("</think>")
    assert _prompt_text(server, model, THINK_ON).rstrip().endswith("<think>")
    ask = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    off = client.chat.completions.create(**ask).choices[0].message
    on = client.chat.completions.create(**{**ask, "extra_body": {"ignore_eos": True, **THINK_ON}}).choices[0].message
    assert off.content and not (off.model_extra or {}).get("reasoning_content")
    assert (on.model_extra or {}).get("reasoning_content") and not on.content
    chunks = list(client.chat.completions.create(stream=True, **{**ask, "extra_body": {"ignore_eos": True, **THINK_ON}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == on.model_extra["reasoning_content"]
    responses = client.responses.create(model=model, input="hi", max_output_tokens=8,
                                        extra_body={"ignore_eos": True, **THINK_ON})
    assert any(item.type == "reasoning" for item in responses.output)


def test_mm_processor_kwargs_lower_qwens_pixel_budget_per_request(server, client, qwen3_5_micro, gemma4_micro):
    """vLLM's mm_processor_kwargs: max_pixels under the model's own gives fewer image tokens, and
    /tokenize counts the same; over it, or on a processor without a pixel budget, a 400."""
    picture = {"type": "image_url", "image_url": {"url": image_data_url(scene("circle", (200, 30, 30), size=200))}}
    messages = [{"role": "user", "content": [picture, {"type": "text", "text": "what?"}]}]
    ask = {"model": qwen3_5_micro.name, "messages": messages, "max_tokens": 1}
    full = client.chat.completions.create(**ask).usage.prompt_tokens
    small = client.chat.completions.create(**ask, extra_body={"mm_processor_kwargs": {"max_pixels": 1024}})
    assert small.usage.prompt_tokens < full
    counted = _post(server, "/tokenize", {"model": qwen3_5_micro.name, "messages": messages,
                                          "mm_processor_kwargs": {"max_pixels": 1024}}).json()["count"]
    assert counted == small.usage.prompt_tokens
    for model, kwargs in ((qwen3_5_micro.name, {"max_pixels": 10**9}), (qwen3_5_micro.name, {"do_resize": 0}),
                          (gemma4_micro.name, {"max_pixels": 1024})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**{**ask, "model": model}, extra_body={"mm_processor_kwargs": kwargs})
        assert refused.value.body["param"] == "mm_processor_kwargs"
