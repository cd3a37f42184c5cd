"""[main] Frozen configuration and the built-in default model."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DEFAULT_MODEL_NAME = "demo-gemma4"  # the model trained in-repo on shapes (vlmserve/assets/demo-gemma4)
# Package data, so a wheel carries it; installed packages live on disk and mlx_vlm.load wants a path.
DEMO_MODEL_DIR: Path = Path(str(resources.files("vlmserve") / "assets" / DEFAULT_MODEL_NAME))
DEFAULT_PROMPT = "Describe this image."
# How float weights are served: auto (float32 on a Linux CPU with OpenBLAS, else as stored),
# model (as stored), or one dtype. See vlmserve.engine.loader.serving_dtype.
DTYPES = ("auto", "model", "float32", "bfloat16", "float16")
DEFAULT_DTYPE = "auto"
EXIT_USAGE = 2  # the exit status of a command line that cannot run, as argparse's


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


def default_model_path() -> Path:
    """The built-in demo model, package data in ``vlmserve/assets/``; FileNotFoundError (saying
    how to retrain it) when it is missing."""
    if not all((DEMO_MODEL_DIR / name).is_file() for name in ("config.json", "model.safetensors")):
        raise FileNotFoundError(
            f"the demo model is missing from {DEMO_MODEL_DIR} (expected config.json and model.safetensors); "
            f"train it with: vlmserve train-demo --out {DEMO_MODEL_DIR}"
        )
    return DEMO_MODEL_DIR


def resolve_model(spec: str | None) -> tuple[str, str]:
    """``(path_or_hub_id, display name)`` for ``--model``; None means the built-in default."""
    if spec:
        return os.path.expanduser(spec), spec
    return str(default_model_path()), DEFAULT_MODEL_NAME
