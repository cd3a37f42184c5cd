"""Operating the server: a client that stops reading, the KV budget, logs, metrics, auth and CORS.

Each runs a real ``vlmserve serve`` on the micro Gemma 4 and real clients (raw sockets, httpx,
the openai SDK).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_utils import start_server

KEY = "sekret-key"
LONG = {"max_tokens": 500, "extra_body": {"ignore_eos": True}}


def _metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    pattern = "^" + re.escape(name) + (r"\{[^}]*" + re.escape(labels) + r"[^}]*\}" if labels else r"(\{[^}]*\})?")
    values = [float(m.group("value")) for m in re.finditer(pattern + r" (?P<value>\S+)$", text, re.M)]
    assert values, f"{name}{{{labels}}} not in /metrics"
    return sum(values)


@pytest.fixture(scope="module")
def ops_server(gemma4_micro, tmp_path_factory):
    """The API key from the environment, CORS for one origin, a 1 s stall timeout."""
    log = tmp_path_factory.mktemp("ops") / "server.log"
    args = ["--model", str(gemma4_micro), "--stream-stall-timeout", "1", "--cors-origin", "http://app.example"]
    server = start_server(args, log, env={"VLMSERVE_API_KEY": KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def budget_server(gemma4_micro, tmp_path_factory):
    """A KV budget of 629 KB: the micro Gemma 4 costs 512 B per position up to its 512-position
    window, then 256 B, so two requests of ~510 positions fit together and a third waits."""
    log = tmp_path_factory.mktemp("budget") / "server.log"
    server = start_server(["--model", str(gemma4_micro), "--kv-cache-gb", "0.0006"], log)
    yield server
    server.stop()


def _post(server, body, key: str | None = KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60, **kwargs)


def _client(server, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_a_client_that_stops_reading_loses_its_slot_and_others_keep_going(ops_server, gemma4_micro):
    body = json.dumps({"model": gemma4_micro.name, "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "max_tokens": 20000, "ignore_eos": True}).encode()
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block soon
    stuck.connect(("127.0.0.1", ops_server.port))
    stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
    start = time.monotonic()

    async def meanwhile():
        client = _client(ops_server)
        tokens = 0
        async for chunk in await client.chat.completions.create(
                model=gemma4_micro.name, messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True}, **LONG):
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return tokens

    try:
        assert asyncio.run(meanwhile()) == 500  # the other stream keeps its pace and finishes
        while _metric(ops_server, "vlmserve_stalled_requests_total") < 1:
            assert time.monotonic() - start < 120, "the stuck request was never aborted"
            time.sleep(0.1)
        released = time.monotonic() - start
        assert _metric(ops_server, "vlmserve_running_requests") == 0
        assert _metric(ops_server, "vlmserve_requests_in_flight") == 0
        print(f"stuck client: slot released {released:.1f} s after it sent its request (stall timeout 1 s)")
        assert "read nothing for" in ops_server.log
    finally:
        stuck.close()


def test_a_client_that_stops_reading_after_the_last_token_is_released_too(ops_server, gemma4_micro):
    """Issue 31: the stall check ran only when a token arrived, so a request whose engine work was done
    (its last token waiting on a full socket) stayed in flight forever. It is checked on a timer now."""
    body = json.dumps({"model": gemma4_micro.name, "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "max_tokens": 150, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
    stalled = _metric(ops_server, "vlmserve_stalled_requests_total")
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", ops_server.port))
    stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
    try:
        start = time.monotonic()
        while _metric(ops_server, "vlmserve_requests_in_flight") < 1:  # admitted
            assert time.monotonic() - start < 60
            time.sleep(0.02)
        while _metric(ops_server, "vlmserve_running_requests") > 0:  # the engine is done with it: 150 tokens
            assert time.monotonic() - start < 60
            time.sleep(0.02)
        while _metric(ops_server, "vlmserve_requests_in_flight") > 0:  # ~250 KB of chunks wait on a full socket
            assert time.monotonic() - start < 30, "a client that reads nothing keeps its place in flight"
            time.sleep(0.1)
        assert _metric(ops_server, "vlmserve_stalled_requests_total") == stalled + 1
        assert "stalled: its client read nothing" in ops_server.log
    finally:
        stuck.close()


def test_the_api_key_comes_from_the_environment(ops_server, gemma4_micro):
    body = {"model": gemma4_micro.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(ops_server, body, key=None).status_code == 401
    assert _post(ops_server, body, key=KEY + "x").status_code == 401
    assert _post(ops_server, body).status_code == 200


def test_anthropic_clients_send_the_key_as_x_api_key(ops_server, gemma4_micro):
    """The anthropic SDK sends ``x-api-key``; a wrong one is its own AuthenticationError, in Anthropic's shape."""
    # greedy: sampled at the API's default temperature, the random micro model's first token was
    # once its end of turn (CI: 0 output tokens, stop_reason end_turn)
    message = dict(model=gemma4_micro.name, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                   extra_body={"temperature": 0})
    keyed = anthropic.Anthropic(base_url=ops_server.url, api_key=KEY, max_retries=0, timeout=60)
    assert keyed.messages.create(**message).usage.output_tokens == 2
    wrong = anthropic.Anthropic(base_url=ops_server.url, api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**message)
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in refused.value.body["error"]["message"]
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "x-api-key,anthropic-version,content-type"}
    assert httpx.options(ops_server.url + "/v1/messages", headers=preflight).status_code == 200


def test_cors_answers_the_named_origin_only(ops_server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(ops_server.url + "/v1/chat/completions", headers={"Origin": "http://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(ops_server.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    get = httpx.get(ops_server.url + "/health", headers={"Origin": "http://app.example"})
    assert get.headers["access-control-allow-origin"] == "http://app.example"


def test_cors_is_off_by_default(server):
    r = httpx.get(server.url + "/health", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_metrics_carry_vllm_names_latency_histograms_and_rejections(ops_server, gemma4_micro):
    name = str(gemma4_micro)  # the name it is served under (the directory also answers to its base name)
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    before = _metric(ops_server, "vllm:generation_tokens_total", f'model_name="{name}"')
    with httpx.stream("POST", ops_server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.read()
    assert _metric(ops_server, "vllm:generation_tokens_total", f'model_name="{name}"') >= before + 1
    for metric in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                   "vllm:prompt_tokens_total", "vllm:inter_token_latency_seconds_count"):
        assert _metric(ops_server, metric, f'model_name="{name}"') >= 1, metric
    for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert _metric(ops_server, metric, f'model_name="{name}"') >= 0
    assert _metric(ops_server, "vlmserve_step_duration_seconds_count", f'model="{name}"') >= 8
    assert _metric(ops_server, "vlmserve_kv_cache_budget_bytes", f'model="{name}"') > 0
    rejected = _post(ops_server, {"model": name, "messages": [{"role": "user", "content": "hi"}], "seed": -1})
    assert rejected.status_code == 400
    assert _metric(ops_server, "vlmserve_rejected_requests_total", 'code="invalid_value",status="400"') >= 1
    assert _post(ops_server, {"model": name}, key="wrong").status_code == 401
    assert _metric(ops_server, "vlmserve_rejected_requests_total", 'code="invalid_api_key",status="401"') >= 1
    hits = _metric(ops_server, "vlmserve_prefix_cache_hits_total", f'model="{name}"')
    assert hits >= 0


def test_serve_logs_its_address_load_and_a_line_per_request(ops_server, gemma4_micro):
    _post(ops_server, {"model": gemma4_micro.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    _post(ops_server, {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    log = ops_server.log
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    url = f"http://127.0.0.1:{ops_server.port}"
    loading = re.search(stamp + rf"vlmserve.server: vlmserve \S+ loading .*; it will serve on {url} once ready$", log, re.M)
    serving = re.search(stamp + rf"vlmserve.server: vlmserve \S+ serving .* on {url} \(the playground: {url}/; an API "
                                r"key is required\)$", log, re.M)
    assert loading and serving and loading.start() < log.index("loaded in") < serving.start(), log
    assert re.search(stamp + r".*loaded in [\d.]+ s, warmed up in [\d.]+ s", log, re.M), log
    assert re.search(stamp + r"vlmserve.requests: chatcmpl-\w+ model=.* prompt=\d+ completion=2 ttft=[\d.]+s "
                             r"total=[\d.]+s finish=length$", log, re.M), log
    assert re.search(stamp + r"vlmserve.requests: rejected POST /v1/chat/completions status=404 code=model_not_found",
                     log, re.M), log
    assert re.search(stamp + r"uvicorn", log, re.M), "uvicorn's own lines carry timestamps too"


def test_a_request_that_could_never_fit_the_kv_budget_is_400(budget_server, gemma4_micro):
    body = {"model": gemma4_micro.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30000}
    r = _post(budget_server, body, key=None)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "kv_budget_exceeded" and error["param"] == "max_tokens" and "KV budget" in error["message"]
    assert _post(budget_server, {**body, "max_tokens": 3}, key=None).status_code == 200


def test_eight_long_requests_together_wait_their_turn_within_the_kv_budget(budget_server, gemma4_micro):
    budget = _metric(budget_server, "vlmserve_kv_cache_budget_bytes")
    assert budget == int(0.0006 * 2**30)

    async def scenario():
        client = _client(budget_server, "unused")

        async def one(i):
            r = await client.chat.completions.create(model=gemma4_micro.name, max_tokens=500,
                                                     messages=[{"role": "user", "content": f"story {i}"}],
                                                     extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        running, reserved = [], []
        async with httpx.AsyncClient() as http:
            while not all(t.done() for t in tasks):
                text = (await http.get(budget_server.url + "/metrics")).text
                running.append(float(re.search(r"^vlmserve_running_requests\{.*\} (\S+)", text, re.M).group(1)))
                reserved.append(float(re.search(r"^vlmserve_kv_cache_reserved_bytes\{.*\} (\S+)", text, re.M).group(1)))
                await asyncio.sleep(0.05)
        return [t.result() for t in tasks], running, reserved

    tokens, running, reserved = asyncio.run(scenario())
    assert tokens == [500] * 8  # every request completes: none crashed, none was refused
    assert max(running) == 2 and max(reserved) <= budget, (max(running), max(reserved))
    print(f"KV budget {budget / 1024:.0f} KiB: at most {max(running):.0f} running, peak reserved "
          f"{max(reserved) / 1024:.0f} KiB, over {len(running)} scrapes")


def test_accepted_connections_inherit_no_delay_and_a_small_send_buffer():
    """What the listening socket passes on (measured: without TCP_NODELAY, 45 ms more per keep-alive
    request; without the small buffer, a stuck client held its slot for a minute)."""
    import socket as sockets

    import uvicorn
    from server_utils import free_port

    from vlmserve.server import SEND_BUFFER, listening_socket

    listener = listening_socket(uvicorn.Config(app=None, host="127.0.0.1", port=free_port()))
    try:
        listener.listen()
        client = sockets.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        assert accepted.getsockopt(sockets.IPPROTO_TCP, sockets.TCP_NODELAY) != 0
        assert accepted.getsockopt(sockets.SOL_SOCKET, sockets.SO_SNDBUF) <= 2 * SEND_BUFFER  # Linux doubles it
        accepted.close()
        client.close()
    finally:
        listener.close()


def test_connections_that_send_their_headers_slowly_are_closed(gemma4_micro, tmp_path):
    """Slowloris (issue 31): 20 connections sending a request's headers a byte at a time are closed
    at the header deadline, while a normal request is served."""
    server = start_server(["--model", str(gemma4_micro), "--header-timeout", "1"], tmp_path / "server.log")
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
    try:
        start = time.monotonic()
        closed: set[int] = set()
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for i in range(len(request)):
            for n, sock in enumerate(slow):
                if n in closed:
                    continue
                try:
                    sock.sendall(request[i:i + 1])
                    sock.setblocking(False)
                    if sock.recv(1) == b"":
                        closed.add(n)
                except BlockingIOError:
                    pass  # open, and nothing to read
                except OSError:
                    closed.add(n)
                finally:
                    sock.setblocking(True)
            if len(closed) == len(slow) or time.monotonic() - start > 10:
                break
            time.sleep(0.1)
        assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow-header connections still open"
        assert time.monotonic() - start < 10
        ok = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": gemma4_micro.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        for sock in slow:
            sock.close()
        server.stop()


def test_health_is_answered_throughout_a_flood_of_300_requests(gemma4_micro, tmp_path):
    """Issue 31, item 7: 300 streamed requests at once, all admitted (--max-queue 300), while /health
    is polled from another connection. Every probe is answered, all through the flood. (The server
    answers a plain probe in the callback that reads it, starts the arrivals two per pass of its loop
    (api/intake.py), and hands a step's outputs to their streams 32 per pass (frontend/async_engine.py).
    The probe runs on a thread of its own: on the 300 streams' client loop it timed that client, whose
    256 concurrent streams (the batch is bounded by memory now, not 8) held its first probe for 3.8 s.
    From a process of its own, benchmarks/flood_bench.py times the server; its README has the numbers.)"""
    server = start_server(["--model", str(gemma4_micro), "--max-queue", "300"], tmp_path / "server.log")
    try:
        async def flood() -> tuple[list[int], list[float]]:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=320), timeout=300) as client:
                async def one(i: int) -> int:
                    body = {"model": gemma4_micro.name, "max_tokens": 24, "stream": True,
                            "messages": [{"role": "user", "content": f"story {i}"}]}
                    async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as reply:
                        async for _ in reply.aiter_bytes():
                            pass
                        return reply.status_code

                def probe(done: threading.Event) -> list[float]:
                    latencies = []
                    with httpx.Client() as health:
                        while not done.is_set():
                            start = time.perf_counter()
                            assert health.get(server.url + "/health").json() == {"status": "ok"}
                            latencies.append(time.perf_counter() - start)
                            time.sleep(0.05)
                    return latencies

                start, done = time.perf_counter(), threading.Event()
                probing = asyncio.get_running_loop().run_in_executor(None, probe, done)
                try:
                    statuses = await asyncio.gather(*(one(i) for i in range(300)))
                finally:
                    done.set()
                return statuses, await probing, time.perf_counter() - start

        statuses, latencies, seconds = asyncio.run(flood())
        assert statuses == [200] * 300
        assert len(latencies) >= 5
        print(f"/health under a flood of 300: {len(latencies)} probes over {seconds:.1f} s, "
              f"max {max(latencies) * 1000:.1f} ms")
        # never waits for the flood: a probe held until the flood ends would not fit (on its own thread the worst
        # probe here took tens of ms; the flood, 7-20 s)
        assert max(latencies) < seconds / 4
    finally:
        server.stop()


def test_the_tokenizer_endpoints_need_the_key_and_version_does_not(ops_server, gemma4_micro):
    body = {"model": gemma4_micro.name, "prompt": "hi"}
    assert httpx.post(ops_server.url + "/tokenize", json=body, timeout=10).status_code == 401
    keyed = httpx.post(ops_server.url + "/tokenize", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert keyed.status_code == 200 and keyed.json()["count"] > 0
    assert httpx.post(ops_server.url + "/detokenize", json={"tokens": [1]}, timeout=10).status_code == 401
    assert httpx.get(ops_server.url + "/version", timeout=10).status_code == 200
