"""[main] Frozen configuration and the built-in default model.

Each default is written once, as a field of these dataclasses (and of ``EngineConfig``); the CLI's
flags and help read them from there (``field_default``).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from vlmserve.engine.engine_config import DEFAULT_DTYPE, DTYPES, EngineConfig
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.preprocess.images import DEFAULT_MAX_PIXELS
from vlmserve.preprocess.media import DEFAULT_DECODE_PIXELS

DEFAULT_MODEL_NAME = "demo-gemma4"  # the model trained in-repo on shapes (vlmserve/assets/demo-gemma4)
# Package data, so a wheel carries it; installed packages live on disk and mlx_vlm.load wants a path.
DEMO_MODEL_DIR: Path = Path(str(resources.files("vlmserve") / "assets" / DEFAULT_MODEL_NAME))
# Its drafter (a Gemma 4 assistant trained in-repo: ``vlmserve train-demo-drafter``), by this name in --draft-model
DEMO_DRAFTER_NAME = "demo-gemma4-assistant"
DEMO_DRAFTER_DIR: Path = Path(str(resources.files("vlmserve") / "assets" / DEMO_DRAFTER_NAME))
DEFAULT_PROMPT = "Describe this image."
EXIT_USAGE = 2  # the exit status of a command line that cannot run, as argparse's


__all__ = ["DEFAULT_DTYPE", "DTYPES", "CaptionConfig", "EngineConfig", "ServeConfig", "SpeculativeConfig", "field_default",
           "param_default", "usage_error"]


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: the one place each default is written."""
    for f in fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def param_default(func: Callable[..., Any], name: str) -> Any:
    """The default of ``func``'s parameter ``name``, for a command whose defaults live in a signature."""
    default = inspect.signature(func).parameters[name].default
    assert default is not inspect.Parameter.empty, f"{func.__name__}({name}) has no default"
    return default


def usage_error(message: str) -> int:
    """Say what is wrong with the command line, in one line; returns the exit status."""
    print(f"vlmserve: error: {message}", file=sys.stderr)
    return EXIT_USAGE


@dataclass(slots=True, frozen=True)
class CaptionConfig:
    image: Path
    model: str | None
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    dtype: str = DEFAULT_DTYPE


@dataclass(slots=True, frozen=True)
class ServeConfig:
    """What ``vlmserve serve`` runs: the server's own settings, and every model's engine's."""

    models: tuple[str, ...] = ()
    served_names: tuple[tuple[str, ...], ...] = ()  # per model, in order: the names it answers to (the first shown)
    # Models on demand (api/registry.py): every model folder under these, loaded on its first request
    model_dirs: tuple[Path, ...] = ()
    max_loaded_models: int | None = None  # loaded at once, --model ones included; the least recently used unloads
    memory_budget_gb: float | None = None  # loaded models' weights and KV reservations, at most
    idle_unload_s: float = 300.0  # a model of --model-dir unused this long unloads (0: never), as Ollama's keep_alive
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_media_dirs: tuple[Path, ...] = ()
    allow_remote_images: bool = False
    allowed_media_domains: tuple[str, ...] = ()
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # larger images get 400 before they are decoded
    max_images: int = 8  # images in one request (--limit-mm-per-prompt)
    max_videos: int = 1  # videos in one request (--limit-mm-per-prompt)
    max_audio: int = 4  # input_audio clips in one request (--limit-mm-per-prompt)
    video_fps: float = 2.0  # frames sampled per second of a video, unless a request says
    video_max_frames: int = 32  # frames sampled from one video at most; a request may ask for fewer
    decode_pixels: int = DEFAULT_DECODE_PIXELS  # image pixels being decoded at once, server-wide
    tool_parser: str | None = None
    default_max_tokens: int = 512  # max_tokens when a request gives none
    max_request_bytes: int = 64 << 20  # larger request bodies get 413
    log_level: str = "info"
    shutdown_timeout: float = 5.0  # seconds running requests get to finish after SIGTERM
    header_timeout_s: float = 10.0  # a new connection's first request headers, or it is closed (slowloris)
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this long
    cors_origins: tuple[str, ...] = ()
    ssl_keyfile: Path | None = None  # with ssl_certfile: serve HTTPS
    ssl_certfile: Path | None = None
    # Chat-template variables for every request (a request's chat_template_kwargs win), e.g. enable_thinking.
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)


def default_model_path() -> Path:
    """The built-in demo model, package data in ``vlmserve/assets/``; FileNotFoundError (saying
    how to retrain it) when it is missing."""
    if not all((DEMO_MODEL_DIR / name).is_file() for name in ("config.json", "model.safetensors")):
        raise FileNotFoundError(
            f"the demo model is missing from {DEMO_MODEL_DIR} (expected config.json and model.safetensors); "
            f"train it with: vlmserve train-demo --out {DEMO_MODEL_DIR}"
        )
    return DEMO_MODEL_DIR


def resolve_drafter(spec: str) -> str:
    """A drafter's path or Hub id: the demo model's drafter by its name, else ``spec`` (``~`` expanded)."""
    return str(DEMO_DRAFTER_DIR) if spec == DEMO_DRAFTER_NAME else os.path.expanduser(spec)


def resolve_model(spec: str | None) -> tuple[str, str]:
    """``(path_or_hub_id, display name)`` for ``--model``; None means the built-in default."""
    if spec:
        return os.path.expanduser(spec), spec
    return str(default_model_path()), DEFAULT_MODEL_NAME
