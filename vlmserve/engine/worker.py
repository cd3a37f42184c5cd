"""[worker] The MLX worker thread: one per engine, the only thread that touches its model.

MLX streams are thread-local: an array built lazily on one thread and evaluated on
another fails with ``There is no Stream(cpu, N) in current thread``. So each engine
owns one persistent thread. It makes its stream once, at start, before any task, then
runs submitted callables in order and, between them, the engine's step.
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

    ``submit`` may be called from any thread and returns a ``concurrent.futures.Future``;
    ``run`` awaits the result from asyncio without blocking the event loop. Exceptions
    raised by a task reach its caller and the worker goes on serving.
    """

    def __init__(self, name: str = "mlx-worker", device: mx.Device | None = None) -> None:
        self.name = name
        self._device = device
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._lock = threading.Lock()  # orders submit() against shutdown()
        self._closed = False
        self._stepper: Stepper | None = None
        self.stream: mx.Stream | None = None
        self.error: BaseException | None = None
        # Called on the worker as it exits (error or None); engines use it to fail pending work.
        self.on_exit: Callable[[BaseException | None], None] | None = None

    # -- any thread ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def on_worker(self) -> bool:
        return threading.get_ident() == self._thread.ident

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

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop after the task in hand; fail every pending task; join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_WAKE)
        if self._thread.is_alive() and not self.on_worker():
            self._thread.join(timeout)

    # -- the worker thread --------------------------------------------------------

    def _main(self) -> None:
        try:
            device = self._device or mx.default_device()
            self.stream = mx.new_stream(device)
            mx.set_default_stream(self.stream)
        except BaseException as exc:  # noqa: BLE001 - reported through self.error
            self.error = exc
            self._closed = True
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - the stepper itself failed
            log.exception("worker %s died", self.name)
            self.error = exc
        finally:
            with self._lock:
                self._closed = True
            self._fail_pending()
            # Join this thread's MLX streams now: left to process teardown, they abort it.
            mx.clear_streams()
            if self.on_exit is not None:
                self.on_exit(self.error)
            self._stepper = None  # nothing steps it now; its engine's arrays go with whoever still holds it

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
