"""[main] ``vlmserve serve``: engines for every --model, the app, uvicorn, signals and exit codes."""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from vlmserve.api.app import create_app, stop_engines
from vlmserve.api.state import ServedModel, ServerState, aliases_for
from vlmserve.config import DEFAULT_DTYPE, resolve_model
from vlmserve.engine.core import EngineConfig
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.preprocess.media import MediaPolicy

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ServeConfig:
    models: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int = 8
    max_queue: int = 64
    allowed_media_dirs: tuple[Path, ...] = ()
    allow_remote_images: bool = False
    tool_parser: str | None = None
    prefix_cache: bool = True
    default_max_tokens: int = 512
    max_model_len: int | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    log_level: str = "info"
    dtype: str = DEFAULT_DTYPE


def build_state(config: ServeConfig) -> ServerState:
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="preprocess")
    engine_config = EngineConfig(max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                 prefix_cache=config.prefix_cache, max_model_len=config.max_model_len,
                                 dtype=config.dtype)
    served = []
    for spec in config.models or (None,):
        path, name = resolve_model(spec)
        engine = AsyncEngine(path, name, engine_config, pool)
        served.append(ServedModel(name, engine, aliases_for(path) if spec else ("default",), config.tool_parser))
    media = MediaPolicy(allowed_dirs=config.allowed_media_dirs, allow_remote=config.allow_remote_images)
    return ServerState(served, media, config.api_key, config.default_max_tokens, config.max_request_bytes)


class _Server(uvicorn.Server):
    """On SIGINT/SIGTERM, end in-flight streams with an error at once instead of waiting them out."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.fatal: str | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        asyncio.get_event_loop().create_task(stop_engines(self.state, "server is shutting down"))

    def fail(self, message: str) -> None:
        self.fatal = message
        self.should_exit = True


def serve(config: ServeConfig) -> int:
    """Run until a signal; non-zero exit when a model fails to load."""
    try:
        state = build_state(config)
    except FileNotFoundError as exc:  # the built-in demo model is missing from vlmserve/assets/
        print(f"vlmserve: error: {exc}", file=sys.stderr)
        return 1
    holder: list[_Server] = []
    app = create_app(state, on_fatal=lambda message: holder[0].fail(message))
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=5, access_log=False)
    server = _Server(uv_config, state)
    holder.append(server)
    server.run()
    if server.fatal:
        print(f"vlmserve: error: {server.fatal}", file=sys.stderr)
        return 1
    return 0

