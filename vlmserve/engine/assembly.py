"""[worker] A model as the engine serves it, loaded on the worker: the one place that turns a model path and an
``EngineConfig`` into a ``LoadedModel`` (and, across ranks, this rank's ``Stage``).

``AsyncEngine`` (rank 0, or the only rank) and ``vlmserve serve``'s other ranks both load through here: the
process's BLAS and thread settings, the model (whole, or this rank's slice), its drafter for speculative
decoding, the context cap, and the KV quantization the family allows (or why not).
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.kv_quant import kv_quant_for
from vlmserve.engine.loader import LoadedModel, configure_process, load_drafter, load_model
from vlmserve.engine.pipeline import Stage, load_stage


@dataclass(slots=True)
class Assembled:
    loaded: LoadedModel
    stage: Stage | None = None  # this rank's layers, when served across ranks
    kv_quant_off: str | None = None  # why --kv-bits is off for this model, where it was asked for


def load_for_serving(spec: str, name: str | None, config: EngineConfig) -> Assembled:
    """Load ``spec`` on the calling thread (the worker: its weights become that thread's arrays) as ``config``
    serves it. ModelLoadError when it cannot be."""
    configure_process()
    stage = None
    if config.pipeline:
        loaded, stage = load_stage(spec, name, config.dtype, config.trust_remote_code)
    else:
        loaded = load_model(spec, name, config.dtype, config.trust_remote_code)
    if config.speculative is not None and config.speculative.drafter:
        loaded.drafter = load_drafter(config.speculative, loaded, config.pipeline)
    if config.max_model_len:
        loaded.max_context = min(loaded.max_context, config.max_model_len)
    adapter = loaded.adapter
    reads_target = loaded.drafter is not None and not loaded.drafter.reads_prompt  # Gemma 4's assistant
    adapter.kv_quant, off = kv_quant_for(adapter.make_cache(), config.kv_bits, config.kv_group_size,
                                         config.quantized_kv_start, adapter.packs_kv, reads_target, config.pipeline)
    return Assembled(loaded, stage, off)
