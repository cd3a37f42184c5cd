"""[any] GLM-4.1V recipe: a GLM-4 language model with M-RoPE, GLM's ViT and mlx-vlm's Glm46VProcessor.

Modelled on zai-org/GLM-4.1V-9B-Thinking (``glm4v``): attention with q/k/v biases, rotary on half
of each head (``partial_rotary_factor`` 0.5) in M-RoPE sections over (temporal, height, width),
a fused ``gate_up_proj`` MLP, and four norms per layer (pre and post both branches). The vision tower
has learned position embeddings resized to each grid, 2D rotary positions, a 2x2 convolutional
downsample and a merger to the language model's width; ``temporal_patch_size`` 2, so a still image is
two identical frames. Special tokens are the real ones in the real order (``<|endoftext|>`` ..
``<|video|>``, ids 151329.. in the real vocabulary, 0.. here): the prompt starts ``[gMASK]<sop>``,
turns are ``<|system|>``/``<|user|>``/``<|assistant|>``/``<|observation|>``, an image is
``<|begin_of_image|>`` + ``<|image|>`` per soft token + ``<|end_of_image|>``. No BOS token is added by
the tokenizer (the template writes ``[gMASK]<sop>``); generation ends at ``<|endoftext|>``,
``<|user|>`` or ``<|observation|>`` (GLM-4.5V's ``eos_token_id``; 4.1V adds ``<|code_middle|>``).
The think, tool and argument tags decode as text here, so the reasoning and tool parsers see them.

Chat template: the GLM-V template with GLM-4.5's tools (``<tool_call>NAME\\n<arg_key>k</arg_key>\\n``
``<arg_value>v</arg_value>\\n</tool_call>``, results after ``<|observation|>`` in ``<tool_response>``),
``<think>...</think>`` reasoning and ``/nothink``, verbatim as GLM-OCR ships it
(chat_templates/glm-ocr.jinja), quoted whole as ``_actualGlmOcrTemplate`` in the public Dart test
suite of leehack/llama_dart (its llama.cpp template-parity tests). GLM-4.5V's and GLM-4.6V's own
``chat_template.jinja`` could not be reached offline; they write the same tool, think and image syntax
(vLLM's and llama.cpp's GLM-4.5 parsers read it). GLM-4.1V-9B-Thinking's own template has no tools;
the one template serves both families here. The generation prompt opens no ``<think>``: the model
writes it (``enable_thinking=False`` writes an empty ``<think></think>``).

The processor is mlx-vlm's ``Glm46VProcessor`` around transformers' PIL ``Glm4vImageProcessorPil``
(saved as ``Glm4vImageProcessor``, which ``mlx_vlm.load`` reads back).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec, unmark_special
from .weights import RESIDUAL_GAIN, silence_tokens

SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink",
    "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)  # fmt: skip
# Decoded as text even when skipping specials, so that reasoning and tool calls reach their parsers.
PLAIN_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink")
NAMED_TOKENS = {"image_token": "<|image|>", "video_token": "<|video|>"}
ROLES = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

MERGE = 2
TEMPORAL_PATCH = 2
PARTIAL_ROTARY = 0.5  # real: rotary on half of each head
QK_GAIN = 3.0  # on q_proj and k_proj: attention logits 9x sharper; see fix_init
DIMS = {"micro": MICRO, "small": SMALL}
# The vision position table's side (a square grid resized to each image's): micro's 8 is its 8x8 patches
# of a 64 px image; small's 16 is resized to its 14x14 patches of a 224 px image, as the real 24 (336/14) is.
POSITION_GRID = {"micro": 8, "small": 16}


def recipe(size: str) -> Recipe:
    dims = DIMS[size]
    tokens = glm_tokens(dims)
    config = model_config(dims, tokens, "glm4v", text_config(dims, tokens), POSITION_GRID[size])
    config["architectures"] = ["Glm4vForConditionalGeneration"]
    return Recipe(arch="glm4v", dims=dims, tokens=tokens, config=config,
                  make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer), dims),
                  fix_init=fix_init)


def glm_tokens(dims: Dims) -> TokenizerSpec:
    return TokenizerSpec(vocab_size=dims.vocab, special_tokens=SPECIAL_TOKENS, roles=ROLES, named=NAMED_TOKENS,
                         chat_template=published_template("glm-ocr"))


def mrope_section(half: int) -> list[int]:
    """GLM-4.1V's [8, 12, 12] (temporal, height, width) scaled to ``half`` rotary frequencies."""
    height = half * 12 // 32
    return [half - 2 * height, height, height]


def text_config(dims: Dims, tokens: TokenizerSpec) -> dict[str, Any]:
    return {
        "model_type": "glm4v_text",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "vocab_size": dims.vocab,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "partial_rotary_factor": PARTIAL_ROTARY,
        "rope_scaling": {"rope_type": "default", "mrope_section": mrope_section(int(dims.head_dim * PARTIAL_ROTARY) // 2)},
        "attention_bias": True,
        "tie_word_embeddings": False,
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|endoftext|>"),
    }


def vision_config(dims: Dims, model_type: str, grid: int) -> dict[str, Any]:
    return {
        "model_type": model_type,  # mlx-vlm's VisionModel refuses types it does not list
        "depth": dims.vision_layers,
        "hidden_size": dims.vision_hidden,
        "intermediate_size": dims.intermediate,  # the merger's inner width: the language model's MLP, as real
        "num_heads": dims.vision_heads,
        "out_hidden_size": dims.hidden,
        "in_channels": 3,
        "hidden_act": "silu",
        "patch_size": dims.patch,
        "image_size": grid * dims.patch,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "rms_norm_eps": 1e-5,
    }


def model_config(dims: Dims, tokens: TokenizerSpec, model_type: str, text: dict[str, Any], grid: int) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision_config(dims, model_type, grid),
        "image_token_id": tokens.id_of("<|image|>"),
        "video_token_id": tokens.id_of("<|video|>"),
        "image_start_token_id": tokens.id_of("<|begin_of_image|>"),
        "image_end_token_id": tokens.id_of("<|end_of_image|>"),
        "video_start_token_id": tokens.id_of("<|begin_of_video|>"),
        "video_end_token_id": tokens.id_of("<|end_of_video|>"),
        # mlx-vlm's get_rope_index finds an image by the token after this one
        "vision_start_token_id": tokens.id_of("<|begin_of_image|>"),
        "vision_end_token_id": tokens.id_of("<|end_of_image|>"),
        "vocab_size": dims.vocab,
        "tie_word_embeddings": False,
        "bos_token_id": tokens.id_of("<sop>"),
        "eos_token_id": [tokens.id_of(t) for t in EOS_TOKENS],
        "pad_token_id": tokens.id_of("<|endoftext|>"),
        "torch_dtype": dims.dtype,
    }


def plain_tokens(tokenizer: Any) -> Any:
    """The tokenizer with PLAIN_TOKENS marked non-special, as in the real tokenizer.json."""
    return unmark_special(tokenizer, PLAIN_TOKENS)


def pixel_bounds(dims: Dims) -> tuple[int, int]:
    """(shortest_edge, longest_edge) in GLM's pixels, which count the two temporal frames: the longest
    admits exactly ``image_tokens`` soft tokens, so a square of at least ``image_size`` px is resized to it."""
    factor = dims.patch * MERGE
    return TEMPORAL_PATCH * (2 * factor) ** 2, TEMPORAL_PATCH * factor * factor * dims.image_tokens


def make_processor(tokenizer: Any, dims: Dims) -> Any:
    from mlx_vlm.models.glm4v.processing import Glm46VProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    shortest, longest = pixel_bounds(dims)
    image_processor = Glm4vImageProcessorPil(
        patch_size=dims.patch, merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH,
        size={"shortest_edge": shortest, "longest_edge": longest},
    )
    return Glm46VProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def fix_init(model: nn.Module) -> None:
    """The residual gain on each branch (GLM-4.1V's post-branch norms, else the branch's last projections:
    o_proj, down_proj, the experts'), and sharper attention: GLM has no q/k norms to carry a gain, so q_proj
    and k_proj are scaled. At the gain alone greedy decoding looped on three tokens (measured)."""
    for layer in model.language_model.model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * QK_GAIN
        attn.k_proj.weight = attn.k_proj.weight * QK_GAIN
        if hasattr(layer, "post_self_attn_layernorm"):
            for norm in (layer.post_self_attn_layernorm, layer.post_mlp_layernorm):
                norm.weight = norm.weight * RESIDUAL_GAIN
            continue
        attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        for down in _down_projections(layer.mlp):
            down.weight = down.weight * RESIDUAL_GAIN
    silence_pads(model)


def _down_projections(mlp: nn.Module) -> list[Any]:
    """Every last projection of an MLP or MoE block (the shared expert's and the stacked experts')."""
    return [m for name, m in mlp.named_modules() if name.rsplit(".", 1)[-1] == "down_proj"]


def silence_pads(model: nn.Module) -> None:
    """A random model may emit ``<|image|>`` or ``<|video|>``; a real one never does, and one in a reply
    would break the next turn's image count (see qwen3_vl.silence_pads); the lm_head is untied."""
    pads = [SPECIAL_TOKENS.index(t) for t in ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|begin_of_video|>")]
    silence_tokens(model, pads, tied=False)

