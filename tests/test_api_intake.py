"""intake.py and probes.py: plain probes answered by the HTTP protocol as the app answers them; arrivals in turns."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState as UvicornState

from vlmserve.api.intake import Turns, intake_protocol
from vlmserve.api.probes import probe_path
from vlmserve.api.state import ServerState
from vlmserve.http_protocol import guarded_protocol

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("data, path", [
    (HEALTH, b"/health"),
    (b"GET /ready?verbose=1 HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\r\n\r\n", b"/ready"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", None),
    (b"POST /health HTTP/1.1\r\nHost: x\r\n\r\n", None),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n", None),  # headers still coming
    (b"GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n\r\n", None),  # CORS: the app's
    (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", None),
    (HEALTH + HEALTH, None),  # a second request behind it
])
def test_only_a_plain_probe_is_answered_by_the_protocol(data: bytes, path: bytes | None) -> None:
    assert probe_path(data) == path


def test_turns_start_a_few_per_pass_in_order_of_arrival() -> None:
    async def scenario() -> list[list[int]]:
        turns, passes, started = Turns(per_pass=2), [], []

        def begin(i: int, left: bool = False) -> bool:
            started.append(i)
            return not left

        for i in range(7):
            turns.start(lambda i=i: begin(i, left=i == 2))  # 2's client left: it takes no turn
        for _ in range(4):
            passes.append(list(started))
            await asyncio.sleep(0)  # one pass of the loop
        return passes

    assert asyncio.run(scenario()) == [[0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6]]


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed, self.reading = b"", False, True

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name, default)


def _protocol(app: Any, turns: Turns) -> tuple[Any, FakeTransport]:
    config = uvicorn.Config(app, log_config=None)
    protocol = intake_protocol(guarded_protocol(10), ServerState([]), turns)(config, UvicornState(), {})
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


def test_a_probe_is_answered_in_the_callback_that_reads_it_without_the_app() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the app was called for a plain probe")

    async def scenario() -> tuple[bytes, bool]:
        protocol, transport = _protocol(app, Turns())
        protocol.data_received(b"GET /ready HTTP/1.1\r\nHost: x\r\nX-Request-Id: probe-1\r\n\r\n")
        first = transport.written
        protocol.data_received(HEALTH)  # the same connection, kept alive
        return first + b"|" + transport.written[len(first):], transport.closed

    answers, closed = asyncio.run(scenario())
    ready, health = answers.split(b"|")
    head, body = ready.split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nx-request-id: probe-1" in head
    assert json.loads(body) == {"ready": False, "models": {}}  # no model: never ready
    assert health.startswith(b"HTTP/1.1 200 ") and health.endswith(b'\r\n\r\n{"status":"ok"}') and not closed


def test_other_arrivals_wait_for_their_turn_with_reading_paused() -> None:
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["path"])

    async def scenario() -> list[tuple[int, list[bool]]]:
        turns, seen = Turns(per_pass=1), []
        pairs = [_protocol(app, turns) for _ in range(3)]
        for i, (protocol, _) in enumerate(pairs):
            protocol.data_received(f"POST /v1/x{i} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        for _ in range(4):
            seen.append((len(calls), [t.reading for _, t in pairs]))
            await asyncio.sleep(0)
        return seen

    # one request started per pass (its task runs the app in the pass after); the others' reading paused meanwhile
    assert asyncio.run(scenario()) == [(0, [True, False, False]), (1, [True, True, False]), (2, [True, True, True]),
                                       (3, [True, True, True])]
    assert calls == ["/v1/x0", "/v1/x1", "/v1/x2"]


def _exchange(sock: socket.socket, request: bytes) -> tuple[str, dict[str, str], bytes]:
    """Send one request, read its whole answer (by Content-Length)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return lines[0], headers, body


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_the_protocol_answers_as_the_app_does(server, path: str) -> None:
    """The same probe with an ``Origin`` goes to the app's route (this server has no CORS): same answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        plain = _exchange(sock, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        routed = _exchange(sock, f"GET {path} HTTP/1.1\r\nHost: x\r\nOrigin: http://app.example\r\n\r\n".encode())
    assert plain[0] == routed[0] == "HTTP/1.1 200 OK" and plain[2] == routed[2]
    assert list(plain[1]) == list(routed[1])  # the same headers, in the same order
    assert {k: v for k, v in plain[1].items() if k not in ("date", "x-request-id")} == \
           {k: v for k, v in routed[1].items() if k not in ("date", "x-request-id")}


def test_a_probe_then_a_request_on_one_connection_and_http_1_0_closes(server, model_name) -> None:
    body = json.dumps({"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        status, headers, _ = _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: mine-1\r\n\r\n")
        assert status == "HTTP/1.1 200 OK" and headers["x-request-id"] == "mine-1"
        chat = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
        status, _, answer = _exchange(sock, chat)
        assert status == "HTTP/1.1 200 OK" and json.loads(answer)["usage"]["completion_tokens"] >= 1
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        status, _, answer = _exchange(sock, b"GET /health HTTP/1.0\r\n\r\n")
        assert status == "HTTP/1.1 200 OK" and answer == b'{"status":"ok"}'
        assert sock.recv(10) == b""  # closed: HTTP/1.0 without keep-alive
