"""[any] Draft models for the Qwen2.5-VL builds (``{"method": "draft_model", "model": DIR}``): mlx-lm Qwen2 text
models with the target's tokenizer, cut from the target's own language model (for a SmolVLM, whose text model
is a Llama, an mlx-lm Llama: benchmarks/real_weights.py's SmolLM2-135M).

A draft model of every layer drafts what the target itself would write for a text prompt (its drafts are all
accepted where the draft model's KV holds exactly the row's tokens); one of fewer layers is a smaller model of
the same tokenizer, as Qwen3.5-0.8B is to Qwen3.5-27B.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
TEXT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "hidden_act",
             "vocab_size", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
             "bos_token_id", "eos_token_id", "pad_token_id")


def build_draft_model(target: Path, out: Path, layers: int | None = None) -> Path:
    """A Qwen2 text model of the Qwen2.5-VL build at ``target`` (a Llama of a SmolVLM's): its tokenizer, and its
    language model's weights up to layer ``layers`` (None: all), written to ``out`` (kept if already there)."""
    import mlx.core as mx

    if (out / "model.safetensors").exists():
        return out
    config = json.loads((target / "config.json").read_text())
    text = {**config, **config.get("text_config", {})}
    kept = layers if layers is not None else text["num_hidden_layers"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, tmp / name)
    kind, arch = ("llama", "LlamaForCausalLM") if text.get("model_type") == "llama" else ("qwen2", "Qwen2ForCausalLM")
    ours = {"model_type": kind, "architectures": [arch], "num_hidden_layers": kept,
            **{k: text[k] for k in TEXT_KEYS if k in text}}
    (tmp / "config.json").write_text(json.dumps(ours, indent=2))
    weights = {_text_key(k): v for k, v in mx.load(str(target / "model.safetensors")).items()
               if k.startswith("language_model.") and _below(k, kept)}
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    tmp.rename(out)
    return out


def _text_key(key: str) -> str:
    """mlx-lm's name for a VLM's language-model tensor: mlx-vlm's Qwen2.5-VL nests it as mlx-lm does
    (``language_model.model.layers``), its idefics3 LM does not (``language_model.layers``)."""
    rest = key.removeprefix("language_model.")
    return rest if rest.startswith(("model.", "lm_head.")) else f"model.{rest}"


def _below(key: str, layers: int) -> bool:
    parts = key.split(".")
    return "layers" not in parts or int(parts[parts.index("layers") + 1]) < layers
