"""[loop] What the app serves: the engines by name, media policy, auth, tool parsers, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from vlmserve.api.billing import BillingHeaderLog
from vlmserve.api.errors import APIError, retry_after
from vlmserve.api.metrics import ServerMetrics
from vlmserve.config import ServeConfig
from vlmserve.frontend.async_engine import AsyncEngine, EngineNotReadyError
from vlmserve.preprocess.media import MediaPolicy

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class ServedModel:
    name: str
    engine: AsyncEngine  # on demand: a fresh one, not started, while unloaded (api/registry.py)
    aliases: tuple[str, ...] = ()
    tool_parser_override: str | None = None
    pinned: bool = True  # given with --model: loaded at start, never unloaded
    path: Path | None = None  # on demand: its folder under a --model-dir
    problem: str | None = None  # on demand: why its folder cannot be served (listed as unavailable)
    transition: asyncio.Task[None] | None = None  # its load on demand, while it runs
    leases: int = 0  # requests between finding it and submitting to it: it is not unloaded under them
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    load_failures: int = 0
    last_error: str | None = None  # its last load on demand failed so: its next request tries again
    load_seconds: float = 0.0  # its last load on demand, start-up included
    unload_seconds: float = 0.0  # its last unload
    unloads: dict[str, int] = field(default_factory=dict)  # by reason: lru, memory, idle, request

    @property
    def tool_parser(self) -> str | None:
        return self.tool_parser_override or self.engine.tool_format

    @property
    def status(self) -> str:
        """``loaded``, ``loading``, ``available`` (loads on its first request) or ``unavailable``."""
        if self.problem is not None:
            return "unavailable"
        if self.engine.ready:
            return "loaded"
        if self.engine.starting and (self.pinned or (self.transition is not None and not self.transition.done())):
            return "loading"
        return "available" if not self.pinned else "failed"

    @property
    def idle(self) -> bool:
        """No request in flight and none about to submit."""
        return self.engine.num_in_flight == 0 and self.leases == 0

    @property
    def memory_bytes(self) -> int:
        """Its weights as loaded and the KV its running requests reserve (0 while not loaded)."""
        if not self.engine.ready:
            return 0
        metrics = self.engine.metrics
        return self.engine.weights_bytes + (metrics.kv_reserved_bytes if metrics is not None else 0)


class Registry(Protocol):
    """What the state asks of the models on demand (api/registry.py's ModelRegistry)."""

    def rescan(self) -> None: ...

    async def ensure_loaded(self, served: ServedModel) -> None: ...

    async def unload_now(self, served: ServedModel) -> None: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class ServerState:
    models: list[ServedModel]
    media: MediaPolicy = field(default_factory=MediaPolicy)
    config: ServeConfig = field(default_factory=ServeConfig)  # api_key, default_max_tokens, body limit, CORS
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    draining: bool = False  # shutting down: no new requests, running ones finish
    registry: Registry | None = None  # the models of --model-dir, on demand (api/registry.py)
    billing_log: BillingHeaderLog = field(default_factory=BillingHeaderLog)  # once per client

    def billing_headers_dropped(self, headers: tuple[str, ...], model: str) -> None:
        """Claude Code's billing blocks dropped from one request: counted, and logged once per client."""
        for header in headers:
            self.metrics.billing_headers.labels(model).inc()
            self.billing_log.dropped(header, model)

    def model(self, name: str) -> ServedModel:
        found = self._find(name)
        if found is None and self.registry is not None:
            self.registry.rescan()  # a folder copied in since
            found = self._find(name)
        if found is None:
            known = ", ".join(m.name for m in self.models)
            raise APIError(404, f"model {name!r} does not exist; this server has: {known}", "not_found_error", "model",
                           "model_not_found")
        return found

    def _find(self, name: str) -> ServedModel | None:
        return next((m for m in self.models if name == m.name or name in m.aliases), None)

    async def acquire(self, name: str | None = None, kind: str | None = "generate") -> ServedModel:
        """The model ``name`` (None: the first of ``kind``), loaded, with a lease on it: ``release`` it once the
        request is submitted (or failed), so that it is never unloaded in between. A model of another kind than
        the endpoint's (``generate``, ``embed``, ``score``; None: any) is a 400 naming both."""
        served = self.model(name) if name else self._first(kind)
        _check_kind(served, kind)
        served.leases += 1
        try:
            if not served.pinned and self.registry is not None:
                await self.registry.ensure_loaded(served)
            if not served.engine.ready:
                _not_ready(served.engine)
        except BaseException:
            self.release(served)
            raise
        return served

    def _first(self, kind: str | None) -> ServedModel:
        return next((m for m in self.models if kind in (None, m.engine.kind)), None) or \
            (self.models[0] if self.models else self.model(""))

    def release(self, served: ServedModel) -> None:
        served.leases -= 1
        served.last_used = time.monotonic()

    @asynccontextmanager
    async def using(self, name: str | None, kind: str | None = "generate") -> AsyncIterator[ServedModel]:
        """``acquire`` for the block's length."""
        served = await self.acquire(name, kind)
        try:
            yield served
        finally:
            self.release(served)

    async def holding(self, served: ServedModel, body: AsyncIterator[T]) -> AsyncIterator[T]:
        """``body`` (a response's stream), then the lease on ``served`` is released, however it ends."""
        try:
            async for item in body:
                yield item
        finally:
            self.release(served)

    @property
    def pinned(self) -> list[ServedModel]:
        return [m for m in self.models if m.pinned]

    @property
    def ready(self) -> bool:
        """Every pinned model serves (the on-demand ones load when asked), and there is a model to serve."""
        serves = bool(self.pinned) or self.registry is not None
        return serves and not self.draining and all(m.engine.ready for m in self.pinned)


_SERVES = {"generate": "chat and completions", "embed": "/v1/embeddings", "score": "/v1/rerank"}
_KIND_NAMES = {"generate": "a generative (chat)", "embed": "an embedding", "score": "a reranker (score)"}


def _check_kind(served: ServedModel, kind: str | None) -> None:
    """A request to a model of another kind: 400, naming the model's kind and what it serves."""
    if kind is None or served.engine.kind == kind:
        return
    has = served.engine.kind
    raise APIError(400, f"model {served.name!r} is {_KIND_NAMES[has]} model: it serves {_SERVES[has]}, not "
                   f"{_SERVES[kind]}", "invalid_request_error", "model", "wrong_model_kind")


def _not_ready(engine: AsyncEngine) -> None:
    """A model that cannot serve now (a pinned one loading, or dead): the 503 its requests get."""
    try:
        engine.check_ready()
    except EngineNotReadyError as exc:
        raise APIError(503, str(exc), "service_unavailable", None, "not_ready", retry_after(exc.retry_after_s)) from None


def aliases_for(spec: str) -> tuple[str, ...]:
    """A local directory also answers to its base name (``/models/foo`` -> ``foo``)."""
    name = Path(spec).name
    return (name,) if name and name != spec else ()
