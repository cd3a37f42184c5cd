"""[loop] A request's first bytes: probes are answered at once, other arrivals take turns.

Under a flood the loop ran a few hundred arrivals' first steps per pass: for each, uvicorn's parsing, the
middlewares, FastAPI's body parsing and validation and our checks, up to the submission on the pool: 1-2 ms
of the loop on 2 cores. Passes of 30-80 ms followed one another for 2-3 s, and a probe, which went the same
way and needed two passes, waited out both. Here the protocol (uvicorn's h11, or http_protocol.py's
guard of it) looks at the bytes of each request that opens on an idle connection:

- a plain ``GET /health`` or ``GET /ready`` is answered in the same callback, before any pass of the
  app: same JSON, headers and keep-alive as the app's routes, which still answer the probes that are not
  plain (a body, an ``Origin``, a second request behind it);
- any other request starts in its turn: ``Turns.per_pass`` of them per pass of the loop, the rest wait with
  their connection's reading paused, so a pass stays short however many arrive.
"""

from __future__ import annotations

import asyncio
import http
from collections import deque
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from vlmserve.api.probes import PROBES, ProbeAnswer, encode, probe_path, request_id
from vlmserve.api.state import ServerState


class Turns:
    """At most ``per_pass`` starts per pass of the loop, in order of arrival; a start that finds room and
    nobody waiting runs at once."""

    def __init__(self, per_pass: int = 2) -> None:
        self.per_pass = per_pass
        self.started = 0  # in this pass
        self.waiting: deque[Callable[[], bool]] = deque()
        self.next_pass: asyncio.Handle | None = None

    def start(self, begin: Callable[[], bool]) -> None:
        """``begin`` now or in a later pass; it returns whether it started anything (False: its client left)."""
        if self.next_pass is None:  # call_soon runs in the loop's next pass: a new count there
            self.next_pass = asyncio.get_running_loop().call_soon(self._new_pass)
        if self.started < self.per_pass and not self.waiting:
            self.started += begin()
        else:
            self.waiting.append(begin)

    def _new_pass(self) -> None:
        self.started, self.next_pass = 0, None
        if self.waiting:  # scheduled first: a start that raises does not hold up the rest
            self.next_pass = asyncio.get_running_loop().call_soon(self._new_pass)
        while self.waiting and self.started < self.per_pass:
            self.started += self.waiting.popleft()()


def intake_protocol(base: type[H11Protocol], state: ServerState, turns: Turns) -> type[H11Protocol]:
    """``base`` with probes answered at once and arrivals in ``turns``, for ``uvicorn.Config(http=...)``."""

    class IntakeProtocol(base):  # type: ignore[misc, valid-type]  # a class made by a function
        def data_received(self, data: bytes) -> None:
            conn = self.conn
            fresh = conn.our_state is h11.IDLE and conn.their_state is h11.IDLE and not conn.trailing_data[0]
            if not fresh or b"\r\n\r\n" not in data:  # more of a request, or headers still coming (the guard waits)
                super().data_received(data)
                return
            self._headers_came()
            path = probe_path(data)
            if path is not None:
                self._answer_probe(data, PROBES[path](state))
                return
            self.transport.pause_reading()  # until its turn: the rest of its body waits in the kernel
            turns.start(lambda: self._begin(data))

        def _begin(self, data: bytes) -> bool:
            if self.transport.is_closing():
                return False
            self.transport.resume_reading()
            super().data_received(data)
            return True

        def _headers_came(self) -> None:
            """A request's headers are all in: neither the idle keep-alive timer nor the guard's deadline for the
            first request's headers may close its connection while it waits for its turn."""
            self._unset_keepalive_if_required()
            deadline = getattr(self, "_deadline", None)
            if deadline is not None:
                deadline.cancel()
                self._deadline = None

        def _answer_probe(self, data: bytes, answer: ProbeAnswer) -> None:
            """Write the answer as the app would (same JSON, headers and keep-alive); then the next request."""
            self.conn.receive_data(data)
            try:
                request, end = self.conn.next_event(), self.conn.next_event()
            except h11.RemoteProtocolError:
                self.send_400_response("Invalid HTTP request received.")
                return
            assert isinstance(request, h11.Request) and isinstance(end, h11.EndOfMessage), (request, end)
            body = encode(answer)
            headers = [*self.server_state.default_headers, (b"content-length", str(len(body)).encode()),
                       (b"content-type", b"application/json"),
                       *((k.lower().encode(), v.encode()) for k, v in answer.headers.items()),
                       (b"x-request-id", request_id(dict(request.headers).get(b"x-request-id", b"")))]
            reason = http.HTTPStatus(answer.status).phrase.encode()
            out = self.conn.send(h11.Response(status_code=answer.status, headers=headers, reason=reason))
            self.transport.write(out + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
            if self.conn.our_state is h11.MUST_CLOSE:  # an HTTP/1.0 client, or Connection: close
                self.conn.send(h11.ConnectionClosed())
                self.transport.close()
            self.on_response_complete()  # counted; the keep-alive timer; the next request's cycle

    return IntakeProtocol
