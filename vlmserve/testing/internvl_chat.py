"""[any] InternVL3.5 recipe (``internvl_chat``): a Qwen3 language model, InternViT, mlx-vlm's tiling processor.

Modelled on OpenGVLab/InternVL3_5-1B/2B/8B (the custom-code checkpoints, ``InternVLChatModel``):
config.json names the language model ``llm_config`` (mlx-vlm reads it as ``text_config``), a Qwen3
(q_norm/k_norm, no biases; mlx-vlm's internvl_chat turns q/k norms on where ``attention_bias`` is
false, as InternVL3's Qwen2.5 has biases and no norms) with plain RoPE; an InternViT (``intern_vit_6b``:
a CLS token, learned positions, layer scale) whose tiles' features are pixel-shuffled by
``downsample_ratio`` 0.5 and projected by ``mlp1`` (LayerNorm, Linear, GELU, Linear). An image is cut
into tiles of ``force_image_size`` px (the grid of ``min_dynamic_patch``..``max_dynamic_patch`` tiles
closest to its shape) plus a thumbnail when it makes more than one; each tile is
``(size / patch)**2 / 4`` ``<IMG_CONTEXT>`` tokens inside ``<img>`` ... ``</img>``.

Special tokens are Qwen3's, in the real order (qwen3_vl.py's), then InternVL's ``<img>``, ``</img>``,
``<IMG_CONTEXT>``, ``<quad>``, ``</quad>``, ``<ref>``, ``</ref>``, ``<box>``, ``</box>`` (151669.. in
the real vocabulary, after Qwen3's 151668 ``</think>``). No BOS; generation ends at ``<|im_end|>`` or
``<|endoftext|>``. ``image_token_index`` is written into config.json: mlx-vlm's default (151667,
InternVL3's ``<IMG_CONTEXT>``) is not an id of this vocabulary. The ``internvl3`` variant is InternVL3
(OpenGVLab/InternVL3-1B/2B): a Qwen2.5 (q/k/v biases, no q/k norms, tied embeddings) and Qwen2.5's
special tokens, so that ``<IMG_CONTEXT>`` sits where 151667 does.

Chat template: NOT InternVL3.5's own. Its ``chat_template.jinja`` (Qwen3-style, said to write Hermes
``<tool_call>`` JSON) could not be reached offline. This is the InternVL template Hugging Face publishes
with the converted InternVL3 checkpoints (OpenGVLab/InternVL3-1B-hf ...), verbatim as
huggingface/transformers' ``models/internvl/convert_internvl_weights_to_hf.py`` writes it
(chat_templates/internvl3-1b-hf.jinja): ChatML turns, string or list content, an image part as
``<image>\\n`` (mlx-vlm's processor expands it to the tile tokens), no default system message, as
InternVL3.5's renders, and no tools and no thinking: vlmserve writes its Hermes tool prompt, the
syntax InternVL3.5 speaks. mlx-vlm's InternVLChatProcessor carries a template of its own
(``User: ...\\nAssistant:\\n``, list content only) that ``chat_template.jinja`` must win over (preprocess/prompt.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .qwen2_vl import QK_GAIN as QWEN2_QK_GAIN
from .qwen3_vl import QK_GAIN, plain_tokens
from .qwen3_vl import SPECIAL_TOKENS as QWEN3_TOKENS
from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec
from .weights import RESIDUAL_GAIN, silence_tokens

INTERNVL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>")
SPECIAL_TOKENS = (*QWEN3_TOKENS, *INTERNVL_TOKENS)
# Qwen2.5's end at <|file_sep|> (151664): no <tool_response> or <think> tokens
INTERNVL3_TOKENS = (*QWEN3_TOKENS[:QWEN3_TOKENS.index("<|file_sep|>") + 1], *INTERNVL_TOKENS)
ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}  # no bos, no unk: as Qwen3
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
DOWNSAMPLE = 0.5  # pixel shuffle: 2x2 patches become one token
# Tiles per image (real 1..12): micro cuts a 4:3 photo into 2x2 tiles and a thumbnail, the test
# scenes (96 px) into one tile; small into at most 6.
MAX_TILES = {"micro": 4, "small": 6}

# micro: float32, < 1 MB; 64 px tiles of 8 px patches, 16 tokens a tile.
# small: bfloat16; 224 px tiles of 16 px patches, 49 tokens a tile (real: 448 px, 14 px, 256).
DIMS = {"micro": MICRO, "small": SMALL}


def recipe(size: str, variant: str = "") -> Recipe:
    """``variant``: "" (InternVL3.5, a Qwen3) or "internvl3" (InternVL3, a Qwen2.5)."""
    dims = DIMS[size]
    tokens = TokenizerSpec(
        vocab_size=dims.vocab,
        special_tokens=INTERNVL3_TOKENS if variant == "internvl3" else SPECIAL_TOKENS,
        roles=ROLES,
        named={},  # InternVL's tokenizer names no image token: its processor writes <IMG_CONTEXT> itself
        chat_template=published_template("internvl3-1b-hf"),
    )
    return Recipe(
        arch="internvl_chat",
        dims=dims,
        tokens=tokens,
        config=model_config(dims, tokens, MAX_TILES[size], qwen25=variant == "internvl3"),
        make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer), dims, MAX_TILES[size]),
        fix_init=lambda model: fix_init(model, tokens),
    )


def llm_config(dims: Dims, tokens: TokenizerSpec, qwen25: bool) -> dict[str, Any]:
    if qwen25:  # InternVL3: biases on q/k/v (mlx-vlm then has no q/k norms), no head_dim, tied embeddings
        qwen3 = {k: v for k, v in _qwen3(dims, tokens).items() if k != "head_dim"}
        return {**qwen3, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": True,
                "tie_word_embeddings": True}
    return _qwen3(dims, tokens)


def _qwen3(dims: Dims, tokens: TokenizerSpec) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "vocab_size": dims.vocab,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "attention_bias": False,
        "tie_word_embeddings": False,  # as the 8B; the 1B and 2B tie them
        "bos_token_id": tokens.id_of("<|endoftext|>"),
        "eos_token_id": tokens.id_of("<|im_end|>"),
    }


def vision_config(dims: Dims) -> dict[str, Any]:
    return {
        "architectures": ["InternVisionModel"],
        "model_type": "intern_vit_6b",
        "hidden_size": dims.vision_hidden,
        "intermediate_size": dims.vision_intermediate,
        "num_attention_heads": dims.vision_heads,
        "num_hidden_layers": dims.vision_layers,
        "image_size": dims.image_size,
        "patch_size": dims.patch,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
        "norm_type": "layer_norm",
        "qkv_bias": True,
        "qk_normalization": False,
        "drop_path_rate": 0.0,  # real 0.1 (training only; mlx-vlm builds Dropout layers from it)
    }


def model_config(dims: Dims, tokens: TokenizerSpec, max_tiles: int, qwen25: bool = False) -> dict[str, Any]:
    return {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "llm_config": llm_config(dims, tokens, qwen25),
        "vision_config": vision_config(dims),
        "downsample_ratio": DOWNSAMPLE,
        "dynamic_image_size": True,
        "force_image_size": dims.image_size,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": max_tiles,
        "use_thumbnail": True,
        "ps_version": "v2",
        "select_layer": -1,
        "template": "internvl2_5",
        "image_token_index": tokens.id_of("<IMG_CONTEXT>"),
        "video_token_index": tokens.id_of("<|video_pad|>"),  # mlx-vlm's default, 151656, is Qwen's <|video_pad|>
        "vocab_size": dims.vocab,
        "bos_token_id": tokens.id_of("<|endoftext|>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|endoftext|>"),
        "torch_dtype": dims.dtype,
    }


def make_processor(tokenizer: Any, dims: Dims, max_tiles: int) -> Any:
    from mlx_vlm.models.internvl_chat.processor import InternVLChatProcessor, InternVLImageProcessor

    image_processor = InternVLImageProcessor(size=dims.image_size, dynamic_max_num=max_tiles)
    processor = InternVLChatProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                      image_size=dims.image_size, patch_size=dims.patch,
                                      downsample_ratio=DOWNSAMPLE)
    return InternVLProcessorFiles(processor)


@dataclass(frozen=True, slots=True)
class InternVLProcessorFiles:
    """Saves what the checkpoints ship: mlx-vlm's InternVLChatProcessor saves nothing, and on load reads the
    tokenizer, ``chat_template.jinja``, and the tiling from config.json."""

    processor: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.processor, name)

    def save_pretrained(self, path: str) -> None:
        self.processor.tokenizer.save_pretrained(path)  # with chat_template.jinja


def fix_init(model: nn.Module, tokens: TokenizerSpec) -> None:
    """As qwen3_vl.fix_init (qwen2_vl's for InternVL3): the residual gain on o_proj and down_proj, sharper
    attention on q_norm/k_norm (on q_proj/k_proj where there are none).
    ``<IMG_CONTEXT>`` and the image pads are silenced: a reply holding one would break the next turn."""
    text = model.config.text_config
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        if text.attention_bias:  # InternVL3: no q/k norms; as qwen2_vl.fix_init, the projections (biases too)
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight, proj.bias = proj.weight * QWEN2_QK_GAIN, proj.bias * QWEN2_QK_GAIN
        else:
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight = mx.full(norm.weight.shape, QK_GAIN, dtype=norm.weight.dtype)
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * RESIDUAL_GAIN
    silenced = ("<img>", "</img>", "<IMG_CONTEXT>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    silence_tokens(model, [tokens.id_of(t) for t in silenced], tied=text.tie_word_embeddings)

