"""[loop] Models on demand (``--model-dir``): found in folders, listed at once, loaded on first use,
unloaded least recently used or when idle. The ``--model`` ones load at start and stay (pinned).

- **Found.** Each folder right under a DIR is a model, named by the folder; a folder with no
  ``config.json`` whose own folders have one (``DIR/org/name``, as ``huggingface-cli download
  --local-dir`` lays them out) gives one model each, named ``org/name``. Only folders whose real path
  lies under DIR's are ever opened: a link out of DIR, or a folder that is not a model (no
  ``config.json``, one that is not JSON or names no ``model_type``, no ``*.safetensors``), is listed as
  ``unavailable`` with its reason and never loaded. Hidden folders are skipped. DIR is read again when
  the list is asked for and when a name is not found, so a model copied in is served without a restart.
- **Loaded on first use.** A request for a model that is not loaded starts one load, on the model's
  own new worker thread (``AsyncEngine.start``, as at start-up); every request that arrives meanwhile
  waits for that load. One that fails answers each of them with the model's name and why; the next
  request tries again.
- **Unloaded.** Before a load, while ``--max-loaded-models`` or ``--memory-budget-gb`` would be
  exceeded, the least recently used idle model is unloaded. A model with requests in flight (or one
  about to submit) is never unloaded under them: the load waits for one to be idle. A model nobody has
  used for ``--idle-unload-s`` is unloaded too. Unloading stops the engine (its worker joins), drops it,
  and gives the memory back (``engine.memory.give_back``); phase 1's threads are renewed, so that the
  tokenizers' thread-local caches go with the model (preprocess/pool.py).
- **Memory** of a loaded model: its weights as loaded, plus the KV its running requests reserve; of one
  to load, its ``*.safetensors`` files' size until it has loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from vlmserve.api.errors import APIError, first_line
from vlmserve.api.state import ServedModel
from vlmserve.engine.memory import give_back
from vlmserve.frontend.async_engine import AsyncEngine

log = logging.getLogger(__name__)
BUSY_POLL_S = 0.05  # how often a load waiting for room looks again for a model that went idle


@dataclass(slots=True, frozen=True)
class Found:
    """One model folder under a DIR: its name (the model id), its path, and why it cannot be served (or None)."""

    name: str
    path: Path
    problem: str | None = None


@dataclass(slots=True, frozen=True)
class Limits:
    max_loaded: int | None = None  # models loaded at once, pinned ones included
    memory_bytes: int | None = None  # weights plus KV reservations of the loaded models
    idle_unload_s: float | None = None  # an on-demand model unused this long is unloaded


def scan(dirs: Iterable[Path]) -> list[Found]:
    """Every model folder under ``dirs``, in order (a name found twice: the first DIR's)."""
    found: dict[str, Found] = {}
    for root in dirs:
        real = root.resolve()
        for item in _folders(root):
            for one in _models(item, real, item.name):
                found.setdefault(one.name, one)
    return list(found.values())


def _folders(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError:
        return []


def _models(path: Path, root: Path, name: str, nested: bool = False) -> list[Found]:
    if not path.resolve().is_relative_to(root):
        return [Found(name, path, f"{path} links outside its --model-dir; only folders under it are opened")]
    if (path / "config.json").is_file():
        return [Found(name, path, _problem(path))]
    if nested:
        return []
    inner = [m for p in _folders(path) for m in _models(p, root, f"{name}/{p.name}", nested=True)]
    return inner or [Found(name, path, "not a model folder: no config.json")]


def _problem(path: Path) -> str | None:
    """Why ``path`` (with a config.json) cannot be a model, read without loading it; None if it may be."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read: {type(exc).__name__}: {exc}"
    if not isinstance(config, dict) or not config.get("model_type"):
        return "its config.json names no model_type"
    if not any(path.glob("*.safetensors")):
        return "no *.safetensors weights"
    return None


def weights_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


class ModelRegistry:
    """The models of ``--model-dir`` beside the pinned ones: which are loaded, and loading and unloading them."""

    def __init__(self, models: list[ServedModel], dirs: tuple[Path, ...], limits: Limits,
                 new_engine: Callable[[str, str], AsyncEngine], after_unload: Callable[[], object] = lambda: None) -> None:
        self.models = models  # the server's list: pinned first, then what the DIRs hold (updated in place)
        self.dirs = dirs
        self.limits = limits
        self.new_engine = new_engine  # (path, name) -> an engine not started yet
        self.after_unload = after_unload  # called once an unloaded engine is gone (server.py: new phase-1 threads)
        self._room = asyncio.Lock()  # one load at a time makes room and loads
        self._idle: asyncio.Task[None] | None = None
        self.rescan()

    # -- the list ----------------------------------------------------------------------

    def rescan(self) -> None:
        """Read the DIRs again: new folders join the list; a model whose folder went stays until unloaded."""
        known = {m.name for m in self.models}
        for found in scan(self.dirs):
            if found.name in known:
                continue
            engine = self.new_engine(str(found.path), found.name)
            self.models.append(ServedModel(found.name, engine, pinned=False, path=found.path, problem=found.problem))

    # -- use -----------------------------------------------------------------------------

    async def ensure_loaded(self, served: ServedModel) -> None:
        """Return once ``served`` is loaded (loading it, making room first, if it is not); APIError if it
        cannot be. The caller holds a lease on it (``ServedModel.leases``), so it is not unloaded meanwhile."""
        if served.problem is not None:
            raise APIError(400, f"model {served.name!r} cannot be served: {served.problem}", "invalid_request_error",
                           "model", "model_unavailable")
        while not served.engine.ready:
            if served.transition is None or served.transition.done():
                if served.engine.dead_reason is not None:  # unloaded, or died: a fresh engine
                    served.engine = self.new_engine(str(served.path), served.name)
                served.transition = asyncio.create_task(self._load(served))
            try:
                await asyncio.shield(served.transition)
            except APIError:
                raise
            except Exception as exc:  # noqa: BLE001 - the load's own failure, for every waiter
                raise _load_failed(served, exc) from None

    async def _load(self, served: ServedModel) -> None:
        async with self._room:
            await self._make_room(served)
            began = time.perf_counter()
            log.info("model %s: loading on demand from %s", served.name, served.path)
            try:
                await served.engine.start()
            except Exception as exc:
                said = first_line(exc)
                log.error("model %s failed to load: %s", served.name, said)
                served.load_failures += 1
                served.last_error = said
                await served.engine.shutdown(f"model {served.name!r} failed to load: {said}")
                await asyncio.get_running_loop().run_in_executor(None, give_back)
                raise
            served.loads, served.last_error = served.loads + 1, None
            served.load_seconds = time.perf_counter() - began
            served.last_used = time.monotonic()
            log.info("model %s: loaded on demand in %.2f s (%.1f MiB of weights)", served.name, served.load_seconds,
                     served.engine.weights_bytes / 2**20)

    async def _make_room(self, coming: ServedModel) -> None:
        """Unload idle models, least recently used first, until ``coming`` fits the limits; wait for a busy
        one to go idle where none is; APIError where nothing ever could make room."""
        need = weights_on_disk(coming.path) if coming.path is not None else 0
        waited = False
        while self._over(need):
            idle = sorted((m for m in self._unloadable() if m.idle), key=lambda m: m.last_used)
            if idle:
                await self.unload(idle[0], "lru" if self._over_count() else "memory")
                continue
            if not any(self._unloadable()):
                raise APIError(503, f"cannot load model {coming.name!r}: {self._why_over(need)}, and every loaded "
                               "model is pinned", "service_unavailable", "model", "model_budget_exceeded")
            if not waited:
                log.info("model %s: waiting for a loaded model to finish its requests (%s)", coming.name,
                         self._why_over(need))
                waited = True
            await asyncio.sleep(BUSY_POLL_S)

    def _loaded(self) -> list[ServedModel]:
        return [m for m in self.models if m.engine.ready]

    def _unloadable(self) -> list[ServedModel]:
        return [m for m in self._loaded() if not m.pinned]

    def _over_count(self) -> bool:
        most = self.limits.max_loaded
        return most is not None and len(self._loaded()) + 1 > most

    def _over(self, need: int) -> bool:
        budget = self.limits.memory_bytes
        return self._over_count() or (budget is not None and self.memory_bytes() + need > budget
                                      and bool(self._loaded()))

    def _why_over(self, need: int) -> str:
        if self._over_count():
            return f"--max-loaded-models {self.limits.max_loaded} are loaded"
        budget = self.limits.memory_bytes or 0
        return (f"{self.memory_bytes() / 2**30:.2f} GiB loaded + {need / 2**30:.2f} GiB would exceed "
                f"--memory-budget-gb {budget / 2**30:g}")

    def memory_bytes(self) -> int:
        return sum(m.memory_bytes for m in self._loaded())

    async def unload(self, served: ServedModel, reason: str) -> None:
        """Stop ``served``'s engine and give its memory back; it loads again on its next request."""
        assert not served.pinned, "a pinned model never unloads"
        log.info("model %s: unloading (%s): %.1f MiB of weights, idle %.0f s", served.name, _REASONS.get(reason, reason),
                 served.memory_bytes / 2**20, time.monotonic() - served.last_used)
        engine = served.engine
        served.engine = self.new_engine(str(served.path), served.name)  # not started: loads on its next request
        served.unloads[reason] = served.unloads.get(reason, 0) + 1
        began = time.perf_counter()
        await engine.shutdown(f"model {served.name!r} was unloaded")
        engine.forget()
        del engine
        await asyncio.get_running_loop().run_in_executor(None, give_back)
        self.after_unload()
        served.unload_seconds = time.perf_counter() - began
        log.info("model %s: unloaded in %.2f s", served.name, served.unload_seconds)

    async def unload_now(self, served: ServedModel) -> None:
        """``POST /v1/models/unload``: unload ``served`` now if it is loaded and idle; APIError 409 if busy."""
        async with self._room:
            if not served.engine.ready:
                return  # not loaded (a load in progress waits for the lock: it comes after)
            if not served.idle:
                raise APIError(409, f"model {served.name!r} has {served.engine.num_in_flight} request(s) in flight; "
                               "it unloads once idle (or retry then)", "invalid_request_error", "model", "model_busy")
            await self.unload(served, "request")

    # -- idle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.limits.idle_unload_s:
            self._idle = asyncio.create_task(self._unload_idle(self.limits.idle_unload_s))

    async def stop(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            await asyncio.gather(self._idle, return_exceptions=True)

    async def _unload_idle(self, after_s: float) -> None:
        every = min(1.0, after_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for served in self._unloadable():
                if not served.idle:
                    served.last_used = now  # in use: idle from when it stops
                elif now - served.last_used >= after_s and (served.transition is None or served.transition.done()):
                    async with self._room:  # not while a load decides what to unload
                        if served.engine.ready and served.idle:
                            await self.unload(served, "idle")


_REASONS = {"lru": "--max-loaded-models reached; least recently used",
            "memory": "--memory-budget-gb reached; least recently used", "idle": "idle for --idle-unload-s",
            "request": "asked to (POST /v1/models/unload)"}


def _load_failed(served: ServedModel, exc: Exception) -> APIError:
    return APIError(500, f"model {served.name!r} failed to load: {first_line(exc)}", "server_error", "model", "model_load_failed")
