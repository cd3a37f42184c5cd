"""[any] Random weights for the offline models: made by mlx-vlm's own classes, repaired, saved.

Runs on whichever thread builds; the model made here is saved and dropped, never served.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_vlm.utils import get_model_and_args, update_module_configs

# Greedy decoding of a plain random init loops on one token and ignores the image; making each
# residual branch several times the residual stream fixes both. ~3x was enough for deeper models
# (shared/FACTS.md); the 2-layer micro ones still looped at 3x and are fine at 4x (measured).
RESIDUAL_GAIN = 4.0
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
_MODULE_CONFIGS = ["text", "vision", "perceiver", "projector", "audio"]


def instantiate(config: dict[str, Any], seed: int) -> nn.Module:
    """Build the model from config.json's dict the way ``mlx_vlm.utils.load_model`` does."""
    config = dict(config)  # the config classes keep references; never share the recipe's
    if "llm_config" in config:  # InternVL's name for the text config, which mlx-vlm's load reads as it
        config["text_config"] = config.pop("llm_config")
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, _MODULE_CONFIGS)
    mx.random.seed(seed)
    return module.Model(model_config)


def set_norm_weights(model: nn.Module, names: Iterable[str], value: float) -> int:
    """Fill the weight of each submodule whose attribute name is in ``names``; return the count."""
    wanted = set(names)
    count = 0
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in wanted and "weight" in module:
            module.weight = mx.full(module.weight.shape, value, dtype=module.weight.dtype)
            count += 1
    return count


def silence_tokens(model: nn.Module, token_ids: Iterable[int], tied: bool = True) -> None:
    """Zero the output rows of ``token_ids`` so their logit is exactly 0 at every step.

    A zero row gives logit 0 while the best of the ~thousands of ordinary random logits is
    positive in practice, so these tokens are never the argmax. An untied (``tied=False``)
    ``lm_head`` has its rows zeroed. Tied models (Gemma: gemma4 has no lm_head at all,
    mlx-vlm's gemma3 loader overwrites any stored one) have only ``embed_tokens``, so its rows
    go: the same rows are the tokens' input embeddings, which become zero vectors. That is harmless for a random
    benchmark model: image tokens are replaced by vision features anyway, and turn markers
    still shift positions and attention. Never use this for tests of EOS handling.
    """
    language = model.language_model
    head = getattr(language, "lm_head", None)
    layer = language.model.embed_tokens if tied or head is None else head
    keep = mx.ones((layer.weight.shape[0], 1), dtype=layer.weight.dtype)
    keep[mx.array(sorted(set(token_ids)))] = 0
    layer.weight = layer.weight * keep


def weight_tensors(model: nn.Module, dtype: str, skip: Iterable[str] = ()) -> dict[str, mx.array]:
    """The parameters in MLX naming, cast to ``dtype``, minus keys the loader re-creates."""
    skipped = set(skip)
    target = getattr(mx, dtype)
    params = dict(tree_flatten(model.parameters()))
    return {k: params[k].astype(target) for k in sorted(params) if k not in skipped}


def save_weights(tensors: dict[str, mx.array], path: Path) -> None:
    mx.eval(tensors)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})


def count_params(tensors: dict[str, mx.array]) -> int:
    return sum(int(v.size) for v in tensors.values())


def write_drafter(model: nn.Module, config: dict[str, Any], out: Path) -> Path:
    """A drafter model's directory as mlx-vlm's ``load_drafter`` reads it: config.json, then its weights
    (written under a temporary name and renamed, so a half-written build is never taken for one)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tmp = out / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), dict(tree_flatten(model.parameters())))
    tmp.rename(out / "model.safetensors")
    return out
