"""[any] Llama 4 recipe (Scout, Maverick): tokens, config.json, mlx-vlm's own Llama4Processor, init repairs.

Modelled on meta-llama/Llama-4-Scout-17B-16E-Instruct and Llama-4-Maverick-17B-128E-Instruct: a
mixture of routed experts, top 1 by sigmoid score, plus a shared expert (8 experts here; 16 Scout, 128
Maverick), every other layer dense as Maverick's (``interleave_moe_layer_step`` 2); chunked attention with
RoPE on three layers of four and global attention without RoPE (NoPE) on every fourth, whose queries
are temperature-tuned (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``; transformers' strict
config needs the flag as ``true``); a weightless L2 (RMS) norm on the RoPE layers' queries and keys
(``use_qk_norm``). The chunk is 8192 tokens real, 32 (micro) and 128 (small) here, so that the tests'
prompts cross chunks. Token names follow the real tokenizer (``<|begin_of_text|>`` 200000 there); images
are ``<|image_start|>``, ``<|image|>``, one ``<|patch|>`` per soft token (``image_token_index``), ``<|image_end|>``.

Processor: mlx-vlm 0.7.10's own torchvision-free ``Llama4Processor`` and ``Llama4ImageProcessor``
(``models/llama4/processing_llama4.py``), what ``mlx_vlm.load`` gives a llama4 checkpoint. It is not the
real one: transformers' Llama4ImageProcessorFast (torchvision) resizes aspect kept into the chosen canvas
and pads, and appends a global view to a tiled image; mlx-vlm's stretches the image onto the canvas with
PIL bicubic and appends no global view, while its prompt writes patches for one, so a tiled image's
features and placeholders disagree. The builds therefore keep one tile (``max_patches`` 1).

Chat template: the one transformers' ``convert_llama4_weights_to_hf.py`` (``write_tokenizer``) writes into
the published Llama 4 instruct checkpoints, verbatim (chat_templates/llama-4-scout-17b-16e-instruct.jinja).
The tokenizer adds ``<|begin_of_text|>`` itself, as the real one does, and the template writes it too;
the prompt builder drops the doubled one. Tool calls: ``<|python_start|>`` the turn's content
``<|python_end|>`` then ``{"name": NAME, "parameters": {...}}`` per call, ``<|eot|>``; results in an
``ipython`` turn.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.nn as nn

from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec
from .weights import RESIDUAL_GAIN

TEMPLATE = "llama-4-scout-17b-16e-instruct"
SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>",
    "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>",
    "<|image_start|>", "<|image_end|>", "<|tile_x_separator|>", "<|tile_y_separator|>", "<|image|>", "<|patch|>",
)  # fmt: skip
NAMED_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image_start|>", "eoi_token": "<|image_end|>"}
ROLES = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "pad_token": "<|finetune_right_pad|>"}
EOS_TOKENS = ("<|end_of_text|>", "<|eom|>", "<|eot|>")  # the real generation_config's three

# micro: 4 layers, the fewest with a NoPE layer (the 4th); < 1 MB in float32 with a 512-token vocabulary
# and narrow experts. small: 8 layers, two of them NoPE. Patches of 14 px as real: mlx-vlm's processor
# reads no patch size from the checkpoint (its default is 14). One 112 px (micro) or 196 px (small) tile;
# pixel shuffle 0.5 makes (112 / 14)^2 / 4 = 16 and (196 / 14)^2 / 4 = 49 soft tokens.
DIMS = {"micro": replace(MICRO, vocab=512, layers=4, intermediate=64, patch=14, image_size=112),
        "small": replace(SMALL, layers=8, patch=14, image_size=196)}
EXPERTS = {"micro": (8, 1, 8), "small": (8, 1, 256)}  # (routed experts, per token, expert width); real top 1
CHUNK = {"micro": 32, "small": 128}  # attention_chunk_size: real 8192
MOE_STEP = 2  # interleave_moe_layer_step: Maverick's 2 (every other layer MoE); Scout's 1
PIXEL_SHUFFLE = 0.5
PROJECTOR = {"micro": 64, "small": 256}  # projector_input/output_dim and vision_output_dim (real 4096)


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = TokenizerSpec(
        vocab_size=dims.vocab,
        special_tokens=SPECIAL_TOKENS,
        roles=ROLES,
        named=NAMED_TOKENS,
        chat_template=published_template(TEMPLATE),
        add_bos_token=True,  # the real tokenizer's post-processor adds <|begin_of_text|>
    )
    return Recipe(
        arch="llama4",
        dims=dims,
        tokens=tokens,
        config=model_config(dims, tokens, size),
        make_processor=lambda tokenizer: make_processor(tokenizer, dims),
        fix_init=fix_init,
    )


def text_config(dims: Dims, tokens: TokenizerSpec, size: str) -> dict[str, Any]:
    experts, per_token, width = EXPERTS[size]
    layers = range(dims.layers)
    return {
        "model_type": "llama4_text",
        "hidden_size": dims.hidden,
        "intermediate_size": width,
        "intermediate_size_mlp": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "vocab_size": dims.vocab,
        "num_local_experts": experts,
        "num_experts_per_tok": per_token,
        "interleave_moe_layer_step": MOE_STEP,
        "moe_layers": [i for i in layers if i % MOE_STEP == MOE_STEP - 1],
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in layers],  # 1: RoPE (and chunked attention)
        "attention_chunk_size": CHUNK[size],
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "use_qk_norm": True,
        "attention_bias": False,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 10485760,
        "rms_norm_eps": 1e-5,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "bos_token_id": tokens.id_of("<|begin_of_text|>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|finetune_right_pad|>"),
    }


def vision_config(dims: Dims, size: str) -> dict[str, Any]:
    return {
        "model_type": "llama4_vision_model",
        "hidden_size": dims.vision_hidden,
        "intermediate_size": dims.vision_hidden * 4,  # the pixel shuffle's output feeds the adapter MLP
        "num_hidden_layers": dims.vision_layers,
        "num_attention_heads": dims.vision_heads,
        "num_channels": 3,
        "image_size": dims.image_size,
        "patch_size": dims.patch,
        "pixel_shuffle_ratio": PIXEL_SHUFFLE,
        "projector_input_dim": PROJECTOR[size],
        "projector_output_dim": PROJECTOR[size],
        "vision_output_dim": PROJECTOR[size],
        "projector_dropout": 0.0,
        "multi_modal_projector_bias": False,
        "rope_theta": 10000,
        "norm_eps": 1e-5,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
    }


def model_config(dims: Dims, tokens: TokenizerSpec, size: str) -> dict[str, Any]:
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text_config(dims, tokens, size),
        "vision_config": vision_config(dims, size),
        "boi_token_index": tokens.id_of("<|image_start|>"),
        "eoi_token_index": tokens.id_of("<|image_end|>"),
        "image_token_index": tokens.id_of("<|patch|>"),  # where the features go: the patches, as real
        "image_token_id": tokens.id_of("<|patch|>"),
        "bos_token_id": tokens.id_of("<|begin_of_text|>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|finetune_right_pad|>"),
        "tie_word_embeddings": False,
        "torch_dtype": dims.dtype,
    }


def make_processor(tokenizer: Any, dims: Dims) -> Any:
    from mlx_vlm.models.llama4.processing_llama4 import Llama4ImageProcessor, Llama4Processor

    image_processor = Llama4ImageProcessor(size=dims.image_size, max_patches=1)
    processor = Llama4Processor(image_processor=image_processor, tokenizer=tokenizer, patch_size=dims.patch,
                                pixel_shuffle_ratio=PIXEL_SHUFFLE, chat_template=tokenizer.chat_template)
    save = processor.save_pretrained

    def save_pretrained(path: str, **kwargs: Any) -> Any:
        # mlx-vlm's Llama4Processor.from_pretrained reads the image settings from preprocessor_config.json
        # alone, which transformers no longer writes: written here with the real checkpoint's keys
        out = save(path, **kwargs)
        (Path(path) / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(dims), indent=2) + "\n")
        return out

    processor.save_pretrained = save_pretrained
    return processor


def preprocessor_config(dims: Dims) -> dict[str, Any]:
    return {
        "image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "size": {"height": dims.image_size, "width": dims.image_size}, "max_patches": 1,
        "resize_to_max_canvas": False, "resample": 2, "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }


def fix_init(model: nn.Module) -> None:
    """The residual gain (weights.py) on each branch's last projection: attention's o_proj, the dense
    MLP's down_proj, and the experts' and the shared expert's down projections."""
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        ffn = layer.feed_forward
        if layer.is_moe_layer:
            ffn.experts.down_proj.weight = ffn.experts.down_proj.weight * RESIDUAL_GAIN
            ffn.shared_expert.down_proj.weight = ffn.shared_expert.down_proj.weight * RESIDUAL_GAIN
        else:
            ffn.down_proj.weight = ffn.down_proj.weight * RESIDUAL_GAIN
