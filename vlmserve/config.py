"""[main] Frozen configuration and the built-in default model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Until the trained demo model lands, the default is the offline builder's random-weight gemma4.
DEFAULT_ARCH = "gemma4"
DEFAULT_SIZE = "small"
DEFAULT_PROMPT = "Describe this image."


@dataclass(slots=True, frozen=True)
class CaptionConfig:
    image: Path
    model: str | None
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None


def default_model_path() -> Path:
    """Build (once, cached) and return the built-in default model; prints progress to stderr."""
    from vlmserve.testing import build_model

    return build_model(DEFAULT_ARCH, DEFAULT_SIZE)


def resolve_model(spec: str | None) -> tuple[str, str]:
    """``(path_or_hub_id, display name)`` for ``--model``; None means the built-in default."""
    if spec:
        return os.path.expanduser(spec), spec
    return str(default_model_path()), f"vlmserve-default ({DEFAULT_ARCH}-{DEFAULT_SIZE}, random weights)"
