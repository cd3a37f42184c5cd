"""Refusals that will pass say when to come back: a 429 (queue full) and a 503 while a model loads
carry Retry-After, on a real server over real sockets. A 503 that will not pass (shutting down) does not."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_utils import start_server

from vlmserve.testing import build_model


def test_a_full_queue_answers_429_with_retry_after_from_the_requests_it_served(gemma4_micro, tmp_path):
    server = start_server(["--model", str(gemma4_micro), "--max-batch-size", "1", "--max-queue", "0"],
                          tmp_path / "server.log")
    body = {"model": gemma4_micro.name, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    try:
        served = [httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 200}, timeout=60)
                  for _ in range(2)]  # the running average of a request's duration
        assert [r.status_code for r in served] == [200, 200]
        started = threading.Event()

        def hold_the_slot() -> None:
            with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                              json={**body, "max_tokens": 20000, "stream": True}) as r:
                for _ in r.iter_lines():
                    started.set()

        threading.Thread(target=hold_the_slot, daemon=True).start()
        assert started.wait(60)
        refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
    finally:
        server.stop()


def test_a_loading_model_answers_503_with_retry_after(tmp_path):
    """Every request before ready, the warm-up's own excepted, is refused: a chat request let in while
    the engine warmed up ran beside its start-up measures and broke them."""
    model = build_model("gemma4", "small")  # a few seconds of load and warm-up to catch
    server = start_server(["--model", str(model)], tmp_path / "server.log", wait_ready=False)
    seen: list[httpx.Response] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(server.url + "/ready", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.02)  # not listening yet
                continue
            if ready.status_code == 200:
                break
            chat = httpx.post(server.url + "/v1/chat/completions", timeout=5, json={
                "model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            if httpx.get(server.url + "/ready", timeout=5).status_code == 503:  # both answered while loading
                seen += [ready, chat]  # a request let in before ready would break the warm-up's measures
        if not seen:
            pytest.skip("the model was ready before the server answered its first probe")
        assert all(r.status_code == 503 and r.headers.get("Retry-After") == "5" for r in seen), [
            (r.status_code, r.headers.get("Retry-After")) for r in seen]
    finally:
        server.stop()
