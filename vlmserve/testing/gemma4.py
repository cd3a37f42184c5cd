"""[any] Gemma 4 recipe: tokens, config.json, mlx-vlm's Gemma4Processor, and repairs to the init.

Token names follow the real Gemma 4 tokenizer (boi ``<|image>``, image ``<|image|>``, eoi
``<image|>``, tool tokens ``<|tool>``/``<tool|>``, ``<|tool_call>``/``<tool_call|>``,
``<|tool_response>``/``<tool_response|>`` and the string escape ``<|"|>``); only the ids differ.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import GEMMA4_CHAT_TEMPLATE
from .tokenizer import TokenizerSpec
from .weights import POST_NORMS, RESIDUAL_GAIN, set_norm_weights, write_drafter

SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
    "<|turn>", "<turn|>",
    "<|image|>", "<|image>", "<image|>",
    "<|audio|>", "<|audio>", "<audio|>", "<|video|>",
    "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
    '<|"|>', "<|channel>", "<channel|>", "<|think|>",
)  # fmt: skip

# Attribute names the real tokenizer_config.json uses; Gemma4Processor reads image/boi/eoi ones.
NAMED_TOKENS = {
    "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
    "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
    "video_token": "<|video|>",
    "sot_token": "<|turn>", "eot_token": "<turn|>",
    "std_token": "<|tool>", "etd_token": "<tool|>",
    "stc_token": "<|tool_call>", "etc_token": "<tool_call|>",
    "str_token": "<|tool_response>", "etr_token": "<tool_response|>",
    "escape_token": '<|"|>', "soc_token": "<|channel>", "eoc_token": "<channel|>",
    "think_token": "<|think|>",
}  # fmt: skip

ROLES = {
    "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
    "unk_token": "<unk>", "mask_token": "<mask>",
}  # fmt: skip

# Generation ends at <eos>, at the end of a turn, and where the model hands over to a tool.
EOS_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")

POOLING = 2  # real Gemma 4 pools 3x3 patches; 2x2 keeps the test images small
VIDEO_SOFT_TOKENS = 70  # Gemma4VideoProcessor accepts only 70/140/280/560/1120

# micro: float32, < 1 MB, for fast tests. small: bfloat16 like real checkpoints, and on the
# stock mlx-cpu wheel bf16 matmuls beat its reference float32 BLAS (see shared/FACTS.md).
DIMS = {"micro": MICRO, "small": SMALL}
PER_LAYER_INPUT = {"micro": 8, "small": 32}  # Gemma 4 E2B/E4B's per-layer token embeddings
KV_SHARED_LAYERS = 2  # the "e2b" variant's layers that read earlier layers' KV (E2B: the last 20 of 35)
E2B_LAYERS = 6
MOE = {"num_experts": 8, "top_k_experts": 2}  # the "moe" variant's router (26B-A4B: 128 experts, top 8)
# The "audio" variant's conformer (E2B/E4B: 12 layers of 1024, 128 mel bins in, 40 ms per soft token out);
# the mel bins stay at 128 because mlx-vlm's subsampler hard-codes them.
AUDIO = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "subsampling_conv_channels": [8, 4],
         "output_proj_dims": 32}
AUDIO_SEQ_LENGTH = 750  # the real processor's cap: 30 s of audio at 40 ms per token


def recipe(size: str, variant: str = "") -> Recipe:
    """``variant``: "" (the plain build), "e2b" (E2B/E4B: the last layers read earlier layers' KV, per-layer
    inputs, double-wide MLPs on the sharing layers; micro gets 4 layers for it), "moe" (26B-A4B: a
    mixture-of-experts block beside each dense MLP, keys as values on the full-attention layers) or "audio"
    (E2B/E4B's audio tower, and the feature extractor in processor_config.json)."""
    dims = DIMS[size]
    if variant == "e2b":  # 6 layers: the shared ones read layers 2 and 3, so a prompt may split before them
        dims = replace(dims, layers=max(dims.layers, E2B_LAYERS))
    tokens = TokenizerSpec(
        vocab_size=dims.vocab,
        special_tokens=SPECIAL_TOKENS,
        roles=ROLES,
        named=NAMED_TOKENS,
        chat_template=GEMMA4_CHAT_TEMPLATE,
    )
    return Recipe(
        arch="gemma4",
        dims=dims,
        tokens=tokens,
        config=model_config(dims, tokens, PER_LAYER_INPUT[size], variant),
        make_processor=lambda tokenizer: make_processor(tokenizer, dims, audio=variant == "audio"),
        fix_init=fix_init,
    )


def text_config(dims: Dims, per_layer_input: int, variant: str = "") -> dict[str, Any]:
    layer_types = ["sliding_attention"] * dims.layers
    layer_types[-1] = "full_attention"  # like Gemma 4: sliding layers, then a global one
    if dims.layers > 3:
        layer_types[dims.layers // 2 - 1] = "full_attention"
    return {
        "model_type": "gemma4_text",
        "hidden_size": dims.hidden,
        "num_hidden_layers": dims.layers,
        "intermediate_size": dims.intermediate,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "global_head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "vocab_size_per_layer_input": dims.vocab,
        "hidden_size_per_layer_input": per_layer_input,
        "num_kv_shared_layers": KV_SHARED_LAYERS if variant == "e2b" else 0,
        "sliding_window": 512,
        "layer_types": layer_types,
        "max_position_embeddings": 32768,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        **(_moe(dims) if variant == "moe" else {}),
    }


def _moe(dims: Dims) -> dict[str, Any]:
    return {"enable_moe_block": True, **MOE, "moe_intermediate_size": dims.intermediate // 2,
            "attention_k_eq_v": True, "num_global_key_value_heads": dims.kv_heads}


def vision_config(dims: Dims) -> dict[str, Any]:
    return {
        "model_type": "gemma4_vision",
        "hidden_size": dims.vision_hidden,
        "intermediate_size": dims.vision_intermediate,
        "num_hidden_layers": dims.vision_layers,
        "num_attention_heads": dims.vision_heads,
        "num_key_value_heads": dims.vision_heads,
        "head_dim": dims.vision_hidden // dims.vision_heads,
        "global_head_dim": dims.vision_hidden // dims.vision_heads,
        "patch_size": dims.patch,
        "pooling_kernel_size": POOLING,
        "default_output_length": dims.image_tokens,
        # one position per patch along the longest side the processor can produce
        "position_embedding_size": dims.image_tokens * POOLING,
        "rms_norm_eps": 1e-6,
    }


def audio_config() -> dict[str, Any]:
    return {"model_type": "gemma4_audio", **AUDIO, "rms_norm_eps": 1e-6}


def model_config(dims: Dims, tokens: TokenizerSpec, per_layer_input: int, variant: str = "") -> dict[str, Any]:
    ids = {name: tokens.id_of(token) for name, token in NAMED_TOKENS.items()}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config(dims, per_layer_input, variant),
        "vision_config": vision_config(dims),
        # absent, mlx_vlm.load builds a default 12-layer audio tower, then drops it with a warning
        "audio_config": audio_config() if variant == "audio" else None,
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "image_token_id": ids["image_token"],
        "boi_token_id": ids["boi_token"],
        "eoi_token_id": ids["eoi_token"],
        "audio_token_id": ids["audio_token"],
        "boa_token_id": ids["boa_token"],
        "eoa_token_id": ids["eoa_token"],
        "video_token_id": ids["video_token"],
        "pad_token_id": tokens.id_of("<pad>"),
        "bos_token_id": tokens.id_of("<bos>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "vision_soft_tokens_per_image": dims.image_tokens,
        "tie_word_embeddings": True,
        "torch_dtype": dims.dtype,
    }


def make_processor(tokenizer: Any, dims: Dims, audio: bool = False) -> Any:
    from mlx_vlm.models.gemma4.audio_feature_extractor import Gemma4AudioFeatureExtractor
    from mlx_vlm.models.gemma4.processing_gemma4 import (
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    image_processor = Gemma4ImageProcessor(
        size={"height": dims.image_size, "width": dims.image_size},
        patch_size=dims.patch,
        max_soft_tokens=dims.image_budget or dims.image_tokens,
        pooling_kernel_size=POOLING,
    )
    video_processor = Gemma4VideoProcessor(
        patch_size=dims.patch, max_soft_tokens=VIDEO_SOFT_TOKENS, pooling_kernel_size=POOLING
    )
    # save_pretrained writes the extractor's settings into processor_config.json (mlx-vlm #903: a
    # conversion lacking them drops audio silently)
    extractor = Gemma4AudioFeatureExtractor() if audio else None
    return Gemma4Processor(
        image_processor=image_processor,
        feature_extractor=extractor,
        audio_seq_length=AUDIO_SEQ_LENGTH,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
        image_seq_length=dims.image_tokens,
    )


def fix_init(model: nn.Module) -> None:
    # Gemma's branches end in a post-norm, so scaling o_proj/down_proj would be renormalized
    # away: the gain goes on the post-norm weights (mlx RMSNorm multiplies by weight directly).
    set_norm_weights(model, POST_NORMS, RESIDUAL_GAIN)
    # mlx-vlm starts the patch position table at ones: every patch would get the same position.
    embedder = model.vision_tower.patch_embedder
    table = embedder.position_embedding_table
    embedder.position_embedding_table = 0.3 * mx.random.normal(table.shape, dtype=table.dtype)


def assistant_config(target_config: dict[str, Any], layers: int = 2) -> dict[str, Any]:
    """A Gemma 4 assistant drafter's config.json (mlx-vlm's ``gemma4_assistant``, the ``mtp`` kind) for
    the Gemma 4 whose config is ``target_config``: ``layers`` layers that read the target's KV (its
    last sliding and full-attention layers'), its width and vocabulary."""
    target = target_config["text_config"]
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    text = {**target, "num_hidden_layers": layers, "layer_types": types, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": layers}
    return {"model_type": "gemma4_assistant", "backbone_hidden_size": target["hidden_size"],
            "tie_word_embeddings": True, "block_size": 4, "text_config": text}


def build_assistant(target: Path, out: Path, seed: int = 0) -> Path:
    """A random (seeded) assistant drafter for the Gemma 4 build at ``target``, written to ``out``
    (kept if already there): what ``--speculative-config '{"method": "mtp", "model": out}'`` loads."""
    from mlx_vlm.speculative.drafters.gemma4_assistant import Gemma4AssistantDraftModel
    from mlx_vlm.speculative.drafters.gemma4_assistant.config import Gemma4AssistantConfig

    weights = out / "model.safetensors"
    if weights.exists():
        return out
    config = assistant_config(json.loads((target / "config.json").read_text()))
    mx.random.seed(seed)
    model = Gemma4AssistantDraftModel(Gemma4AssistantConfig.from_dict(config))
    return write_drafter(model, config, out)
