"""SIGTERM under load: stop admitting, let running streams finish within the grace period, end
the rest with an error event, exit 0. Each test owns its server (it is stopped)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_utils import start_server


def _stream(server, model: str, max_tokens: int, events: list, first: threading.Event) -> None:
    """Read one SSE stream to its end; ``events`` gets every data payload, then "closed" or the error."""
    body = {"model": model, "messages": [{"role": "user", "content": "tell me"}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    try:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if '"content":"' in line and '"content":""' not in line:
                        first.set()
        events.append("closed")
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")
    finally:
        first.set()


def _run_streams(server, model: str, max_tokens: int, n: int = 8):
    events = [[] for _ in range(n)]
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(server, model, max_tokens, events[i], started[i]))
               for i in range(n)]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120)
    return threads, events


def _sigterm_and_time_exit(server) -> tuple[int, float]:
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(60)
    return rc, time.monotonic() - start


def _finishes(events: list[str]) -> tuple[str | None, bool]:
    """The stream's finish_reason (or "error"), and whether it ended with [DONE] and a clean close."""
    finish = None
    for payload in events:
        if payload in ("[DONE]", "closed") or payload.startswith("transport"):
            continue
        data = json.loads(payload)
        if "error" in data:
            finish = "error"
        for choice in data.get("choices", []):
            finish = choice.get("finish_reason") or finish
    return finish, events[-2:] == ["[DONE]", "closed"]


def test_sigterm_ends_long_streams_with_an_error_event_after_the_grace_period(gemma4_micro, tmp_path):
    server = start_server(["--model", str(gemma4_micro), "--shutdown-timeout", "2"], tmp_path / "server.log")
    threads, events = _run_streams(server, gemma4_micro.name, 20000)
    rc, took = _sigterm_and_time_exit(server)
    for t in threads:
        t.join(30)
    print(f"SIGTERM with 8 live streams (grace 2 s): exited {rc} in {took:.2f} s")
    assert rc == 0
    assert 2 <= took < 30  # waited out the grace period, then did not hang
    for stream in events:
        finish, clean = _finishes(stream)
        assert finish == "error" and clean, stream[-3:]
        assert "shutting down" in "".join(stream)
    assert "draining 8 request(s)" in server.log and "ending 8 request(s) still running" in server.log


def test_sigterm_lets_short_streams_finish_and_refuses_new_requests(gemma4_micro, tmp_path):
    server = start_server(["--model", str(gemma4_micro), "--shutdown-timeout", "30"], tmp_path / "server.log")
    client = httpx.Client(base_url=server.url, timeout=30)  # a kept-alive connection, opened before the signal
    assert client.get("/health").status_code == 200
    threads, events = _run_streams(server, gemma4_micro.name, 600)
    rc_box: list = []
    waiter = threading.Thread(target=lambda: rc_box.append(_sigterm_and_time_exit(server)))
    waiter.start()
    time.sleep(0.3)
    late = client.post("/v1/chat/completions", json={"model": gemma4_micro.name, "messages": [
        {"role": "user", "content": "hi"}], "max_tokens": 2})
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert client.get("/ready").status_code == 503  # a gateway stops routing here at once
    waiter.join(60)
    for t in threads:
        t.join(30)
    rc, took = rc_box[0]
    print(f"SIGTERM with 8 600-token streams (grace 30 s): exited {rc} in {took:.2f} s")
    assert rc == 0 and took < 30  # it left as soon as the streams were done, not at the deadline
    for stream in events:
        assert _finishes(stream) == ("length", True), stream[-3:]


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once(gemma4_micro, tmp_path, second):
    server = start_server(["--model", str(gemma4_micro), "--shutdown-timeout", "60"], tmp_path / "server.log")
    threads, events = _run_streams(server, gemma4_micro.name, 20000, n=2)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    rc, took = _sigterm_and_time_exit(server) if second == signal.SIGTERM else (None, 0)
    if second == signal.SIGINT:
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        rc, took = server.proc.wait(60), time.monotonic() - start
    for t in threads:
        t.join(30)
    assert rc == 0 and took < 30
    assert all(_finishes(stream)[0] == "error" for stream in events)
    assert "Traceback" not in server.log and "CancelledError" not in server.log  # the stop asked for, not a crash


def test_every_request_the_drain_ends_gets_503_shutting_down(gemma4_micro, tmp_path):
    """Queued and running, streamed and not: each request the drain ends says ``shutting_down`` (a 503,
    or an error event with that code and then [DONE] once a stream has begun), never a 500 engine_error."""
    server = start_server(["--model", str(gemma4_micro), "--shutdown-timeout", "1", "--max-batch-size", "2"],
                          tmp_path / "server.log")
    body = {"model": gemma4_micro.name, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 20000,
            "ignore_eos": True}
    streams: dict[int, tuple[int, list[str]]] = {}
    plain: dict[int, httpx.Response] = {}
    running = [threading.Event() for _ in range(2)]

    def stream(i: int) -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if i < 2 and '"content":"' in line and '"content":""' not in line:
                    running[i].set()
            streams[i] = (r.status_code, lines)

    def post(i: int) -> None:
        plain[i] = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)

    first = [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # the batch's 2 slots
    for t in first:
        t.start()
    assert all(e.wait(120) for e in running)
    queued = [threading.Thread(target=stream, args=(i,)) for i in (2, 3)] + [threading.Thread(target=post, args=(i,))
                                                                           for i in (0, 1)]
    for t in queued:
        t.start()
    time.sleep(0.5)  # they wait for a slot
    rc, _ = _sigterm_and_time_exit(server)
    for t in first + queued:
        t.join(30)
    assert rc == 0
    for i in (0, 1):  # running streams: an error event with the code, then [DONE]
        status, lines = streams[i]
        data = [line[6:] for line in lines if line.startswith("data: ")]
        assert status == 200 and data[-1] == "[DONE]", data[-2:]
        assert json.loads(data[-2])["error"]["code"] == "shutting_down"
    for i in (2, 3):  # queued streams: nothing was sent yet, so a status
        status, lines = streams[i]
        assert status == 503 and json.loads("".join(lines))["error"]["code"] == "shutting_down"
    for response in plain.values():
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
    assert "engine_error" not in server.log


def test_two_quick_ctrl_cs_exit_without_a_traceback(gemma4_micro, tmp_path):
    """Ctrl-C, then Ctrl-C again while a stream drains: uvicorn logged its cancelled lifespan task
    as a traceback; that is the stop the user asked for."""
    server = start_server(["--model", str(gemma4_micro)], tmp_path / "server.log")
    threads, _ = _run_streams(server, gemma4_micro.name, 2000, n=1)
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(60) in (0, 1, -signal.SIGINT)
    for t in threads:
        t.join(30)
    assert "Traceback" not in server.log and "CancelledError" not in server.log, server.log[-2000:]
