"""[loop] uvicorn's h11 protocol with a deadline for a connection's first request headers.

uvicorn times out idle keep-alive connections (its keep-alive timer runs until the next request's
headers are in), but not a new connection's first request: a client sending its headers a byte at a
time held its connection for as long as it liked (slowloris; 200 such sockets were held for 40 s).
"""

from __future__ import annotations

import asyncio
from typing import cast

from uvicorn.protocols.http.h11_impl import H11Protocol


def guarded_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: closes a connection whose first request's
    headers are not all in after ``header_timeout_s``."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = self.loop.call_later(header_timeout_s, self._overdue)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._deadline is not None:  # the headers are in
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _overdue(self) -> None:
            self._deadline = None
            if cast(object, self.cycle) is None and not self.transport.is_closing():  # None until a request begins
                self.transport.close()

    return GuardedH11Protocol


__all__ = ["guarded_protocol"]
