"""[any] Qwen3-VL MoE recipe: qwen3_vl.py's tokens, template, vision tower and processor, a MoE language model.

Modelled on Qwen/Qwen3-VL-30B-A3B-Instruct (``qwen3_vl_moe``; 235B-A22B has the same architecture): every
language layer a mixture of routed experts (``decoder_sparse_step`` 1, no ``mlp_only_layers``; 128 experts,
top 8 real; 8, top 2 here) chosen per token by a softmax router, renormalized over the chosen ones
(``norm_topk_prob``), with no shared expert; Qwen3 attention (q_norm/k_norm, no biases) with interleaved
M-RoPE; the Qwen3-VL vision tower with DeepStack. ``lm_head`` is untied as in the real checkpoints, except
at micro, where the tied table keeps it under 1 MB.

Chat template: Qwen3-VL-8B-Instruct's, verbatim (chat_templates/qwen3-vl-8b-instruct.jinja, see qwen3_vl.py),
taken to be the one every Qwen3-VL Instruct checkpoint ships: the 30B-A3B's own copy could not be fetched here
to compare. Tools are Hermes JSON, no thinking tags.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .qwen3_vl import (
    DEEPSTACK,
    POSITION_GRID,
    QK_GAIN,
    make_processor,
    model_config,
    plain_tokens,
    qwen_tokens,
    silence_pads,
    text_config,
    vision_config,
)
from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .weights import RESIDUAL_GAIN

# float32 at both sizes: MLX's CPU GatherMM (the experts' matmul) refuses bf16 (mlx 0.32.4, see glm4v_moe.py).
DIMS = {"micro": MICRO, "small": replace(SMALL, dtype="float32")}
# (experts, per token, expert width). Real 30B-A3B: 128, 8, 768 at hidden 2048. small's width 128 is a
# multiple of convert's group of 64, so a 4-bit build quantizes every expert projection.
EXPERTS = {"micro": (8, 2, 16), "small": (8, 2, 128)}


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = qwen_tokens(dims, published_template("qwen3-vl-8b-instruct"))
    config = model_config(dims, tokens, "qwen3_vl_moe", moe_text_config(dims, tokens, EXPERTS[size], size == "micro"))
    config["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    config["vision_config"] = vision_config(dims, "qwen3_vl_moe", POSITION_GRID[size], DEEPSTACK[size])
    return Recipe(
        arch="qwen3_vl_moe",
        dims=dims,
        tokens=tokens,
        config=config,
        make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer), dims),
        fix_init=fix_init,
    )


def moe_text_config(dims: Dims, tokens: Any, experts: tuple[int, int, int], tied: bool) -> dict[str, Any]:
    routed, per_token, width = experts
    return text_config(dims, tokens) | {
        "model_type": "qwen3_vl_moe_text",
        "num_experts": routed,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": tied,
    }


def fix_init(model: nn.Module) -> None:
    """As qwen3_vl.fix_init, the residual gain on the experts' down projections."""
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight = mx.full(norm.weight.shape, QK_GAIN, dtype=norm.weight.dtype)
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        experts = layer.mlp.switch_mlp
        experts.down_proj.weight = experts.down_proj.weight * RESIDUAL_GAIN
    silence_pads(model)
