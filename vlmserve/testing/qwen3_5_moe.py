"""[any] Qwen3.5/3.6 MoE recipe: qwen3_5.py's hybrid model with a mixture of experts in every layer.

Modelled on Qwen/Qwen3.6-35B-A3B and Qwen/Qwen3.5-35B-A3B (``qwen3_5_moe``; Qwen3.5-122B-A10B has the same
architecture): qwen3_5.py's Gated DeltaNet and gated full-attention layers (three to one real, one to one
at micro), each followed by routed experts (256, top 8 real; 8, top 2 here) chosen per token by a softmax
router renormalized over the chosen ones, plus a shared expert scaled by a sigmoid gate
(``shared_expert_gate``). The real text config has no ``intermediate_size``, so neither has this one. The
vision tower, processor and special tokens are qwen3_5.py's; ``lm_head`` is untied.

Chat template: Qwen/Qwen3.5-35B-A3B's, verbatim (chat_templates/qwen3.5-35b-a3b.jinja, see qwen3_5.py), a
``qwen3_5_moe`` checkpoint's own. Qwen3.6-35B-A3B's, as copies elsewhere show it, adds a ``preserve_thinking``
switch (past turns keep their thinking) and writes non-string tool arguments as JSON; no verbatim copy whose
provenance could be checked was found here (Unsloth's re-distribution carries fixes of its own), so it is not
used. Tools are Qwen3-Coder-style XML after the reasoning.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.nn as nn

from . import qwen3_5
from .qwen3_5 import hybrid_recipe, text_config
from .recipe import MICRO, SMALL, Dims, Recipe

# float32 at both sizes: MLX's CPU GatherMM (the experts' matmul) refuses bf16 (mlx 0.32.4, see glm4v_moe.py).
DIMS = {"micro": MICRO, "small": replace(SMALL, layers=8, dtype="float32")}
# (experts, per token, expert width, shared expert width). Real 35B-A3B: 256, 8, 512, 512 at hidden 2048.
# small's widths are multiples of convert's group of 64, so a 4-bit build quantizes every expert projection.
EXPERTS = {"micro": (8, 2, 16, 16), "small": (8, 2, 64, 64)}


def recipe(size: str) -> Recipe:
    def text(dims: Dims, tokens: Any, interval: int, linear: tuple[int, int, int]) -> dict[str, Any]:
        return moe_text_config(dims, tokens, interval, linear, EXPERTS[size])

    return hybrid_recipe("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", size, DIMS[size], text, fix_init)


def moe_text_config(
    dims: Dims, tokens: Any, interval: int, linear: tuple[int, int, int], experts: tuple[int, int, int, int]
) -> dict[str, Any]:
    routed, per_token, width, shared = experts
    text = text_config(dims, tokens, interval, linear)
    del text["intermediate_size"]  # as the real config: every layer's MLP is the expert block
    return text | {
        "model_type": "qwen3_5_moe_text",
        "num_experts": routed,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": True,
    }


def fix_init(model: nn.Module) -> None:
    """As qwen3_5.fix_init, the residual gain on the routed and shared experts' down projections."""
    qwen3_5.fix_init(model, lambda mlp: (mlp.switch_mlp.down_proj, mlp.shared_expert.down_proj))
