"""[any] Qwen3-VL recipe: tokens, config.json, mlx-vlm's Qwen3VLProcessor, init repairs.

Modelled on Qwen/Qwen3-VL-2B/4B-Instruct: a Qwen3 language model (q_norm/k_norm, no biases,
tied embeddings like the 2B and 4B) with interleaved M-RoPE, a ViT with learned position
embeddings and 2D rotary positions, a 2x2 patch merger, and DeepStack: the features of chosen
vision layers are added to the hidden states of the first language layers at the image
positions. ``temporal_patch_size`` 2: a still image is two identical frames.

Special tokens are the real ones in the real order (``<|endoftext|>`` .. ``</think>``, ids
151643.. in the real vocabulary, 0.. here). As in the real tokenizer, the tool, FIM and think
tags are added tokens that are *not* special: ``decode(..., skip_special_tokens=True)`` keeps
``<tool_call>``. There is no BOS: neither the tokenizer nor the template adds one (config.json
still names ``<|endoftext|>`` as bos_token_id, as the real one does); generation ends at
``<|im_end|>`` or ``<|endoftext|>``.

Chat template: Qwen/Qwen3-VL-8B-Instruct's, verbatim (chat_templates/qwen3-vl-8b-instruct.jinja),
the ``tokenizer.chat_template`` of Qwen's own Qwen/Qwen3-VL-8B-Instruct-GGUF as quoted in
zhongkaifu/TensorSharp (InferenceWeb.Tests, QwenImageIntentScorerTests.cs) with its sha256
3636d0f0...a489e4 and 5292 bytes, which this copy matches.
Tools are Hermes-style JSON: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
results go in a user turn as ``<tool_response>\\n...\\n</tool_response>``. No thinking tags.

The processor is built with transformers' PIL ``Qwen2VLImageProcessorPil`` (saved as
``Qwen2VLImageProcessor``); ``mlx_vlm.load`` reads it back as mlx-vlm's Qwen3VLProcessor around
its numpy Qwen3VLImageProcessor with the saved patch/merge/pixel bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec, unmark_special
from .weights import RESIDUAL_GAIN, silence_tokens

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip

# "special": false in the real tokenizer.json: they decode as text even when skipping specials.
PLAIN_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip

# Attributes the processors read (mlx-vlm and transformers look for tokenizer.image_token).
NAMED_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
}  # fmt: skip
ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # no bos, no unk: as Qwen
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")  # generation_config.json's order

MERGE = 2  # spatial_merge_size: 2x2 patches become one soft token
TEMPORAL_PATCH = 2

# micro: float32, < 1 MB; patch 8, so a square image of >= 64 px becomes 8x8 patches = 16 tokens.
# small: bfloat16; the real patch 16, a square of >= 224 px becomes 14x14 patches = 49 tokens.
DIMS = {"micro": MICRO, "small": SMALL}
# Rows of the vision position table (a square grid, bilinearly resized to each image's grid):
# small's 16x16 table is resized to its 14x14 patches, as the real 48x48 one is.
POSITION_GRID = {"micro": 8, "small": 16}
# Vision layers whose features feed DeepStack (real 2B: [5, 11, 17] of 24).
DEEPSTACK = {"micro": [0], "small": [0, 1]}
QK_GAIN = 2.0  # on q_norm/k_norm; see fix_init


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = qwen_tokens(dims, published_template("qwen3-vl-8b-instruct"))
    config = model_config(dims, tokens, "qwen3_vl", text_config(dims, tokens))
    config["architectures"] = ["Qwen3VLForConditionalGeneration"]
    config["vision_config"] = vision_config(dims, "qwen3_vl", POSITION_GRID[size], DEEPSTACK[size])
    return Recipe(
        arch="qwen3_vl",
        dims=dims,
        tokens=tokens,
        config=config,
        make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer), dims),
        fix_init=fix_init,
    )


def qwen_tokens(dims: Dims, chat_template: str) -> TokenizerSpec:
    return TokenizerSpec(
        vocab_size=dims.vocab,
        special_tokens=SPECIAL_TOKENS,
        roles=ROLES,
        named=NAMED_TOKENS,
        chat_template=chat_template,
    )


def mrope_section(half: int) -> list[int]:
    """Qwen3-VL's [24, 20, 20] (temporal, height, width) scaled to ``half`` rotary frequencies."""
    height = half * 20 // 64
    return [half - 2 * height, height, height]


def text_config(dims: Dims, tokens: TokenizerSpec) -> dict[str, Any]:
    return {
        "model_type": "qwen3_vl_text",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "vocab_size": dims.vocab,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000,
        # "type", not the HF "rope_type": mlx-vlm renames that key in place in this very dict
        "rope_scaling": {
            "type": "default",
            "mrope_section": mrope_section(dims.head_dim // 2),
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": tokens.id_of("<|endoftext|>"),
        "eos_token_id": tokens.id_of("<|im_end|>"),
    }


def vision_config(dims: Dims, model_type: str, grid: int, deepstack: list[int]) -> dict[str, Any]:
    return {
        "model_type": model_type,  # mlx-vlm's VisionModel refuses types it does not list
        "depth": dims.vision_layers,
        "hidden_size": dims.vision_hidden,
        "intermediate_size": dims.vision_intermediate,
        "num_heads": dims.vision_heads,
        "out_hidden_size": dims.hidden,  # the merger's output: the language model's width
        "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": dims.patch,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "num_position_embeddings": grid * grid,
        "deepstack_visual_indexes": deepstack,
    }


def model_config(
    dims: Dims, tokens: TokenizerSpec, model_type: str, text: dict[str, Any]
) -> dict[str, Any]:
    """Top-level config.json; ``vision_config`` is added by the caller."""
    return {
        "model_type": model_type,
        "text_config": text,
        "image_token_id": tokens.id_of("<|image_pad|>"),
        "video_token_id": tokens.id_of("<|video_pad|>"),
        "vision_start_token_id": tokens.id_of("<|vision_start|>"),
        "vision_end_token_id": tokens.id_of("<|vision_end|>"),
        "vocab_size": dims.vocab,
        "tie_word_embeddings": text["tie_word_embeddings"],
        # Qwen configs name <|endoftext|> as bos_token_id, though nothing ever adds it
        "bos_token_id": tokens.id_of("<|endoftext|>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|endoftext|>"),
        "torch_dtype": dims.dtype,
    }


def plain_tokens(tokenizer: Any) -> Any:
    """The tokenizer with PLAIN_TOKENS marked non-special, as in the real tokenizer.json."""
    return unmark_special(tokenizer, PLAIN_TOKENS)


def pixel_bounds(dims: Dims) -> tuple[int, int]:
    """(min_pixels, max_pixels): max admits exactly ``image_tokens`` soft tokens, so a square
    image of at least ``image_size`` px is resized to it; min is Qwen's (2 * factor)**2."""
    factor = dims.patch * MERGE
    return (2 * factor) ** 2, factor * factor * dims.image_tokens


def make_processor(tokenizer: Any, dims: Dims) -> Any:
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    min_pixels, max_pixels = pixel_bounds(dims)
    shape = {
        "patch_size": dims.patch, "merge_size": MERGE, "temporal_patch_size": TEMPORAL_PATCH,
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],  # Qwen3-VL's, not CLIP's
    }  # fmt: skip
    # transformers' video processors need torchvision; mlx-vlm's numpy one is what its loader
    # builds anyway.
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**shape),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**shape),
        chat_template=tokenizer.chat_template,
    )
    return QwenProcessorFiles(processor)


@dataclass(frozen=True, slots=True)
class QwenProcessorFiles:
    """Saves a processor the way the real Qwen-VL checkpoints are laid out.

    transformers 5 writes one processor_config.json; mlx-vlm's Qwen loader reads the image
    settings from it, but the video settings only from video_preprocessor_config.json or
    preprocessor_config.json (else it asks the Hub, then falls back to patch 16). So both
    legacy files are written too, as the published checkpoints ship them.
    """

    processor: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.processor, name)  # a drop-in for the processor, but for saving

    def save_pretrained(self, path: str) -> None:
        self.processor.save_pretrained(path)
        self.processor.image_processor.save_pretrained(path)  # preprocessor_config.json
        self.processor.video_processor.save_pretrained(path)  # video_preprocessor_config.json


def fix_init(model: nn.Module) -> None:
    """Pre-norm blocks with no post-norms: the residual gain goes on each branch's last
    projection (o_proj, down_proj), which nothing renormalizes before the residual add.
    Qwen3 normalizes q and k per head, so attention is sharpened on q_norm/k_norm instead."""
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight = mx.full(norm.weight.shape, QK_GAIN, dtype=norm.weight.dtype)
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * RESIDUAL_GAIN
    silence_pads(model)


def silence_pads(model: nn.Module) -> None:
    """A random model may emit ``<|image_pad|>``; a real one never does, and one in a reply
    would break the next turn's image count. A zero row gives logit 0, below the best random
    logit. With tied embeddings the row is also the input embedding, which is harmless for
    these three: image and video pads are replaced by vision features, vision_pad is unused."""
    pads = [SPECIAL_TOKENS.index(t) for t in ("<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")]
    silence_tokens(model, pads, tied=model.config.text_config.tie_word_embeddings)
