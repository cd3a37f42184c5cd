"""Every endpoint records each request once on /metrics (api/timing.py): chat completions, completions,
Responses and Messages, streamed and not, through the clients people use, against a real server."""

from __future__ import annotations

import re
import time

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


def _memory(url: str) -> dict[str, dict[str, float]]:
    """/metrics' memory by owner: {series: {owner (or "" for the process's): value}}, one model's."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for name, owner, value in re.findall(r'^(vlmserve_memory_\w+)\{model="[^"]+",owner="(\w+)"\} (\S+)$', text, re.M):
        out.setdefault(name, {})[owner] = float(value)
    for name, value in re.findall(r"^(vlmserve_mlx_\w+|process_resident_memory_bytes|vlmserve_prefix_cache_disk_\w+)"
                                  r"(?:\{[^}]*\})? (\S+)$", text, re.M):
        out.setdefault(name, {})[""] = float(value)
    return out


def _pinned(url: str) -> float:
    found = re.search(r"^vlmserve_prefix_cache_pinned_entries\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    assert found
    return float(found.group(1))


def test_memory_by_owner_moves_as_caches_fill_and_never_passes_a_cap(gemma4_micro, tmp_path) -> None:
    """Small caps (a few prompts' KV, a few images' features), then more distinct prompts and images than they
    hold: every owner is on /metrics, every cache beside its cap, the caches fill and evict and never pass
    their caps. An idle server's gauges are current."""
    from PIL import Image
    from server_utils import image_data_url, start_server

    server = start_server(["--model", str(gemma4_micro), "--prefix-cache-gb", "0.0004", "--vision-cache-mb", "0.02",
                           "--prefix-cache-dir", str(tmp_path / "disk")], tmp_path / "server.log")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    capped = ("kv_reserved", "vision_cache", "prefix_cache", "disk_pending_writes")
    seen: dict[str, float] = {}
    try:
        for i in range(8):
            image = Image.new("RGB", (64 + 16 * i, 64), (30 * i, 90, 0))
            for content in (f"tell me story number {i} " * 5,
                            [{"type": "image_url", "image_url": {"url": image_data_url(image)}}, "what is it?"]):
                if isinstance(content, list):
                    content = [content[0], {"type": "text", "text": content[1]}]
                client.chat.completions.create(model=gemma4_micro.name, max_tokens=2,
                                               messages=[{"role": "user", "content": content}])
                memory = _memory(server.url)
                held, caps = memory["vlmserve_memory_bytes"], memory["vlmserve_memory_limit_bytes"]
                assert set(capped) <= set(caps) and set(caps) <= set(held), memory
                assert all(held[o] <= caps[o] for o in capped), memory
                assert memory["vlmserve_memory_uncapped"] == dict.fromkeys(capped, 0.0)
                seen = {o: max(seen.get(o, 0.0), held[o]) for o in held}
        assert seen["weights"] > 0 and seen["prefix_cache"] > 0 and seen["vision_cache"] > 0, seen
        assert memory["vlmserve_mlx_active_bytes"][""] > 0 and memory["process_resident_memory_bytes"][""] > 0
        evictions = re.search(r"^vlmserve_vision_cache_evictions_total\{[^}]*\} (\S+)$",
                              httpx.get(f"{server.url}/metrics").text, re.M)
        assert evictions and float(evictions.group(1)) > 0  # the vision cache filled to its cap
        # a prompt pinned for 1 s: once the pin ends, an idle server's scrape says so (the idle worker publishes
        # nothing, so the scrape reads its counters on the worker)
        client.chat.completions.create(model=gemma4_micro.name, max_tokens=2, extra_body={"cache_ttl": 1.0},
                                       messages=[{"role": "user", "content": "a pinned prompt " * 5}])
        assert _pinned(server.url) == 1
        time.sleep(1.5)
        assert _pinned(server.url) == 0
    finally:
        server.stop()
