"""[loop] /metrics' memory by owner: each model's weights, KV, drafter state and caches, each cache beside its cap.

Read at scrape time from each engine's counters (``EngineMetrics``, written on its worker; ``/metrics`` asks the
workers for current ones first, ``fresh_counters``), so the loop never touches MLX. MLX's active and cached bytes
are the process's, one series each; the process's RSS is prometheus_client's ``process_resident_memory_bytes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

FRESH_WAIT_S = 0.25  # a worker deep in a long step answers late: the counters of its last step are shown instead


def owners(engine: Any, m: Any) -> dict[str, tuple[int, int | None]]:
    """owner -> (bytes held, its cap; None where it has none). The caches and the KV reservations have caps;
    the weights, the batch's KV as allocated and its drafter state are bounded by the reservations they belong to."""
    out: dict[str, tuple[int, int | None]] = {
        "weights": (engine.weights_bytes, None), "kv_reserved": (m.kv_reserved_bytes, m.kv_budget_bytes or 0),
        "kv_used": (m.kv_used_bytes, None), "drafter_state": (m.draft_bytes, None)}
    if m.vision is not None:
        out["vision_cache"] = (m.vision.bytes, m.vision.limit_bytes)
    if m.prefix is not None:
        out["prefix_cache"] = (m.prefix.bytes, m.prefix.limit_bytes)
    if m.mm_prefix is not None:
        out["mm_prefix_cache"] = (m.mm_prefix.bytes, m.mm_prefix.limit_bytes)
    if m.disk is not None:
        out["disk_pending_writes"] = (m.disk.pending_bytes, m.disk.pending_limit_bytes)
    return out


class MemoryCollector:
    """``vlmserve_memory_bytes{model,owner}``, and for each owner with a cap ``vlmserve_memory_limit_bytes``
    beside it and ``vlmserve_memory_uncapped`` (1: the cap is 0, unbounded); MLX's bytes for the process."""

    def __init__(self, engines: Callable[[], list[tuple[str, Any]]]) -> None:
        self._engines = engines
        self.fresh: dict[str, Any] = {}  # name -> EngineMetrics read on its worker for this scrape

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily("vlmserve_memory_bytes", "Bytes each owner holds: weights, KV reserved and as "
                                 "allocated, drafter state, each cache", labels=["model", "owner"])
        caps = GaugeMetricFamily("vlmserve_memory_limit_bytes", "The cap of each owner that has one (0: none)",
                                 labels=["model", "owner"])
        uncapped = GaugeMetricFamily("vlmserve_memory_uncapped", "1 where an owner that should have a cap has none",
                                     labels=["model", "owner"])
        mlx = {k: GaugeMetricFamily(f"vlmserve_mlx_{k}_bytes", h) for k, h in (
            ("active", "MLX's active memory (the process's)"), ("cache", "MLX's buffer cache (the process's)"),
            ("cache_limit", "The cap of MLX's buffer cache"))}
        latest = None
        for name, engine in self._engines():
            m = self.fresh.get(name) or engine.metrics
            if m is None:
                continue
            latest = latest or m
            for owner, (n, cap) in owners(engine, m).items():
                held.add_metric([name, owner], n)
                if cap is not None:
                    caps.add_metric([name, owner], cap)
                    uncapped.add_metric([name, owner], 0.0 if cap else 1.0)
        if latest is not None:
            for key, family in mlx.items():
                family.add_metric([], getattr(latest, f"mlx_{key}_bytes"))
        yield from (held, caps, uncapped, *mlx.values())


async def fresh_counters(engines: list[tuple[str, Any]]) -> dict[str, Any]:
    """Each running engine's counters read now on its worker (an idle worker publishes nothing, so what it last
    published can be a request behind); those that do not answer within ``FRESH_WAIT_S`` are left out."""
    tasks = {name: asyncio.ensure_future(engine.stats()) for name, engine in engines
             if engine.metrics is not None and engine.ready}
    if not tasks:
        return {}
    done, pending = await asyncio.wait(tasks.values(), timeout=FRESH_WAIT_S)
    for task in pending:
        task.cancel()  # the worker still runs the read; nobody waits for it
    return {name: task.result() for name, task in tasks.items() if task in done and task.exception() is None}
