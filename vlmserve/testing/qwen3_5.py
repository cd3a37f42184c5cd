"""[any] Qwen3.5 recipe: a hybrid model of gated-delta (linear attention) and full-attention layers.

Modelled on the dense Qwen/Qwen3.5 checkpoints: every ``full_attention_interval``-th language
layer is full attention (gated output, q_norm/k_norm, partial interleaved M-RoPE on a quarter of
each head), the others are Gated DeltaNet layers with a causal conv1d. mlx-vlm caches the
former in a KVCache and the latter in an ArraysCache(size=2) (conv state, recurrent state):
micro has one of each. The vision tower and processor are Qwen3-VL's (no DeepStack: mlx-vlm
refuses it for Qwen3.5), and so are the special tokens, in the real order (``<|endoftext|>``
is 248044 in the real vocabulary, 0 here). ``lm_head`` is untied (qwen3_vl.py covers tied). No
BOS, as in qwen3_vl.py; generation ends at ``<|im_end|>`` or ``<|endoftext|>``.

Chat template: Qwen/Qwen3.5-35B-A3B's chat_template.jinja, verbatim
(chat_templates/qwen3.5-35b-a3b.jinja), from alibaba/rtp-llm
rtp_llm/frontend/tokenizer_factory/tokenizers/qwen_tokenizer.py (``_QWEN35_DEFAULT_CHAT_TEMPLATE``,
"Official Qwen3.5 chat_template.jinja fallback from Qwen/Qwen3.5-35B-A3B"); a copy said to be
Qwen/Qwen3.5-27B's, elsewhere on GitHub, read the same. Tools are Qwen3-Coder-style XML:
``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n``
``</tool_call>``, whose arguments must be a mapping (a JSON string raises a TypeError), and
results in a user turn as ``<tool_response>\\n...\\n</tool_response>``. The generation prompt
opens a thought, ``<|im_start|>assistant\\n<think>\\n``, unless ``enable_thinking=False``, which
writes an empty ``<think>\\n\\n</think>\\n\\n``; assistant turns after the last user query get
their ``reasoning_content`` back inside ``<think>``. GGUF dumps of the small checkpoints
(0.8B, 4B) show the default inverted (thinking only with ``enable_thinking=True``); not the
template used here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .qwen3_vl import (
    POSITION_GRID,
    QK_GAIN,
    make_processor,
    model_config,
    plain_tokens,
    qwen_tokens,
    silence_pads,
    vision_config,
)
from .recipe import MICRO, SMALL, Dims, Recipe
from .templates import published_template
from .tokenizer import TokenizerSpec
from .weights import RESIDUAL_GAIN, write_drafter

# micro: float32, < 1 MB, one linear-attention layer then one full-attention layer.
# small: bfloat16, 8 layers with the real interval 4 (6 linear, 2 full).
DIMS = {"micro": MICRO, "small": replace(SMALL, layers=8)}
FULL_ATTENTION_INTERVAL = {"micro": 2, "small": 4}  # real: 4
# Gated DeltaNet heads: (key heads, value heads, head dim); twice as many value heads as key
# heads, so each key head is shared by two value heads (mlx-vlm allows any multiple).
LINEAR_HEADS = {"micro": (2, 4, 16), "small": (4, 8, 32)}
PARTIAL_ROTARY = 0.25  # real: M-RoPE on a quarter of each head


def recipe(size: str) -> Recipe:
    return hybrid_recipe("qwen3_5", "Qwen3_5ForConditionalGeneration", size, DIMS[size], text_config)


def hybrid_recipe(arch: str, architecture: str, size: str, dims: Dims, text: Callable[..., dict[str, Any]],
                  fix: Callable[[nn.Module], None] | None = None) -> Recipe:
    """A Qwen3.5-shaped recipe (its template, tokens, tower and processor) whose language model's config is
    ``text(dims, tokens, interval, linear_heads)``: Qwen3.5's dense one, or its MoE (qwen3_5_moe.py)."""
    tokens = qwen_tokens(dims, published_template("qwen3.5-35b-a3b"))
    config = model_config(dims, tokens, arch, text(dims, tokens, FULL_ATTENTION_INTERVAL[size], LINEAR_HEADS[size]))
    config["architectures"] = [architecture]
    config["vision_config"] = vision_config(dims, arch, POSITION_GRID[size], [])
    return Recipe(
        arch=arch,
        dims=dims,
        tokens=tokens,
        config=config,
        make_processor=lambda tokenizer: make_processor(plain_tokens(tokenizer), dims),
        fix_init=fix or fix_init,
    )


def mrope_section(half: int) -> list[int]:
    """Qwen3.5's [11, 11, 10] (temporal, height, width) scaled to ``half`` rotary frequencies."""
    temporal = round(half * 11 / 32)
    return [temporal, temporal, half - 2 * temporal]


def text_config(
    dims: Dims, tokens: TokenizerSpec, interval: int, linear: tuple[int, int, int]
) -> dict[str, Any]:
    key_heads, value_heads, linear_dim = linear
    layer_types = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(dims.layers)
    ]
    rotary = int(dims.head_dim * PARTIAL_ROTARY)
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "attn_output_gate": True,
        "full_attention_interval": interval,
        "layer_types": layer_types,  # what transformers reads; mlx-vlm uses the interval
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": linear_dim,
        "linear_value_head_dim": linear_dim,
        "linear_conv_kernel_dim": 4,
        "vocab_size": dims.vocab,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        # "type", not the HF "rope_type": mlx-vlm renames that key in place in this very dict
        "rope_parameters": {
            "type": "default",
            "mrope_section": mrope_section(rotary // 2),
            "mrope_interleaved": True,
            "rope_theta": 10000000,
            "partial_rotary_factor": PARTIAL_ROTARY,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tokens.id_of("<|endoftext|>"),
        "eos_token_id": tokens.id_of("<|endoftext|>"),  # the real text_config's; see model_config
    }


def fix_init(model: nn.Module, mlp_outputs: Callable[[Any], tuple[Any, ...]] = lambda mlp: (mlp.down_proj,)) -> None:
    """As qwen3_vl.fix_init: the residual gain on each branch's last projection (o_proj,
    the gated-delta out_proj, the MLP's ``mlp_outputs``: its down_proj) and sharper attention on q_norm/k_norm."""
    for layer in model.language_model.model.layers:
        if layer.is_linear:
            mixer = layer.linear_attn
            mixer.out_proj.weight = mixer.out_proj.weight * RESIDUAL_GAIN
        else:
            attn = layer.self_attn
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight = mx.full(norm.weight.shape, QK_GAIN, dtype=norm.weight.dtype)
            attn.o_proj.weight = attn.o_proj.weight * RESIDUAL_GAIN
        for proj in mlp_outputs(layer.mlp):
            proj.weight = proj.weight * RESIDUAL_GAIN
    silence_pads(model)


def mtp_config(target_config: dict[str, Any], layers: int = 1) -> dict[str, Any]:
    """A Qwen3.5 MTP drafter's config.json (mlx-vlm's ``qwen3_5_mtp``, the ``mtp`` kind) for the Qwen3.5
    whose config is ``target_config``: ``layers`` full-attention layers of the target's shape."""
    text = {**target_config["text_config"], "mtp_num_hidden_layers": layers}
    return {"model_type": "qwen3_5_mtp", "block_size": layers + 2, "text_config": text}


def build_mtp(target: Path, out: Path) -> Path:
    """An MTP drafter for the Qwen3.5 build at ``target``, written to ``out`` (kept if already there):
    what ``--speculative-config '{"method": "mtp", "model": out}'`` loads.

    Not trained, but not random: its layer is a copy of the target's full-attention layer, its input
    projection passes the next token's embedding (at its own scale) and drops the hidden state, and its
    final norm is the target's. So it runs the target less its linear-attention layers (whose branches the recipe keeps
    small) one position ahead, and its drafts are accepted often, not always.
    """
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Qwen3_5MTPDraftModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig

    weights = out / "model.safetensors"
    if weights.exists():
        return out
    config = mtp_config(json.loads((target / "config.json").read_text()))
    model = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict(config))
    text = load(str(target))[0].language_model.model
    hidden = config["text_config"]["hidden_size"]
    model.fc.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    table = text.embed_tokens.weight.astype(mx.float32)  # its input norm gives the embeddings their own scale
    model.pre_fc_norm_embedding.weight = mx.full((hidden,), mx.sqrt(mx.mean(table * table)).item())
    full = next(layer for layer in text.layers if not layer.is_linear)
    for layer in model.layers:
        layer.update(full.parameters())
    model.norm.update(text.norm.parameters())
    return write_drafter(model, config, out)


def dflash_config(target_config: dict[str, Any], layers: int = 2) -> dict[str, Any]:
    """A DFlash drafter's config.json for the Qwen3.5 (or Gemma 4) whose config is ``target_config``, with the
    keys of the published z-lab/Qwen3.5-4B-DFlash (mlx-vlm reads its ``dflash_config`` as ``qwen3_dflash``; a
    ``gemma4`` one as ``gemma4_dflash``): ``layers`` non-causal layers of the target's width, reading its first
    and last layers, a block of 16."""
    text = target_config["text_config"]
    model_type = "gemma4" if target_config["model_type"] == "gemma4" else "qwen3"
    hidden, depth = text["hidden_size"], text["num_hidden_layers"]
    return {"architectures": ["DFlashDraftModel"], "model_type": model_type, "block_size": 16,
            "dflash_config": {"mask_token_id": text["vocab_size"] - 1, "target_layer_ids": sorted({0, depth - 1})},
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4, "hidden_act": "silu",
            "layer_types": ["full_attention"] * layers, "max_position_embeddings": 262144, "num_target_layers": depth,
            "rms_norm_eps": 1e-6, "rope_theta": 10000000, "rope_scaling": None, "sliding_window": None,
            "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
            "vocab_size": text["vocab_size"], "dtype": "float32"}


def build_dflash(target: Path, out: Path, seed: int = 0) -> Path:
    """A DFlash drafter for the Qwen3.5 (or Gemma 4) build at ``target``, written to ``out`` (kept if already there): what
    ``--speculative-config '{"method": "dflash", "model": out}'`` loads. mlx-vlm's own class with random
    weights (seeded), its context projection made to pass the target's states through (``fc`` an identity
    per layer read, summed), so that each position's context differs with what the target computed there."""
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

    if (out / "model.safetensors").exists():
        return out
    config = dflash_config(json.loads((target / "config.json").read_text()))
    mx.random.seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(config))
    hidden, reads = config["hidden_size"], len(config["dflash_config"]["target_layer_ids"])
    model.fc.weight = mx.concatenate([mx.eye(hidden)] * reads, axis=1)
    return write_drafter(model, config, out)


# The norms a Qwen3.5 checkpoint's ``mtp.*`` layers store zero-centered (mlx-vlm adds 1 as it reads them)
ZERO_CENTERED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
                 "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def carry_mtp(target: Path, drafter: Path, out: Path) -> Path:
    """The Qwen3.5 build at ``target`` carrying the MTP drafter at ``drafter`` as its own layers, as Qwen's
    checkpoints carry theirs (``mtp.*`` tensors beside the model's, ``mtp_num_hidden_layers`` in its text
    config), written to ``out`` (kept if already there): what ``{"method": "mtp"}`` reads without a model."""
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target, tmp)
    layers = {f"mtp.{k}": v - 1 if k.endswith(ZERO_CENTERED) else v
              for k, v in mx.load(str(drafter / "model.safetensors")).items()}
    weights = tmp / "model.safetensors"
    mx.save_safetensors(str(weights), {**mx.load(str(weights)), **layers})
    config = json.loads((tmp / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = json.loads((drafter / "config.json").read_text())[
        "text_config"]["mtp_num_hidden_layers"]
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(out)
    return out
