"""[loop] flood_bench.py ``--loop-lag``: times every pass of the served process's event loop.

Python imports ``sitecustomize`` at start-up from the path, so flood_bench.py puts this folder first
on the server's ``PYTHONPATH`` and the server itself is unchanged. Each pass is timed twice, its
wall time without the wait in ``select`` and the loop thread's CPU time: a pass that is slow in wall
time but short in CPU had the loop runnable and not running (other threads or processes had the
cores, or the GIL); a pass long in CPU is work the loop did. Passes over ``MIN_MS`` are written as
JSON, ``[start (time.perf_counter), wall ms, cpu ms, callbacks ready after it]``, to
``$VLMSERVE_LOOP_LAG`` at exit or on SIGUSR1.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import time
from typing import Any

MIN_MS = 2.0


def _install(path: str) -> None:
    passes: list[tuple[float, float, float, int]] = []
    run_once = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]

    def timed_once(loop: Any) -> None:
        selector = loop._selector
        if not hasattr(selector, "waited"):
            _time_select(selector)
        selector.waited = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        run_once(loop)
        ms = (time.perf_counter() - wall - selector.waited) * 1000
        if ms > MIN_MS:
            passes.append((round(wall, 4), round(ms, 2), round((time.thread_time() - cpu) * 1000, 2),
                           len(loop._ready)))

    def dump(*_: Any) -> None:
        with open(path, "w") as f:
            json.dump(passes, f)

    asyncio.base_events.BaseEventLoop._run_once = timed_once  # type: ignore[attr-defined]
    atexit.register(dump)
    signal.signal(signal.SIGUSR1, dump)


def _time_select(selector: Any) -> None:
    """The seconds of each pass spent waiting in ``select`` (idle, not lag) go to ``selector.waited``."""
    select = selector.select

    def timed(timeout: float | None = None) -> Any:
        start = time.perf_counter()
        try:
            return select(timeout)
        finally:
            selector.waited = time.perf_counter() - start

    selector.select = timed


if os.environ.get("VLMSERVE_LOOP_LAG"):
    _install(os.environ["VLMSERVE_LOOP_LAG"])
