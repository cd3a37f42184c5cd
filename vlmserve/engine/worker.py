"""[worker] The MLX worker thread: one per engine, the only thread that touches its model.

MLX streams are thread-local: an array built lazily on one thread and evaluated on
another fails with ``There is no Stream(cpu, N) in current thread``. So each engine
owns one persistent thread. It makes its stream once, at start, before any task, then
runs submitted callables in order and, between them, the engine's step.

The native thread (with its stream) is a ``worker_pool.Carrier``: when an engine stops cleanly, its thread
parks and the next engine's worker takes it (MLX leaks a native thread per Python thread that evaluates).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from vlmserve.engine import worker_pool
from vlmserve.engine.worker_pool import Carrier

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerShutdownError(RuntimeError):
    """A task was still pending, or was submitted, after the worker stopped."""


class WorkerDiedError(RuntimeError):
    """The worker thread ended because of an unexpected error."""


class Stepper(Protocol):
    """What the worker runs between tasks: one engine step at a time."""

    def has_work(self) -> bool: ...

    def step(self) -> None: ...


@dataclass(slots=True, frozen=True)
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: Future[Any] = field(default_factory=Future)


_WAKE = object()


class MLXWorkerThread:
    """One persistent thread with its own MLX stream; runs callables in submission order.

    The thread is a parked one where there is one (``start``), else a new one; either way its stream was
    made once, when that thread started. ``submit`` may be called from any thread and returns a
    ``concurrent.futures.Future``; ``run`` awaits the result from asyncio without blocking the event loop. Exceptions
    raised by a task reach its caller and the worker goes on serving.
    """

    def __init__(self, name: str = "mlx-worker", device: mx.Device | None = None) -> None:
        self.name = name
        self._device = device
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._carrier: Carrier | None = None  # the thread serving this worker, from ``start``
        self._done = threading.Event()  # this worker stopped serving: its thread parked or ended
        self._reusable = True  # False once its engine faulted: the thread ends with it
        self._lock = threading.Lock()  # orders submit() against shutdown()
        self._closed = False
        self._stepper: Stepper | None = None
        self.stream: mx.Stream | None = None
        self.error: BaseException | None = None
        # Called on the worker as it exits (error or None); engines use it to fail pending work.
        self.on_exit: Callable[[BaseException | None], None] | None = None

    # -- any thread ---------------------------------------------------------------

    def start(self) -> None:
        carrier = worker_pool.take(self._device)
        if carrier is None:
            carrier = Carrier(self._device)
            if not carrier.start():
                self.error, self._closed = carrier.error, True
                self._done.set()
                return
        self._carrier, self.stream = carrier, carrier.stream
        carrier.serve(self)

    @property
    def alive(self) -> bool:
        return self._carrier is not None and self._carrier.thread.is_alive() and not self._closed

    @property
    def ident(self) -> int | None:
        return self._carrier.thread.ident if self._carrier is not None else None

    def on_worker(self) -> bool:
        # once done, the thread may serve another engine: it is no longer this worker
        return not self._done.is_set() and threading.get_ident() == self.ident

    def assert_on_worker(self) -> None:
        """Cheap, always-on check for code that must only run on this worker."""
        if not self.on_worker():
            raise AssertionError(
                f"MLX call on thread {threading.current_thread().name!r}; "
                f"it must run on worker {self.name!r}"
            )

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        task = _Task(fn, args, kwargs)
        with self._lock:
            if self._closed:
                task.future.set_exception(self._closed_error())
                return task.future
            self._inbox.put(task)
        return task.future

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the worker and await its result without blocking the loop."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the worker and block this (non-worker) thread for the result."""
        assert not self.on_worker(), "call() from the worker would deadlock"
        return self.submit(fn, *args, **kwargs).result()

    def set_stepper(self, stepper: Stepper | None) -> None:
        self._stepper = stepper
        self.wake()

    def wake(self) -> None:
        """Make an idle worker look at its stepper again (new requests, aborts)."""
        self._inbox.put(_WAKE)

    def retire(self) -> None:
        """Its engine faulted (a lost pipeline rank, say): end the thread when this worker stops, never park it."""
        self._reusable = False

    def join(self, timeout: float | None = None) -> bool:
        """Wait until this worker stopped serving (its thread parked or ended); False on timeout."""
        return self._done.wait(timeout)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop after the task in hand; fail every pending task; wait until the thread parked or ended."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_WAKE)
        if self._carrier is not None and not self.on_worker():
            self.join(timeout)

    # -- the worker thread --------------------------------------------------------

    def serve_here(self) -> bool:
        """[worker] Serve until shut down; True when it stopped cleanly, so its thread may serve another."""
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the stepper itself failed
            log.exception("worker %s died", self.name)
            self.error = exc
        finally:
            try:
                with self._lock:
                    self._closed = True
                self._fail_pending()
                if self.on_exit is not None:
                    self.on_exit(self.error)
            finally:
                self._stepper = None  # nothing steps it now; its engine's arrays go with whoever still holds it
                self._done.set()
        return self.error is None and self._reusable

    def _loop(self) -> None:
        while True:
            busy = self._stepper is not None and self._stepper.has_work()
            item = self._next_item(block=not busy)
            while item is not None:
                if self._closed:  # shutdown jumps the queue: what is left fails
                    self._fail(item)
                    return
                if isinstance(item, _Task):
                    self._run_task(item)
                item = self._next_item(block=False)
            if self._stepper is not None and self._stepper.has_work():
                self._stepper.step()

    def _next_item(self, block: bool) -> Any:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None

    @staticmethod
    def _run_task(task: _Task) -> None:
        if not task.future.set_running_or_notify_cancel():
            return
        try:
            result = task.fn(*task.args, **task.kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            task.future.set_exception(exc)
        else:
            task.future.set_result(result)

    def _fail_pending(self) -> None:
        while (item := self._next_item(block=False)) is not None:
            self._fail(item)

    def _fail(self, item: Any) -> None:
        if isinstance(item, _Task) and item.future.set_running_or_notify_cancel():
            item.future.set_exception(self._closed_error())

    def _closed_error(self) -> Exception:
        if self.error is not None:
            return WorkerDiedError(f"MLX worker {self.name!r} died: {self.error!r}")
        return WorkerShutdownError(f"MLX worker {self.name!r} is shut down")
