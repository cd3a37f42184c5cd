"""[any] GLM-4.5V / GLM-4.6V recipe: glm4v.py's tokens, template, vision tower and processor, a MoE language model.

Modelled on zai-org/GLM-4.5V (``glm4v_moe``; GLM-4.6V has the same architecture): the first layer
dense (``first_k_dense_replace`` 1), the others a mixture of routed experts (``n_routed_experts`` 128
real, 8 here; top 8 real, top 2 here) chosen per token by sigmoid scores with a correction bias
(``noaux_tc``, one group) plus one shared expert; attention with q/k/v biases and rotary on half of
each head (``partial_rotary_factor`` 0.5) in M-RoPE sections; no qk-norm (``use_qk_norm`` false, as
real); pre-norm blocks with no post-branch norms (unlike GLM-4.1V).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .glm4v import (
    PARTIAL_ROTARY,
    POSITION_GRID,
    fix_init,
    glm_tokens,
    make_processor,
    model_config,
    plain_tokens,
    text_config,
)
from .recipe import MICRO, SMALL, Dims, Recipe

# small: 8 experts of width 256 in 5 of 6 layers keeps it within 5-20 M parameters. float32, not the real bf16:
# MLX's CPU GatherMM (the experts' matmul) raises "Currently only supports float32" on bf16 (mlx 0.32.4, measured).
DIMS = {"micro": MICRO, "small": replace(SMALL, intermediate=512, dtype="float32")}
EXPERTS = {"micro": (8, 2, 16), "small": (8, 2, 256)}  # (routed experts, per token, expert width)


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = glm_tokens(dims)
    config = model_config(dims, tokens, "glm4v_moe", moe_text_config(dims, tokens, EXPERTS[size]), POSITION_GRID[size])
    config["architectures"] = ["Glm4vMoeForConditionalGeneration"]
    return Recipe(arch="glm4v_moe", dims=dims, tokens=tokens, config=config,
                  make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer), dims),
                  fix_init=fix_init)


def moe_text_config(dims: Dims, tokens: Any, experts: tuple[int, int, int]) -> dict[str, Any]:
    routed, per_token, width = experts
    text = text_config(dims, tokens)
    text |= {
        "model_type": "glm4v_moe_text",
        "moe_intermediate_size": width,
        "n_routed_experts": routed,
        "num_experts_per_tok": per_token,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "use_qk_norm": False,
        "partial_rotary_factor": PARTIAL_ROTARY,
        "max_position_embeddings": 65536,
    }
    return text
