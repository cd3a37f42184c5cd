"""[any] Qwen2-VL recipe: tokens, flat config.json, mlx-vlm's Qwen2VLProcessor, init repairs.

Modelled on Qwen/Qwen2-VL-7B-Instruct: a Qwen2 language model (q/k/v biases, M-RoPE with
``mrope_section`` in the real 2:3:3 ratio, untied ``lm_head`` like the 7B), a ViT with 2D
rotary positions, a 2x2 patch merger, and ``temporal_patch_size`` 2 (a still image is two frames).
Special tokens are the real ones in the real order (``<|endoftext|>`` .. ``<|video_pad|>``, ids
151643.. in the real vocabulary, 0.. here). There is no BOS: neither the tokenizer nor the
template adds one; generation ends at ``<|im_end|>`` or ``<|endoftext|>``.

Chat template: Qwen/Qwen2-VL-7B-Instruct ``chat_template.json``, verbatim (its tokenizer_config.json
carries the same text). Copied from the model card's quotation of that file; byte-identical to
Qwen/Qwen2.5-VL-7B-Instruct's, whose sha256 a renderer log on GitHub records for revision cc59489.
It has no tool syntax; it inserts "You are a helpful assistant." when the first message is not a
system message, and ignores ``tool_calls``.

The processor is built with transformers' PIL ``Qwen2VLImageProcessorPil`` (saved as
``Qwen2VLImageProcessor``); ``mlx_vlm.load`` reads it back as mlx-vlm's own Qwen2VLProcessor
around its numpy Qwen3VLImageProcessor with the saved patch/merge/pixel bounds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.nn as nn

from .qwen3_vl import QwenProcessorFiles
from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec
from .weights import RESIDUAL_GAIN

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip

# Attributes the processors read (mlx-vlm and transformers look for tokenizer.image_token).
NAMED_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # no bos, no unk: as Qwen
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")  # generation_config.json's order

MODEL_TYPES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
MERGE = 2  # spatial_merge_size: 2x2 patches become one soft token
TEMPORAL_PATCH = 2

# micro: float32, < 1 MB; patch 8: a square of >= 56 px is resized to 64x64, 8x8 patches, 16 soft
# tokens (smaller squares give 4 or 9). small: bfloat16, the real patch 14: a square of >= 210 px
# becomes 224x224, 64 tokens (the 96 px test squares give 9). vision_intermediate: embed*mlp_ratio.
DIMS = {"micro": MICRO, "small": replace(SMALL, patch=14, image_tokens=64)}


# Gain on q_proj and k_proj, so q.k logits are ~12x the init's (see fix_init). gemma3's
# head_dim**0.25 (2.4 here) still looped on the tied qwen2_5_vl micro; 3.5 gave > 6 distinct
# tokens in 12 and image-dependent output for both families, seeds 0-3 micro, 0-1 small (measured).
QK_GAIN = 3.5


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = TokenizerSpec(
        vocab_size=dims.vocab,
        special_tokens=SPECIAL_TOKENS,
        roles=ROLES,
        named=NAMED_TOKENS,
        chat_template=published_template("qwen2-vl-7b-instruct"),
    )
    config = model_config(dims, tokens, "Qwen2VLForConditionalGeneration", tied=False)
    config["vision_config"] = vision_config(dims)
    return Recipe(
        arch="qwen2_vl",
        dims=dims,
        tokens=tokens,
        config=config,
        make_processor=lambda tokenizer: make_processor(tokenizer, dims),
        fix_init=fix_init,
    )


def mrope_section(dims: Dims) -> list[int]:
    """Qwen's [16, 24, 24] (temporal, height, width) scaled to this head_dim / 2."""
    half = dims.head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def model_config(
    dims: Dims, tokens: TokenizerSpec, architecture: str, tied: bool
) -> dict[str, Any]:
    """The flat config.json Qwen2-VL and Qwen2.5-VL share: text fields at the top level.

    mlx-vlm builds text_config from the top level (ModelConfig.from_dict), so a nested
    text_config would be ignored.
    """
    assert dims.hidden == dims.heads * dims.head_dim  # mlx-vlm derives head_dim from these
    ids = {name: tokens.id_of(f"<|{name}|>") for name in ("vision_start", "vision_end")}
    return {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "hidden_act": "silu",
        "vocab_size": dims.vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section(dims)},
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": dims.layers,
        "tie_word_embeddings": tied,
        "vision_start_token_id": ids["vision_start"],
        "vision_end_token_id": ids["vision_end"],
        "vision_token_id": tokens.id_of("<|vision_pad|>"),
        "image_token_id": tokens.id_of("<|image_pad|>"),
        "video_token_id": tokens.id_of("<|video_pad|>"),
        # Qwen configs name <|endoftext|> as bos_token_id, though nothing ever adds it
        "bos_token_id": tokens.id_of("<|endoftext|>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|endoftext|>"),
        "torch_dtype": dims.dtype,
    }


def vision_config(dims: Dims) -> dict[str, Any]:
    return {
        "model_type": "qwen2_vl",  # mlx-vlm's VisionModel refuses any other
        "depth": dims.vision_layers,
        "embed_dim": dims.vision_hidden,
        "mlp_ratio": dims.vision_intermediate // dims.vision_hidden,  # transformers wants an int
        "num_heads": dims.vision_heads,
        "in_chans": 3,
        "hidden_size": dims.hidden,  # the merger's output: the language model's width
        "patch_size": dims.patch,
        "spatial_patch_size": dims.patch,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
    }


def pixel_bounds(dims: Dims) -> tuple[int, int]:
    """(min_pixels, max_pixels) with the real ratios to the merge unit: Qwen's 56*56 is
    (2 * factor)**2; max_pixels admits exactly ``image_tokens`` soft tokens."""
    factor = dims.patch * MERGE
    return (2 * factor) ** 2, factor * factor * dims.image_tokens


def make_processor(tokenizer: Any, dims: Dims, processor_class: type | None = None) -> Any:
    from mlx_vlm.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    min_pixels, max_pixels = pixel_bounds(dims)
    shape = {"patch_size": dims.patch, "merge_size": MERGE, "temporal_patch_size": TEMPORAL_PATCH}
    bounds = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    image_processor = Qwen2VLImageProcessorPil(**bounds, **shape)
    # transformers' Qwen2VLVideoProcessor needs torchvision; mlx-vlm's numpy one is what its loader
    # builds anyway. Qwen2-VL normalizes video frames as it does images (CLIP's mean and std).
    normalize = {"image_mean": list(image_processor.image_mean), "image_std": list(image_processor.image_std)}
    video_processor = Qwen3VLVideoProcessor(**bounds, **shape, **normalize)
    cls = processor_class or Qwen2VLProcessor
    return QwenProcessorFiles(cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
    ))


def fix_init(model: nn.Module) -> None:
    """Pre-norm blocks with no post-norms: the residual gain goes on each branch's last
    projection (o_proj, down_proj), which nothing renormalizes before the residual add.

    That alone still looped on one token (measured): soft attention averages the context into
    the same vector every step. QK_GAIN on q_proj and k_proj (biases too) sharpens it.
    """
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight = proj.weight * QK_GAIN
            proj.bias = proj.bias * QK_GAIN
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * RESIDUAL_GAIN
