"""Every endpoint records each request once on /metrics (api/timing.py): chat completions, completions,
Responses and Messages, streamed and not, through the clients people use, against a real server."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

COUNTS = ("vlmserve_requests_total", "vlmserve_request_latency_seconds_count",
          "vlmserve_time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
          "vllm:time_to_first_token_seconds_count")


def counts(url: str, model: str) -> dict[str, float]:
    """Each series of ``COUNTS`` for ``model``, summed over its other labels (a request's status)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = dict.fromkeys(COUNTS, 0.0)
    for name in COUNTS:
        label = "model_name" if name.startswith("vllm:") else "model"
        for value in re.findall(rf'^{re.escape(name)}\{{[^}}]*{label}="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M):
            found[name] += float(value)
    return found


# Sampled at the default temperature, a first token may be EOS: then no token ever came and there is no time to
# first token to count (it failed so, once in a full run). One token at least, vLLM's min_tokens, on every API.
AT_LEAST_ONE = {"min_tokens": 1}


def _chat(client: openai.OpenAI, model: str, stream: bool) -> None:
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=4, stream=stream, extra_body=AT_LEAST_ONE)
    if stream:
        assert list(answer)


def _completion(client: openai.OpenAI, model: str, stream: bool) -> None:
    answer = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, stream=stream,
                                       extra_body=AT_LEAST_ONE)
    if stream:
        assert list(answer)


def _response(client: openai.OpenAI, model: str, stream: bool) -> None:
    if stream:
        with client.responses.stream(model=model, input="Hello!", max_output_tokens=4, extra_body=AT_LEAST_ONE) as events:
            assert list(events)
    else:
        client.responses.create(model=model, input="Hello!", max_output_tokens=4, extra_body=AT_LEAST_ONE)


def _message(url: str, model: str, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello!"}]
    if stream:
        with client.messages.stream(model=model, max_tokens=4, messages=messages, extra_body=AT_LEAST_ONE) as events:
            assert list(events)
    else:
        client.messages.create(model=model, max_tokens=4, messages=messages, extra_body=AT_LEAST_ONE)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses", "messages"])
def test_each_request_is_counted_once(server, model_name, endpoint: str, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    listed = client.models.list().data[0].id  # the metrics' label: the name it is listed by (not an alias)
    before = counts(server.url, listed)
    if endpoint == "messages":
        _message(server.url, model_name, stream)
    else:
        {"chat": _chat, "completions": _completion, "responses": _response}[endpoint](client, model_name, stream)
    after = counts(server.url, listed)
    assert {k: after[k] - before[k] for k in COUNTS} == dict.fromkeys(COUNTS, 1.0)
