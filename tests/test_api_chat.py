"""The chat completions API through a real server and the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import scene
from server_utils import image_data_url


def _user(text, *images):
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_lists_the_served_model(client, model_name, gemma4_micro):
    ids = [m.id for m in client.models.list().data]
    assert ids == [str(gemma4_micro)]
    assert client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], **GREEDY)


def test_text_chat_non_streaming(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hello"}], **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.created > 0
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streaming_gives_the_same_text_as_non_streaming(client, model_name):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_images_condition_the_answer_and_count_as_prompt_tokens(client, model_name):
    red, green = scene("circle", (220, 30, 30)), scene("triangle", (30, 170, 60))
    text_only = client.chat.completions.create(model=model_name, messages=_user("what is this?"), **GREEDY)
    with_red = client.chat.completions.create(model=model_name, messages=_user("what is this?", red), **GREEDY)
    with_green = client.chat.completions.create(model=model_name, messages=_user("what is this?", green), **GREEDY)
    two = client.chat.completions.create(model=model_name, messages=_user("compare", red, green), **GREEDY)
    assert with_red.usage.prompt_tokens > text_only.usage.prompt_tokens + 10  # image tokens included
    assert with_red.usage.prompt_tokens == with_green.usage.prompt_tokens
    assert with_red.choices[0].message.content != with_green.choices[0].message.content
    assert two.usage.prompt_tokens > with_red.usage.prompt_tokens


def test_images_anywhere_in_a_multi_turn_conversation(client, model_name):
    red, green = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220))
    messages = [
        {"role": "system", "content": "You describe images."},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "image_url", "image_url": {"url": image_data_url(red), "detail": "low"}}]},
        {"role": "assistant", "content": "A red circle."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(green, "JPEG")}}, {"type": "text", "text": "and this?"}]},
    ]
    r = client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    assert r.choices[0].message.content and r.usage.completion_tokens == 12


def test_local_files_only_below_allowed_dirs(client, model_name, media_dir, tmp_path):
    ok = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{media_dir / 'red.png'}"}}]}]
    assert client.chat.completions.create(model=model_name, messages=ok, **GREEDY).choices[0].message.content
    outside = tmp_path / "secret.png"
    scene("circle", (1, 2, 3)).save(outside)
    for url, why in ((str(outside), "outside the allowed media directories"),
                     (f"file://{media_dir}/../{outside.parent.name}/secret.png", "outside the allowed media directories"),
                     ("https://example.com/a.png", "image 1: ")):  # remote: allowed here, and no network
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], **GREEDY)
        assert why in info.value.message, url


def test_stop_strings(client, model_name):
    ref = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hello"}], **GREEDY)
    text = ref.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hello"}], stop=[stop], **GREEDY)
    assert r.choices[0].message.content == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, model_name):
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": "hello"}], temperature=1.0, seed=5,
                  max_tokens=16, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a, b = (client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2))
    assert a == b


def test_logit_bias_forces_a_token_through_the_sdk(client, model_name):
    plain = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hello"}], **GREEDY)
    forced = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hello"}],
                                            logit_bias={"42": 100}, logprobs=True, **GREEDY)
    tokens = {entry.token for entry in forced.choices[0].logprobs.content}
    assert len(tokens) == 1 and forced.choices[0].message.content == tokens.pop() * 12
    assert forced.choices[0].message.content != plain.choices[0].message.content


def test_tools_reach_the_chat_template(client, model_name, server):
    # The prompt grows by the rendered declaration; the exact rendering is covered by the template tests.
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
    messages = [{"role": "user", "content": "weather in Tokyo?"}]
    plain = client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    with_tools = client.chat.completions.create(model=model_name, messages=messages, tools=tools, **GREEDY)
    none = client.chat.completions.create(model=model_name, messages=messages, tools=tools, tool_choice="none", **GREEDY)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_json_response_format_by_prompt(client, model_name):
    messages = [{"role": "user", "content": "hello"}]
    plain = client.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    json_mode = client.chat.completions.create(model=model_name, messages=messages, response_format={"type": "json_object"}, **GREEDY)
    assert json_mode.usage.prompt_tokens > plain.usage.prompt_tokens


def test_health_ready_and_metrics(server, client, model_name):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], **GREEDY)
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("vlmserve_requests_total", "vlmserve_time_to_first_token_seconds_bucket",
                 "vlmserve_request_latency_seconds_bucket", "vlmserve_prompt_tokens_total",
                 "vlmserve_completion_tokens_total", "vlmserve_queue_depth", "vlmserve_batch_size",
                 "vlmserve_step_seconds", "vlmserve_running_requests"):
        assert name in metrics, name


def test_min_tokens_holds_the_end_back_and_what_it_cannot_do_is_a_400(server, client, model_name):
    """vLLM's ``min_tokens`` through the openai client: a +100 bias on the end of turn ends the answer at once,
    and with ``min_tokens`` 7 after exactly 7 tokens. Over ``max_tokens``, or beside a grammar that must be
    free to end, it is a 400 naming the field."""
    messages = [{"role": "user", "content": "hello"}]
    end = httpx.post(server.url + "/tokenize", json={"model": model_name, "prompt": "<turn|>",
                                                     "add_special_tokens": False}, timeout=30)
    (turn_end,) = end.json()["tokens"]
    forced = dict(temperature=0, max_tokens=20, logit_bias={str(turn_end): 100})
    at_once = client.chat.completions.create(model=model_name, messages=messages, **forced)
    held = client.chat.completions.create(model=model_name, messages=messages, **forced, extra_body={"min_tokens": 7})
    assert at_once.usage.completion_tokens == 0 and at_once.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 7 and held.choices[0].finish_reason == "stop"
    for extra in ({"min_tokens": 21}, {"min_tokens": 3, "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model_name, messages=messages, **forced, extra_body=extra)
        assert refused.value.body["param"] == "min_tokens" or "min_tokens" in refused.value.message
