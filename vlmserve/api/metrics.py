"""[loop] Prometheus metrics: requests by status, TTFT and latency, tokens, queue depth, batch, steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Reads each engine's counters at scrape time (written by its worker, read here)."""

    def __init__(self, engines: Callable[[], list[tuple[str, Any]]]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "queue_depth": ("vlmserve_queue_depth", "Requests waiting for a batch slot"),
            "running": ("vlmserve_running_requests", "Requests admitted to the batch"),
            "batch_size": ("vlmserve_batch_size", "Rows in the decode batch"),
            "last_step_s": ("vlmserve_step_seconds", "Duration of the last engine step"),
            "in_flight": ("vlmserve_requests_in_flight", "Requests accepted and not finished"),
        }
        gauges = {k: GaugeMetricFamily(n, h, labels=["model"]) for k, (n, h) in families.items()}
        for name, engine in self._engines():
            m = engine.metrics
            if m is None:
                continue
            values = {"queue_depth": m.waiting, "running": m.running, "batch_size": m.batch_size,
                      "last_step_s": m.last_step_s, "in_flight": engine.num_in_flight}
            for key, value in values.items():
                gauges[key].add_metric([name], value)
        yield from gauges.values()


class ServerMetrics:
    """One registry per app, so several apps (tests) never collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vlmserve_requests", "Chat requests by final status", ["model", "status"], registry=self.registry)
        self.ttft = Histogram("vlmserve_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("vlmserve_request_latency_seconds", "Request latency", ["model"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("vlmserve_prompt_tokens", "Prompt tokens in", ["model"], registry=self.registry)
        self.completion_tokens = Counter("vlmserve_completion_tokens", "Tokens generated", ["model"], registry=self.registry)

    def watch_engines(self, engines: Callable[[], list[tuple[str, Any]]]) -> None:
        self.registry.register(_EngineCollector(engines))

    def finished(self, model: str, status: str, ttft: float | None, latency: float, usage: dict[str, Any]) -> None:
        self.requests.labels(model, status).inc()
        self.latency.labels(model).observe(latency)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        self.prompt_tokens.labels(model).inc(usage.get("prompt_tokens", 0))
        self.completion_tokens.labels(model).inc(usage.get("completion_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
