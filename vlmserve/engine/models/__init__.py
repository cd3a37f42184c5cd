"""[worker] Model adapters: one default for what most mlx-vlm families share, one module per
family only where it differs (cache, embedding call, per-row decode state, chunking, tools).

    adapter = adapter_for(model, "qwen2_5_vl")
"""

from __future__ import annotations

import mlx.nn as nn

from vlmserve.engine.models.base import Embedded, ModelAdapter
from vlmserve.engine.models.gemma import Gemma3Adapter, Gemma4Adapter, PaliGemmaAdapter
from vlmserve.engine.models.glm import GLMAdapter, GLMMoEAdapter
from vlmserve.engine.models.internvl import InternVLAdapter
from vlmserve.engine.models.kimi_vl import KimiVLAdapter
from vlmserve.engine.models.lfm2_vl import LFM2VLAdapter
from vlmserve.engine.models.llama4 import Llama4Adapter
from vlmserve.engine.models.llava import LlavaAdapter, LlavaNextAdapter
from vlmserve.engine.models.mistral import MistralAdapter
from vlmserve.engine.models.qwen import MRoPEAdapter, Qwen3VLAdapter, Qwen3VLMoEAdapter
from vlmserve.engine.models.smolvlm import SmolVLMAdapter
from vlmserve.engine.models.untested import UNTESTED_OFF, UntestedAdapter

_ADAPTERS: tuple[type[ModelAdapter], ...] = (
    Gemma3Adapter, Gemma4Adapter, PaliGemmaAdapter, MRoPEAdapter, Qwen3VLAdapter, MistralAdapter, LlavaAdapter,
    LlavaNextAdapter, SmolVLMAdapter, LFM2VLAdapter, GLMAdapter, GLMMoEAdapter, Llama4Adapter,
    KimiVLAdapter, InternVLAdapter, Qwen3VLMoEAdapter,
)  # fmt: skip

# Every family with an adapter is tested here; others go through the untested one (engine/models/untested.py).
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(sorted({t for a in _ADAPTERS for t in a.model_types}))


class UnsupportedModelError(RuntimeError):
    """An architecture no adapter serves and the default cannot."""


def adapter_class(model_type: str) -> type[ModelAdapter] | None:
    """The adapter of a supported family (None: untested); its class facts need no model."""
    return next((a for a in _ADAPTERS if model_type in a.model_types), None)


def adapter_for(model: nn.Module, model_type: str) -> ModelAdapter:
    """The family's adapter; for a family none names, the untested one (mlx-vlm's own call path, checked
    against mlx-vlm's decode at start-up), where mlx-vlm's model has the parts it calls."""
    adapter = adapter_class(model_type)
    if adapter is not None:
        return adapter(model)
    if getattr(model, "language_model", None) is None or not hasattr(model, "get_input_embeddings"):
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: mlx-vlm's model has no language_model "
            f"or get_input_embeddings; tested families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return UntestedAdapter(model)


__all__ = ["SUPPORTED_FAMILIES", "UNTESTED_OFF", "Embedded", "ModelAdapter", "UnsupportedModelError", "adapter_class",
           "adapter_for"]
