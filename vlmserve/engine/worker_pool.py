"""[any] MLX worker threads parked between engines, so a model swap reuses a thread instead of leaking one.

MLX (0.32) gives every Python thread that evaluates a native ``StreamThread``, and ``mx.new_stream`` another;
``mx.clear_streams()`` ends neither. A server that swapped models through fresh worker threads grew one native
thread (~42 KiB) a swap, forever. So the native thread (a ``Carrier``: the thread and its one stream) outlives
the engine it serves: when that engine's worker stops cleanly it parks here, and the next worker takes it.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import Protocol

import mlx.core as mx

log = logging.getLogger(__name__)
MAX_PARKED = 4  # more engines than this stopping at once is rare; the rest just end


class Lease(Protocol):
    """What a carrier serves: one engine's worker (``MLXWorkerThread``), until it stops."""

    name: str

    def serve_here(self) -> bool: ...


class Carrier:
    """One native thread that makes its stream once, then serves one lease at a time."""

    def __init__(self, device: mx.Device | None) -> None:
        self.device = device
        self.stream: mx.Stream | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="mlx-starting", daemon=True)
        self._leases: queue.SimpleQueue[Lease | None] = queue.SimpleQueue()
        self._ready = threading.Event()

    def start(self) -> bool:
        """Start the thread and wait for its stream; False (``error`` says why) if it could not make one."""
        self.thread.start()
        self._ready.wait()
        return self.error is None

    def serve(self, lease: Lease) -> None:
        self.thread.name = lease.name
        self._leases.put(lease)

    def end(self) -> None:
        self._leases.put(None)

    def _main(self) -> None:
        try:
            self.stream = mx.new_stream(self.device or mx.default_device())
            mx.set_default_stream(self.stream)
        except BaseException as exc:  # noqa: BLE001 - reported through self.error
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while (lease := self._leases.get()) is not None:
                clean = lease.serve_here()
                lease = None  # parked, this thread must not keep the last engine's worker (nor its model) alive
                if not clean or not _park(self):
                    return  # a worker that died is never reused
        finally:
            # Join this thread's MLX streams now: left to process teardown, they abort it.
            mx.clear_streams()


_lock = threading.Lock()
_parked: list[Carrier] = []
_closed = False  # at exit: nothing parks any more


def take(device: mx.Device | None) -> Carrier | None:
    """The carrier for ``device`` (None: the default) parked last, or None: the caller starts a new one."""
    with _lock:
        for i in reversed(range(len(_parked))):
            if _parked[i].device == device and _parked[i].thread.is_alive():
                return _parked.pop(i)
    return None


def _park(carrier: Carrier) -> bool:
    with _lock:
        if _closed or len(_parked) >= MAX_PARKED:
            return False
        carrier.thread.name = "mlx-parked"
        _parked.append(carrier)
        return True


def parked() -> int:
    with _lock:
        return len(_parked)


def end_parked(timeout: float = 10.0) -> None:
    """End every parked thread and join it (server shutdown; at exit)."""
    with _lock:
        carriers = list(_parked)
        _parked.clear()
    for carrier in carriers:
        carrier.end()
    for carrier in carriers:
        carrier.thread.join(timeout)


@atexit.register
def _close() -> None:
    global _closed
    with _lock:
        _closed = True
    end_parked()
