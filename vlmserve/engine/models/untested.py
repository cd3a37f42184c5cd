"""[worker] A family no adapter names: served only as mlx-vlm serves one request, until shown otherwise.

Nobody here has tried such a model, so nothing vlmserve adds to mlx-vlm's own call path is assumed to
hold for it: a prompt goes through the language model whole (no chunks, no layer pieces, never batched
with another prompt's prefill), the model keeps whatever per-request state it keeps between calls (M-RoPE
deltas...), and no cache, draft or packed KV is used. The processor sees each image as sent. At start-up
the engine checks the model against mlx-vlm's own prompt and decode (``frontend/self_check.py``): a model
that differs is refused; decode batching stays on only where that check shows it gives the same tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.image_sizes import ProcessorLimit

# What start-up says is off for an untested family, and why (docs/families.md's table says the same).
UNTESTED_OFF = (
    "prompts prefill whole, alone (no chunks or layer pieces, no batched prefill)",
    "the prefix, vision and image-prefix caches are off",
    "speculative decoding and --kv-bits are off",
    "images reach the processor as sent (no decode-time shrinking)",
)


class UntestedAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ()
    chunk_images: ClassVar[bool] = False
    batch_prefill: ClassVar[bool] = False
    reuses_prefix: ClassVar[bool] = False
    mixes_media: ClassVar[bool] = False
    tested: ClassVar[bool] = False

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return None  # a tiling processor cuts tiles from the picture it gets: never shrink it first

    @property
    def packs_kv(self) -> str | None:
        return "an untested family: its attention is not known to read a packed cache"

    @property
    def verifies_drafts(self) -> bool:
        return False

    @property
    def decoder(self) -> Any | None:
        return None  # not split across pipeline ranks: its layers' calls are not known

    @property
    def num_layers(self) -> int:
        return 1  # a prompt is never split by layers either

    def can_chunk(self, prompt: PromptInputs) -> bool:
        return False

    def row_state(self, features: dict[str, Any]) -> dict[str, mx.array]:
        return {}  # whatever the model keeps between calls, as in mlx-vlm's own decode
