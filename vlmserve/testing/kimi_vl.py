"""[any] Kimi-VL recipe: a DeepSeek-V3-style MoE language model with MLA attention, MoonViT, mlx-vlm's KimiVLProcessor.

Modelled on moonshotai/Kimi-VL-A3B-Instruct and -Thinking (``kimi_vl``): multi-head latent attention (keys
and values from one compressed ``kv_lora_rank`` latent, rotary on a ``qk_rope_head_dim`` slice shared by
every head, no ``q_lora_rank`` as real), the first layer dense (``first_k_dense_replace`` 1), the others
routed experts (64 real, 8 here; top 6 real, top 2 here) chosen per token by sigmoid scores with a
correction bias (``noaux_tc``, one group), plus 2 shared experts. MoonViT: native-resolution patches of
14 px, learned position embeddings interpolated to each grid, 2D rotary positions, a 2x2 patch merger,
then the projector. An image is ``<|media_start|>image<|media_content|>`` + ``<|media_pad|>`` per merged
patch + ``<|media_end|>``. Special tokens carry the real names; no BOS reaches a prompt (the real tokenizer
names ``[BOS]`` but neither it nor the template writes it: it is left unnamed here); generation ends at
``[EOS]`` or ``<|im_end|>``.

Chat template: Moonshot's own, verbatim: moonshotai/Kimi-K2-Instruct-0905's ``chat_template.jinja``
(chat_templates/kimi-k2-instruct-0905.jinja), as quoted whole in the public docs of storyforge
(``02 — Jinja Template Renderer``). It writes Kimi-VL's image markup exactly as Kimi-VL's template does
and Kimi's tool syntax: tools in a ``tool_declare`` system turn, calls as
``<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>{json}<|tool_call_end|>``
``<|tool_calls_section_end|>`` with ``ID`` ``functions.NAME:IDX``. Kimi-VL-A3B's own template
(chat_templates/kimi-vl-a3b-instruct.jinja, quoted whole as the "official Kimi-VL chat template" in the
public OpenCUA vLLM fork) writes no tools at all: served with it, vlmserve writes Hermes tools itself.
Kimi-VL-Thinking writes ``◁think▷...◁/think▷`` as plain text (not special tokens).

The processor is mlx-vlm's ``KimiVLProcessor`` around its ``KimiVLImageProcessor``. ``mlx_vlm.load``
rebuilds the image processor from defaults (patch 14, ``in_token_limit`` 4096, merge 2x2: the real
ones), so the vision tower keeps the real patch size at both sizes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec, unmark_special
from .weights import RESIDUAL_GAIN, silence_tokens

SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
    "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>",
    "<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)  # fmt: skip
# Decoded as text even when skipping specials, so that tool calls reach their parser.
PLAIN_TOKENS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>")
ROLES = {"eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
NAMED_TOKENS = {"image_token": "<|media_pad|>"}
EOS_TOKENS = ("[EOS]", "<|im_end|>")

PATCH = 14  # the processor's, whatever the config says (see the module docstring)
MERGE = 2
QK_GAIN = 3.0  # on q_proj and the latent's norm: sharper attention, as glm4v's fix_init
GATE_SCALE = 0.5  # the router's weights start at zero in mlx-vlm: every token would pick the same experts
# micro: 84 px is 6x6 patches, 3x3 = 9 tokens; small: 224 px is 16x16 patches, 64 tokens.
DIMS = {
    "micro": replace(MICRO, patch=PATCH, image_size=84, image_tokens=9),
    "small": replace(SMALL, patch=PATCH, image_size=224, image_tokens=64, intermediate=512),
}
EXPERTS = {"micro": (8, 2, 16), "small": (8, 2, 192)}  # (routed experts, per token, expert width)
# MLA: (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim); real (512, 128, 64, 128)
LATENT = {"micro": (32, 16, 16, 32), "small": (128, 32, 32, 64)}
POSITION_GRID = {"micro": 8, "small": 16}  # the learned position table's side (real 64)


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = TokenizerSpec(vocab_size=dims.vocab, special_tokens=SPECIAL_TOKENS, roles=ROLES, named=NAMED_TOKENS,
                           chat_template=published_template("kimi-k2-instruct-0905"))
    config = model_config(dims, tokens, size)
    return Recipe(arch="kimi_vl", dims=dims, tokens=tokens, config=config,
                  make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer)), fix_init=fix_init)


def text_config(dims: Dims, tokens: TokenizerSpec, size: str) -> dict[str, Any]:
    routed, per_token, width = EXPERTS[size]
    rank, nope, rope, v_dim = LATENT[size]
    return {
        "model_type": "deepseek_v3",
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "moe_intermediate_size": width,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.heads,
        "n_shared_experts": 2,
        "n_routed_experts": routed,
        "num_experts_per_tok": per_token,
        "routed_scaling_factor": 2.446,
        "kv_lora_rank": rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_dim,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 800000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tokens.id_of("[BOS]"),
        "eos_token_id": tokens.id_of("[EOS]"),
        "pad_token_id": tokens.id_of("[PAD]"),
    }


def vision_config(dims: Dims, size: str) -> dict[str, Any]:
    grid = POSITION_GRID[size]
    return {
        "model_type": "moonvit",
        # the real config's names, and mlx-vlm's for the same (its VisionConfig reads depth/num_heads/embed_dim)
        "num_hidden_layers": dims.vision_layers, "depth": dims.vision_layers,
        "num_attention_heads": dims.vision_heads, "num_heads": dims.vision_heads,
        "hidden_size": dims.vision_hidden, "embed_dim": dims.vision_hidden,
        "intermediate_size": dims.vision_intermediate,
        "patch_size": PATCH,
        "init_pos_emb_height": grid,
        "init_pos_emb_width": grid,
        "merge_kernel_size": [MERGE, MERGE],
    }


def model_config(dims: Dims, tokens: TokenizerSpec, size: str) -> dict[str, Any]:
    return {
        "model_type": "kimi_vl",
        "architectures": ["KimiVLForConditionalGeneration"],
        "text_config": text_config(dims, tokens, size),
        "vision_config": vision_config(dims, size),
        "media_placeholder_token_id": tokens.id_of("<|media_pad|>"),
        "image_token_index": tokens.id_of("<|media_pad|>"),  # mlx-vlm's name for the same
        "vocab_size": dims.vocab,
        "ignore_index": -100,
        "tie_word_embeddings": False,
        "bos_token_id": tokens.id_of("[BOS]"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("[PAD]"),
        "torch_dtype": dims.dtype,
    }


def plain_tokens(tokenizer: Any) -> Any:
    """The tokenizer with PLAIN_TOKENS marked non-special, as in the real tokenizer.json."""
    return unmark_special(tokenizer, PLAIN_TOKENS)


def make_processor(tokenizer: Any) -> Any:
    from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor, KimiVLProcessor

    image_processor = KimiVLImageProcessor(patch_size=PATCH, merge_kernel_size=[MERGE, MERGE])
    return KimiVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def fix_init(model: nn.Module) -> None:
    """The residual gain on each branch's last projections (o_proj, every down_proj: dense, shared and
    routed experts'), sharper attention (MLA has no q/k norms to carry a gain: q_proj and the latent's
    norm, which scales the keys and values it makes), a random router (mlx-vlm starts it at zero, so every
    token would take the same experts) and random position embeddings (mlx-vlm starts them at one)."""
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * QK_GAIN
        attn.kv_a_layernorm.weight = attn.kv_a_layernorm.weight * QK_GAIN
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        for name, module in layer.mlp.named_modules():
            if name.rsplit(".", 1)[-1] == "down_proj":
                module.weight = module.weight * RESIDUAL_GAIN
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight = mx.random.normal(gate.weight.shape) * GATE_SCALE
    pos = model.vision_tower.patch_embed.pos_emb
    pos.weight = mx.random.normal(pos.weight.shape) * 0.02
    pads = [SPECIAL_TOKENS.index(t) for t in ("<|media_pad|>", "<|media_start|>", "<|media_content|>")]
    silence_tokens(model, pads, tied=False)
