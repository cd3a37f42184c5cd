"""[loop] Prometheus metrics: ours (``vlmserve_*``) and, for dashboards built for vLLM, its names
(``vllm:*``, labelled ``model_name``) for the same quantities."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vlmserve.api.memory_metrics import MemoryCollector

disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``*_created`` series: dashboards never read them
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)

# key: (our name, vLLM's name or None, help); read from each engine at scrape time
_GAUGES = {
    "waiting": ("vlmserve_queue_depth", "vllm:num_requests_waiting", "Requests waiting for a batch slot"),
    "running": ("vlmserve_running_requests", "vllm:num_requests_running", "Requests admitted to the batch"),
    "batch_size": ("vlmserve_batch_size", None, "Rows in the decode batch"),
    "last_step_s": ("vlmserve_step_seconds", None, "Duration of the last engine step"),
    "in_flight": ("vlmserve_requests_in_flight", None, "Requests accepted and not finished"),
    "kv_reserved": ("vlmserve_kv_cache_reserved_bytes", None, "KV-cache bytes the running requests may fill"),
    "kv_budget": ("vlmserve_kv_cache_budget_bytes", None, "The KV-cache budget admission keeps to"),
    "kv_usage": ("vlmserve_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "Reserved KV cache over the budget (0-1)"),
    "vision_bytes": ("vlmserve_vision_cache_bytes", None, "Bytes of image features in the vision cache"),
    "vision_entries": ("vlmserve_vision_cache_entries", None, "Images whose features the vision cache holds"),
    "prefix_bytes": ("vlmserve_prefix_cache_bytes", None, "KV bytes the text prefix cache holds"),
    "prefix_entries": ("vlmserve_prefix_cache_entries", None, "Text prompts whose KV the prefix cache holds"),
    "prefix_pinned": ("vlmserve_prefix_cache_pinned_entries", None, "Cached prompts (both stores) kept from eviction "
                      "by a cache_control breakpoint until its TTL ends"),
    "mm_prefix_bytes": ("vlmserve_mm_prefix_cache_bytes", None, "KV bytes the image-keyed prefix cache holds"),
    "mm_prefix_entries": ("vlmserve_mm_prefix_cache_entries", None, "Image prompts whose KV the image-keyed prefix "
                          "cache holds"),
    "disk_bytes": ("vlmserve_prefix_cache_disk_bytes", None, "Bytes of prefix KV files in --prefix-cache-dir"),
    "disk_entries": ("vlmserve_prefix_cache_disk_entries", None, "Prefix KV files in --prefix-cache-dir"),
    "disk_writes_pending": ("vlmserve_prefix_cache_disk_writes_pending", None, "Prefix KV files waiting to be written"),
}
# key: (our name, vLLM's name or None, help); counters, so each gets ``_total``
_COUNTERS = {
    "prefix_hits": ("vlmserve_prefix_cache_hits", None, "Text prompts that reused a cached prefix"),
    "prefix_misses": ("vlmserve_prefix_cache_misses", None, "Text prompts that found no cached prefix"),
    "prefix_hit_tokens": ("vlmserve_prefix_cache_hit_tokens", None, "Prompt tokens served from the prefix cache"),
    "prefix_query_tokens": ("vlmserve_prefix_cache_query_tokens", None, "Text prompts' tokens looked up in the prefix "
                            "cache"),
    "stalled": ("vlmserve_stalled_requests", None, "Requests aborted because their client stopped reading"),
    "vision_hits": ("vlmserve_vision_cache_hits", None, "Images whose features came from the vision cache"),
    "vision_misses": ("vlmserve_vision_cache_misses", None, "Images encoded by the vision tower (then cached)"),
    "vision_evictions": ("vlmserve_vision_cache_evictions", None, "Images' features dropped to stay within the budget"),
    "vision_seconds": ("vlmserve_vision_seconds", None, "Seconds spent embedding image prompts (vision tower and "
                       "merge)"),
    "mm_prefix_hits": ("vlmserve_mm_prefix_cache_hits", None, "Image prompts that reused a cached prefix "
                       "(--mm-prefix-cache)"),
    "mm_prefix_misses": ("vlmserve_mm_prefix_cache_misses", None, "Image prompts that found no cached prefix"),
    "mm_prefix_hit_tokens": ("vlmserve_mm_prefix_cache_hit_tokens", None, "Image prompts' tokens served from the "
                             "image-keyed prefix cache"),
    "mm_prefix_query_tokens": ("vlmserve_mm_prefix_cache_query_tokens", None, "Image prompts' tokens looked up in "
                               "the image-keyed prefix cache"),
    "prefix_budget_evictions": ("vlmserve_prefix_cache_budget_evictions", None, "Cached prefixes (text and "
                                "image-keyed) dropped to give the KV budget to running requests"),
    "disk_hits": ("vlmserve_prefix_cache_disk_hits", None, "Prompts whose cached prefix came from disk"),
    "disk_misses": ("vlmserve_prefix_cache_disk_misses", None, "Prompts the prefix caches held less of than all "
                    "of it whose disk tier held nothing more either (or a file that failed its check)"),
    "disk_rejected": ("vlmserve_prefix_cache_disk_rejected", None, "Files ignored and deleted: corrupt, truncated, "
                      "or another model's, KV's or version's"),
    "disk_read_bytes": ("vlmserve_prefix_cache_disk_read_bytes", None, "Bytes of prefix KV read from disk"),
    "disk_read_seconds": ("vlmserve_prefix_cache_disk_read_seconds", None, "Seconds spent reading prefix KV files"),
    "disk_written_bytes": ("vlmserve_prefix_cache_disk_written_bytes", None, "Bytes of prefix KV written to disk"),
    "disk_write_seconds": ("vlmserve_prefix_cache_disk_write_seconds", None, "Seconds the writer thread spent "
                           "writing prefix KV files"),
    # vLLM's prefix-cache counters count tokens, over every prompt: both stores here
    "all_query_tokens": ("vlmserve_prefix_cache_all_query_tokens", "vllm:prefix_cache_queries",
                         "Prompt tokens looked up in a prefix cache (text and image-keyed)"),
    "all_hit_tokens": ("vlmserve_prefix_cache_all_hit_tokens", "vllm:prefix_cache_hits",
                       "Prompt tokens served from a prefix cache (text and image-keyed)"),
    # Speculative decoding (engine/speculative.py), as vLLM counts it
    "spec_drafts": ("vlmserve_spec_decode_drafts", "vllm:spec_decode_num_drafts", "Drafts verified (a row's, a step)"),
    "spec_draft_tokens": ("vlmserve_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens",
                          "Draft tokens verified"),
    "spec_accepted_tokens": ("vlmserve_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
                             "Draft tokens accepted"),
}
_PER_POSITION = ("vlmserve_spec_decode_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
                 "Draft tokens accepted, by their position in the draft (0: the first)")


def _engine_values(engine: Any, m: Any) -> tuple[dict[str, float], dict[str, float]] | None:
    if m is None:
        return None
    budget = m.kv_budget_bytes or 0
    gauges = {"waiting": m.waiting, "running": m.running, "batch_size": m.batch_size, "last_step_s": m.last_step_s,
              "in_flight": engine.num_in_flight, "kv_reserved": m.kv_reserved_bytes, "kv_budget": budget,
              "kv_usage": m.kv_reserved_bytes / budget if budget else 0.0}
    prefix, vision, mm = m.prefix, m.vision, m.mm_prefix
    gauges.update(vision_bytes=vision.bytes if vision else 0, vision_entries=vision.entries if vision else 0,
                  mm_prefix_bytes=mm.bytes if mm else 0, mm_prefix_entries=mm.entries if mm else 0)
    stores = [store for store in (prefix, mm) if store is not None]
    gauges.update(prefix_bytes=prefix.bytes if prefix else 0, prefix_entries=prefix.entries if prefix else 0,
                  prefix_pinned=sum(store.pinned for store in stores))
    disk = m.disk
    gauges.update(disk_bytes=disk.bytes if disk else 0, disk_entries=disk.entries if disk else 0,
                  disk_writes_pending=disk.writes_pending if disk else 0)
    counters = {"prefix_hits": prefix.hits if prefix else 0, "prefix_misses": prefix.misses if prefix else 0,
                "prefix_hit_tokens": prefix.hit_tokens if prefix else 0,
                "prefix_query_tokens": prefix.query_tokens if prefix else 0, "stalled": engine.stalled,
                "vision_hits": vision.hits if vision else 0, "vision_misses": vision.misses if vision else 0,
                "vision_evictions": vision.evictions if vision else 0, "vision_seconds": m.vision_seconds,
                "mm_prefix_hits": mm.hits if mm else 0, "mm_prefix_misses": mm.misses if mm else 0,
                "mm_prefix_hit_tokens": mm.hit_tokens if mm else 0, "mm_prefix_query_tokens": mm.query_tokens if mm else 0,
                "prefix_budget_evictions": sum(store.budget_evictions for store in stores),
                "all_query_tokens": sum(store.query_tokens for store in stores),
                "all_hit_tokens": sum(store.hit_tokens for store in stores),
                "disk_hits": sum(store.disk_hits for store in stores),
                **{f"disk_{k}": getattr(disk, k) if disk else 0 for k in ("misses", "rejected", "read_bytes",
                                                                            "read_seconds", "written_bytes",
                                                                            "write_seconds")},
                "spec_drafts": m.spec_drafts, "spec_draft_tokens": m.spec_draft_tokens,
                "spec_accepted_tokens": m.spec_accepted_tokens}
    return gauges, counters


class _EngineCollector:
    """Reads each engine's counters at scrape time (written by its worker, read here)."""

    def __init__(self, engines: Callable[[], list[tuple[str, Any]]]) -> None:
        self._engines = engines
        self.fresh: dict[str, Any] = {}  # name -> EngineMetrics read on its worker for this scrape

    def collect(self) -> Iterator[Metric]:
        ours = {k: GaugeMetricFamily(n, h, labels=["model"]) for k, (n, _, h) in _GAUGES.items()}
        vllm = {k: GaugeMetricFamily(v, h, labels=["model_name"]) for k, (_, v, h) in _GAUGES.items() if v}
        counters = {k: CounterMetricFamily(n, h, labels=["model"]) for k, (n, _, h) in _COUNTERS.items()}
        theirs = {k: CounterMetricFamily(v, h, labels=["model_name"]) for k, (_, v, h) in _COUNTERS.items() if v}
        positions = [CounterMetricFamily(_PER_POSITION[0], _PER_POSITION[2], labels=["model", "position"]),
                     CounterMetricFamily(_PER_POSITION[1], _PER_POSITION[2], labels=["model_name", "position"])]
        for name, engine in self._engines():
            m = self.fresh.get(name) or engine.metrics
            values = _engine_values(engine, m)
            if values is None:
                continue
            for i, accepted in enumerate(m.spec_accepted_per_position):
                for family in positions:
                    family.add_metric([name, str(i)], accepted)
            for key, value in values[0].items():
                ours[key].add_metric([name], value)
                if key in vllm:
                    vllm[key].add_metric([name], value)
            for key, value in values[1].items():
                counters[key].add_metric([name], value)
                if key in theirs:
                    theirs[key].add_metric([name], value)
        yield from (*ours.values(), *vllm.values(), *counters.values(), *theirs.values(), *positions)


class _ModelCollector:
    """Each served model's life on demand (api/registry.py): loads, unloads by reason, load time, memory."""

    def __init__(self, models: Callable[[], list[Any]]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily("vlmserve_model_loads", "Loads of a model that succeeded, start-up included",
                                    labels=["model"])
        failures = CounterMetricFamily("vlmserve_model_load_failures", "Loads of a model on demand that failed",
                                       labels=["model"])
        unloads = CounterMetricFamily("vlmserve_model_unloads", "Unloads of a model on demand, by why: lru "
                                      "(--max-loaded-models), memory (--memory-budget-gb), idle (--idle-unload-s), "
                                      "request (POST /v1/models/unload)", labels=["model", "reason"])
        seconds = GaugeMetricFamily("vlmserve_model_load_seconds", "Its last load's seconds (load and warm-up)",
                                    labels=["model"])
        loaded = GaugeMetricFamily("vlmserve_model_loaded", "1 while the model is loaded", labels=["model"])
        memory = GaugeMetricFamily("vlmserve_model_memory_bytes", "A loaded model's weights and its KV reservations",
                                   labels=["model"])
        for m in self._models():
            loads.add_metric([m.name], m.loads)
            failures.add_metric([m.name], m.load_failures)
            for reason in ("lru", "memory", "idle", "request"):
                unloads.add_metric([m.name, reason], m.unloads.get(reason, 0))
            seconds.add_metric([m.name], m.load_seconds)
            loaded.add_metric([m.name], 1.0 if m.engine.ready else 0.0)
            memory.add_metric([m.name], m.memory_bytes)
        yield from (loads, failures, unloads, seconds, loaded, memory)


class ServerMetrics:
    """One registry per app, so several apps (tests) never collide."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and the rest, as every Prometheus client has
        self._collectors: tuple[_EngineCollector, MemoryCollector] | tuple[()] = ()
        self.requests = Counter("vlmserve_requests", "Chat requests by final status", ["model", "status"], registry=r)
        self.rejections = Counter("vlmserve_rejected_requests", "Requests answered with an error status, by status "
                                  "and error code", ["status", "code"], registry=r)
        self.ttft = _pair("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS, r)
        self.latency = _pair("request_latency_seconds", "Request latency", _LATENCY_BUCKETS, r,
                             vllm_name="e2e_request_latency_seconds")
        self.itl = _pair("inter_token_latency_seconds", "Time between two output tokens of a request", _TOKEN_BUCKETS, r)
        self.step_time = Histogram("vlmserve_step_duration_seconds", "Duration of each engine step", ["model"],
                                   buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = _pair("prompt_tokens", "Prompt tokens in", None, r)
        self.completion_tokens = _pair("completion_tokens", "Tokens generated", None, r, vllm_name="generation_tokens")
        self.billing_headers = Counter("vlmserve_billing_header_dropped", "Claude Code's x-anthropic-billing-header "
                                       "blocks dropped from system messages (their cch would miss the prefix cache)",
                                       ["model"], registry=r)

    def watch_engines(self, engines: Callable[[], list[tuple[str, Any]]]) -> None:
        self._collectors = (_EngineCollector(engines), MemoryCollector(engines))
        for collector in self._collectors:
            self.registry.register(collector)
        for name, engine in engines():
            self.watch(name, engine)

    def watch(self, name: str, engine: Any) -> None:
        """``engine``'s steps into the step-time histogram (an engine made later, on demand, too)."""
        engine.on_step = lambda m: self.step_time.labels(name).observe(m.last_step_s)

    def watch_models(self, models: Callable[[], list[Any]]) -> None:
        self.registry.register(_ModelCollector(models))

    def tokens_arrived(self, model: str, gap_s: float, count: int) -> None:
        """``count`` tokens of one request arrived ``gap_s`` after its previous ones."""
        for _ in range(count):
            self.itl.observe(model, gap_s / count)

    def finished(self, model: str, status: str, ttft: float | None, latency: float, usage: dict[str, Any]) -> None:
        self.requests.labels(model, status).inc()
        self.latency.observe(model, latency)
        if ttft is not None:
            self.ttft.observe(model, ttft)
        self.prompt_tokens.inc(model, usage.get("prompt_tokens", 0))
        self.completion_tokens.inc(model, usage.get("completion_tokens", 0))

    def rejected(self, status: int, code: str | None) -> None:
        self.rejections.labels(str(status), code or "").inc()

    def render(self, fresh: dict[str, Any] | None = None) -> bytes:
        """The registry's text; ``fresh``: engines' counters read for this scrape (memory_metrics.fresh_counters)."""
        for collector in self._collectors:
            collector.fresh = fresh or {}
        return generate_latest(self.registry)


class _pair:  # noqa: N801 - reads as a metric
    """One quantity under our name and vLLM's: a histogram when given buckets, else a counter."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] | None, registry: CollectorRegistry,
                 vllm_name: str | None = None) -> None:
        vllm = f"vllm:{vllm_name or name}"
        self.ours: Counter | Histogram
        self.theirs: Counter | Histogram
        if buckets is None:
            self.ours = Counter(f"vlmserve_{name}", help, ["model"], registry=registry)
            self.theirs = Counter(vllm, help, ["model_name"], registry=registry)
        else:
            self.ours = Histogram(f"vlmserve_{name}", help, ["model"], buckets=buckets, registry=registry)
            self.theirs = Histogram(vllm, help, ["model_name"], buckets=buckets, registry=registry)

    def observe(self, model: str, value: float) -> None:
        assert isinstance(self.ours, Histogram) and isinstance(self.theirs, Histogram)
        self.ours.labels(model).observe(value)
        self.theirs.labels(model).observe(value)

    def inc(self, model: str, value: float) -> None:
        assert isinstance(self.ours, Counter) and isinstance(self.theirs, Counter)
        self.ours.labels(model).inc(value)
        self.theirs.labels(model).inc(value)
