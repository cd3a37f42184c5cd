"""Two ``vlmserve serve`` replicas behind the gateway the README recommends (``vllm-router``), on loopback:
requests spread over both, and when one replica is killed its in-flight stream ends (an error, not
a hang) and every request after the gateway's health interval succeeds."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, free_port, start_server

from vlmserve.config import DEFAULT_MODEL_NAME

ROUTER = shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="needs the vllm-router gateway (pip install vllm-router)")
HEALTH_INTERVAL_S = 1


def _requests_served(replica: ServerProcess) -> float:
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vlmserve_requests_total{"))


def _ask(url: str) -> int:
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code


def _stream(url: str, outcome: dict, key: int, enough: threading.Event) -> None:
    """Streams a long answer until ``enough`` is set (then the client closes it, as a user would) or
    the stream ends; ``outcome[key]`` is (state, chunks so far)."""
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": f"story {key}"}], "stream": True,
            "max_tokens": 20000, "ignore_eos": True}
    chunks = 0
    try:
        # A read timeout well under the test's join: a stalled stream ends as "cut: ReadTimeout", named.
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                outcome[key] = ("streaming", chunks)
                if enough.is_set():
                    outcome[key] = ("closed by the client", chunks)
                    break
            else:
                outcome[key] = ("completed", chunks)
    except httpx.HTTPError as exc:
        outcome[key] = (f"cut: {type(exc).__name__}", chunks)
    outcome[f"{key}-ended"] = time.monotonic()


@pytest.fixture
def cluster(tmp_path: Path):
    replicas = [start_server([], tmp_path / f"replica{i}.log") for i in range(2)]
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen([ROUTER, "--worker-urls", *(r.url for r in replicas), "--policy", "round_robin",
                               "--host", "127.0.0.1", "--port", str(port), "--health-check-endpoint", "/ready",
                               "--health-check-interval-secs", str(HEALTH_INTERVAL_S), "--health-failure-threshold", "1",
                               "--prometheus-port", str(free_port()), "--log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert router.poll() is None, (tmp_path / "router.log").read_text()
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url, replicas
    router.send_signal(signal.SIGTERM)
    router.wait(20)
    for replica in replicas:
        replica.stop(signal.SIGKILL)


def test_requests_spread_and_a_killed_replica_fails_nothing_after_the_health_interval(cluster):
    url, (a, b) = cluster
    assert [_ask(url) for _ in range(12)] == [200] * 12
    served = [_requests_served(a), _requests_served(b)]
    assert served == [6, 6], served  # round-robin, as the README says

    # Streams long enough (20000 tokens) that neither can finish before the kill, however the
    # machine stalls; the one on the surviving replica must go on streaming after it.
    outcome: dict = {}
    enough = threading.Event()
    streams = [threading.Thread(target=_stream, args=(url, outcome, i, enough)) for i in range(2)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while not all(outcome.get(i, ("", 0))[1] >= 2 for i in range(2)):
        assert time.monotonic() < deadline, outcome
        time.sleep(0.05)
    assert all(outcome[i][0] == "streaming" for i in range(2)), outcome
    killed = time.monotonic()
    b.proc.send_signal(signal.SIGKILL)
    deadline = killed + 60
    while not any(str(outcome[i][0]).startswith("cut") for i in range(2)):
        assert time.monotonic() < deadline, f"the stream on the killed replica hangs: {outcome}"
        time.sleep(0.05)
    cut = next(i for i in range(2) if str(outcome[i][0]).startswith("cut"))
    survivor = 1 - cut
    at_cut = outcome[survivor][1]
    while outcome[survivor][1] < at_cut + 5:  # the other replica's stream goes on
        assert time.monotonic() < deadline, outcome
        assert outcome[survivor][0] == "streaming", outcome
        time.sleep(0.05)
    enough.set()
    for s in streams:
        s.join(60)
    assert not any(s.is_alive() for s in streams), f"a stream hangs: {outcome}"
    assert outcome[survivor][0] == "closed by the client", outcome
    cut_after = round(outcome[f"{cut}-ended"] - killed, 2)
    time.sleep(HEALTH_INTERVAL_S + 1)
    after = [_ask(url) for _ in range(12)]
    print(f"failover: the stream on the killed replica ended {cut_after} s after SIGKILL; after "
          f"{HEALTH_INTERVAL_S + 1} s, {after.count(200)}/12 requests succeeded")
    assert after == [200] * 12
