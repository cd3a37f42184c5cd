"""[any] What one architecture at one size needs: dimensions, tokens, config, processor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .tokenizer import TokenizerSpec


@dataclass(frozen=True, slots=True)
class Dims:
    """Model dimensions for one size; the vision side is sized for one square image."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    patch: int
    image_size: int  # side in px of a square image after the processor's resize
    image_tokens: int  # soft tokens one square image becomes
    dtype: str  # "float32" or "bfloat16", as saved on disk
    # Gemma 4: the soft-token budget of one picture (0: image_tokens). Its processor floors each
    # side to a whole token, so with a budget of exactly a square's 3 x 3, a canvas a little wider
    # than tall became 2 x 3; 12 keeps a square at 3 x 3 and gives a 4:3 picture 3 x 4
    image_budget: int = 0


# The standard sizes; a family changes only what its architecture needs (``dataclasses.replace``).
# micro: float32, < 1 MB, for fast tests. small: bfloat16 like real checkpoints, and on the
# stock mlx-cpu wheel bf16 matmuls beat its reference float32 BLAS (see shared/FACTS.md).
MICRO = Dims(
    vocab=768, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128,
    vision_hidden=32, vision_layers=1, vision_heads=2, vision_intermediate=64,
    patch=8, image_size=64, image_tokens=16, dtype="float32",
)  # fmt: skip
SMALL = Dims(
    vocab=4096, hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64, intermediate=1024,
    vision_hidden=128, vision_layers=2, vision_heads=4, vision_intermediate=512,
    patch=16, image_size=224, image_tokens=49, dtype="bfloat16",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Recipe:
    """Everything build.py needs for one (arch, size); the callables run only when building."""

    arch: str
    dims: Dims
    tokens: TokenizerSpec
    config: dict[str, Any]  # config.json: exactly what mlx_vlm.load reads
    make_processor: Callable[[Any], Any]  # tokenizer -> processor with save_pretrained
    fix_init: Callable[[Any], None]  # arch-specific repairs of the random init (an nn.Module)
    skip_weights: tuple[str, ...] = ()  # parameters the loader re-creates, not worth storing

    @property
    def tied_embeddings(self) -> bool:
        text = self.config.get("text_config") or {}
        return bool(text.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))

    @property
    def eos_ids(self) -> list[int]:
        return list(self.config["eos_token_id"])
