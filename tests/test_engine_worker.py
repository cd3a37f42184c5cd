"""The MLX worker thread: its own stream, ordered tasks, errors to callers, clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import mlx.core as mx
import pytest

from vlmserve.engine.worker import MLXWorkerThread, WorkerDiedError, WorkerShutdownError


@pytest.fixture
def worker():
    w = MLXWorkerThread(name="test-worker")
    w.start()
    yield w
    w.shutdown()


def test_lazy_array_from_worker_fails_on_another_thread(worker):
    """Why the worker exists: MLX streams are thread-local. If this ever stops failing, revisit the design."""
    lazy = worker.call(lambda: mx.ones((4,)) * 2)  # built on the worker's stream, not evaluated
    with pytest.raises(RuntimeError, match=r"There is no Stream\(\w+, \d+\) in current thread"):
        mx.eval(lazy)


def test_worker_makes_its_own_stream_before_any_task(worker):
    stream = worker.call(lambda: mx.default_stream(mx.default_device()))
    assert worker.stream is not None and stream == worker.stream
    assert stream != mx.default_stream(mx.default_device())


def test_tasks_run_in_order_on_one_thread(worker):
    seen: list[tuple[int, int]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(50)]
    for f in futures:
        f.result(timeout=10)
    assert [i for i, _ in seen] == list(range(50))
    assert {ident for _, ident in seen} == {worker.ident}


def test_assert_on_worker_is_always_on(worker):
    with pytest.raises(AssertionError, match="must run on worker"):
        worker.assert_on_worker()
    worker.call(worker.assert_on_worker)


def test_exception_reaches_the_awaiting_caller_and_worker_goes_on(worker):
    def boom() -> None:
        raise ValueError("bad task")

    async def scenario() -> float:
        with pytest.raises(ValueError, match="bad task"):
            await worker.run(boom)
        return await worker.run(lambda: (mx.array([1.0, 2.0]) * 3).sum().item())

    assert asyncio.run(scenario()) == 9.0


def test_event_loop_stays_free_while_the_worker_is_busy(worker):
    async def scenario() -> int:
        ticks = 0
        job = asyncio.ensure_future(worker.run(time.sleep, 0.5))
        while not job.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return ticks

    assert asyncio.run(scenario()) > 5


def test_shutdown_fails_queued_tasks_instead_of_hanging():
    w = MLXWorkerThread(name="test-shutdown")
    w.start()
    entered, gate = threading.Event(), threading.Event()
    running = w.submit(lambda: entered.set() or gate.wait(10))
    entered.wait(10)
    queued = [w.submit(lambda: "never") for _ in range(5)]
    closer = threading.Thread(target=w.shutdown)
    closer.start()
    time.sleep(0.05)
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and not w.alive
    assert running.result(timeout=1) is True
    for f in queued:
        with pytest.raises(WorkerShutdownError, match="shut down"):
            f.result(timeout=1)
    with pytest.raises(WorkerShutdownError):
        w.submit(lambda: None).result(timeout=1)


class Broken:
    """A stepper whose step raises: its worker dies."""

    def has_work(self) -> bool:
        return True

    def step(self) -> None:
        raise RuntimeError("step exploded")


def test_a_dying_stepper_fails_pending_work():
    w = MLXWorkerThread(name="test-dies")
    w.start()
    w.set_stepper(Broken())
    assert w.join(10)
    assert not w.alive
    with pytest.raises(WorkerDiedError, match="step exploded"):
        w.submit(lambda: None).result(timeout=1)
