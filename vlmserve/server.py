"""[main] ``vlmserve serve``: engines for every --model, the app, uvicorn, signals and exit codes."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import socket
import sys
import time
from typing import Any

import uvicorn

from vlmserve import __version__
from vlmserve.api.app import create_app, stop_engines
from vlmserve.api.intake import Turns, intake_protocol
from vlmserve.api.registry import Limits, ModelRegistry
from vlmserve.api.state import ServedModel, ServerState, aliases_for
from vlmserve.config import ServeConfig, resolve_model
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.http_protocol import guarded_protocol
from vlmserve.preprocess.decode_budget import DecodeBudget
from vlmserve.preprocess.media import MediaPolicy
from vlmserve.preprocess.pool import RenewablePool
from vlmserve.preprocess.video import VideoSampling

log = logging.getLogger(__name__)
SEND_BUFFER = 64 * 1024  # bytes the kernel buffers per connection toward a client


def build_state(config: ServeConfig) -> ServerState:
    pool = RenewablePool(config.engine.preprocess_threads, "preprocess")
    images = RenewablePool(config.engine.image_threads, "preprocess-images")
    served = []
    # the built-in model when nothing else is asked for; a --model-dir alone serves its models only
    for i, spec in enumerate(config.models or (() if config.model_dirs else (None,))):
        path, name = resolve_model(spec)
        names = config.served_names[i] if i < len(config.served_names) else ()
        aliases = names[1:] if names else aliases_for(path) if spec else ("default",)
        engine = AsyncEngine(path, names[0] if names else name, config.engine, pool, images)
        served.append(ServedModel(engine.name, engine, aliases, config.tool_parser))
    media = MediaPolicy(allowed_dirs=config.allowed_media_dirs, allow_remote=config.allow_remote_images,
                        allowed_domains=config.allowed_media_domains, max_pixels=config.max_image_pixels,
                        max_images=config.max_images, max_videos=config.max_videos, max_audio=config.max_audio,
                        video_sampling=VideoSampling(fps=config.video_fps, max_frames=config.video_max_frames),
                        decoding=DecodeBudget(config.decode_pixels))
    state = ServerState(served, media, config)
    if config.model_dirs:
        found = dataclasses.replace(config.engine, task="auto")  # --task names the --model ones; these say by their files

        def new_engine(path: str, name: str) -> AsyncEngine:
            engine = AsyncEngine(path, name, found, pool, images)
            state.metrics.watch(name, engine)
            return engine

        budget = int(config.memory_budget_gb * 2**30) if config.memory_budget_gb else None
        limits = Limits(config.max_loaded_models, budget, config.idle_unload_s or None)

        def renew_threads() -> None:  # an unloaded model's tokenizers left thread-local caches in phase 1's threads
            pool.renew()
            images.renew()

        state.registry = ModelRegistry(state.models, config.model_dirs, limits, new_engine, renew_threads)
    return state


class _Server(uvicorn.Server):
    """On SIGINT/SIGTERM: stop admitting, give running requests ``shutdown_timeout`` seconds to
    finish, then end the rest with an error event and exit. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.fatal: str | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self.fatal:
            self._exit(sig, frame)  # the second signal: uvicorn forces its exit
            asyncio.get_event_loop().create_task(stop_engines(self.state, "server is shutting down"))
            return
        self.state.draining = True
        in_flight = sum(m.engine.num_in_flight for m in self.state.models)
        log.info("signal %d: draining %d request(s) for at most %.1f s", sig, in_flight, self.shutdown_timeout)
        asyncio.get_event_loop().create_task(self._drain(sig, frame))

    async def _drain(self, sig: int, frame: Any) -> None:
        start = time.monotonic()
        while time.monotonic() - start < self.shutdown_timeout:
            if all(m.engine.num_in_flight == 0 for m in self.state.models):
                break
            await asyncio.sleep(0.05)
        left = sum(m.engine.num_in_flight for m in self.state.models)
        log.info("drained in %.2f s; ending %d request(s) still running", time.monotonic() - start, left)
        await stop_engines(self.state, "server is shutting down")
        self._exit(sig, frame)

    def _exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a drained shutdown exits 0; uvicorn would re-raise the signal

    def fail(self, message: str) -> None:
        self.fatal = message
        self.should_exit = True


def listening_socket(uv_config: uvicorn.Config) -> socket.socket:
    """uvicorn's socket, with what accepted connections inherit from it:

    - a small send buffer: a client that stops reading blocks the server's writes after about
      SEND_BUFFER bytes instead of the megabytes the kernel would buffer, so its request is aborted
      after --stream-stall-timeout, not minutes later (AsyncEngine._abort_stalled);
    - TCP_NODELAY, which uvicorn sets on the sockets it creates itself but not on one handed to it:
      without it a response's body waited for the client's delayed ACK of its headers, 45 ms more
      per keep-alive request (measured, with the openai SDK's httpx).
    """
    family = socket.AF_INET6 if ":" in uv_config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:  # as uvicorn's bind_socket does, but an OSError comes back to the caller (it exits the process)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((uv_config.host, uv_config.port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _no_cancelled_tracebacks(record: logging.LogRecord) -> bool:
    """uvicorn logs its cancelled lifespan task with a traceback when a second Ctrl-C stops the
    server at once: that is the stop asked for, not an error."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, asyncio.CancelledError):
        return False
    text = str(record.msg)  # uvicorn's lifespan logs the formatted traceback as the message
    return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))


def freeze_heap() -> None:
    """Once every model is loaded: what is on the heap now (models, processors, tokenizers) stays for
    the server's life, so the cyclic collector stops walking it (vLLM does the same). A full collection
    that walked it paused every thread, the worker included, for ~60 ms when a burst of requests arrived."""
    gc.collect()
    gc.freeze()


def serve_rank(config: ServeConfig) -> int:
    """One rank of an ``mlx.launch`` group: rank 0 serves HTTP with the model split across every rank
    (engine/pipeline.py); the others hold their layers and follow rank 0's steps until it stops."""
    from vlmserve.engine.pipeline import group

    world = group()
    size, rank = world.size(), world.rank()
    if size == 1:
        return serve(config)
    if len(config.models) > 1:
        print("vlmserve: error: serving across ranks takes one --model", file=sys.stderr)
        return 2
    log.info("pipeline rank %d of %d (pid %d)", rank, size, os.getpid())
    if rank == 0:
        return serve(dataclasses.replace(config, engine=dataclasses.replace(config.engine, pipeline=True)))
    return _follow(config, rank)


def _follow(config: ServeConfig, rank: int) -> int:
    """A rank other than 0: load its slice on its MLX worker, then run rank 0's steps until it says stop."""
    from vlmserve.engine.assembly import load_follower
    from vlmserve.engine.loader import ModelLoadError
    from vlmserve.engine.worker import MLXWorkerThread

    path, name = resolve_model(config.models[0] if config.models else None)
    worker = MLXWorkerThread(name=f"mlx-rank{rank}")
    worker.start()
    try:  # as rank 0 loads its own slice (AsyncEngine)
        runner, follower = worker.call(load_follower, path, name, config.engine)
    except ModelLoadError as exc:
        print(f"vlmserve: error: rank {rank}: {exc}", file=sys.stderr)
        return 1
    try:
        worker.call(follower.follow, runner)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line: which rank, and why
        log.debug("pipeline rank %d stopped", rank, exc_info=True)
        print(f"vlmserve: error: pipeline {follower.stage.describe()}: lost rank 0 or a neighbour ({exc}); stopping",
              file=sys.stderr)
        return 1
    finally:
        worker.shutdown()
    log.info("pipeline %s: rank 0 stopped the group", follower.stage.describe())
    return 0


def _exit_stuck() -> None:
    """A rank hung and rank 0's worker waits in ``recv`` for good: nothing else can stop it. The requests
    already got their errors (engine/pipeline_runner.py's watchdog)."""
    os._exit(1)


def _listing(state: ServerState) -> str:
    """The models, pinned ones by name, those of --model-dir counted by status."""
    pinned = ", ".join(m.name for m in state.pinned) or "no --model"
    if state.registry is None:
        return pinned
    on_demand = [m for m in state.models if not m.pinned]
    usable = sum(m.problem is None for m in on_demand)
    return (f"{pinned}, and {usable} model(s) of --model-dir on demand"
            + (f" ({len(on_demand) - usable} unavailable)" if usable < len(on_demand) else ""))


def serve(config: ServeConfig) -> int:
    """Run until a signal; non-zero exit when a model fails to load."""
    try:
        state = build_state(config)
    except FileNotFoundError as exc:  # the built-in demo model is missing from vlmserve/assets/
        print(f"vlmserve: error: {exc}", file=sys.stderr)
        return 1
    holder: list[_Server] = []
    scheme = "https" if config.ssl_certfile else "http"
    url = f"{scheme}://{config.host}:{config.port}"

    def ready() -> None:
        freeze_heap()
        log.info("vlmserve %s serving %s on %s (the playground: %s/; %s)", __version__, _listing(state), url, url,
                 "an API key is required" if config.api_key else "no API key is required")

    app = create_app(state, on_fatal=lambda message: holder[0].fail(message), on_ready=ready)
    http = intake_protocol(guarded_protocol(config.header_timeout_s), state, Turns())
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=5, access_log=False, http=http,
                               timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]  # a delay
                               ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                               log_config=None)  # uvicorn logs through ours: timestamps, one format
    server = _Server(uv_config, state, config.shutdown_timeout)
    holder.append(server)
    for served in state.models:  # across ranks, a lost rank ends the server (every request gets an error first)
        if config.engine.pipeline:
            served.engine.on_dead, served.engine.on_stuck = server.fail, _exit_stuck
    try:
        sock = listening_socket(uv_config)
    except OSError as exc:
        print(f"vlmserve: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc} "
              "(choose another --port or --host)", file=sys.stderr)
        return 1
    log.info("vlmserve %s loading %s; it will serve on %s once ready", __version__, _listing(state), url)
    logging.getLogger("uvicorn.error").addFilter(_no_cancelled_tracebacks)
    server.run(sockets=[sock])
    if server.fatal:
        print(f"vlmserve: error: {server.fatal}", file=sys.stderr)
        return 1
    return 0

