"""[any] An offline EAGLE-3 drafter (mlx-vlm's ``eagle3``, the Red Hat speculators format) for a test target.

    drafter = build_eagle3(build_model("gemma4", "micro", variant="e2b"), out)

It reads three different target layers, so its target needs three or more (the micro Gemma 4's e2b variant
has six; the plain micro builds have two).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from vlmserve.testing.weights import write_drafter

HOT = 2 / 3  # the share of the target's vocabulary the drafter's head scores (32K of Gemma's 262K is 1/8)


def eagle3_config(target_config: dict[str, Any], layers: int = 1) -> dict[str, Any]:
    """An EAGLE-3 drafter's config.json for the target whose config is ``target_config``, with the keys of the
    published RedHatAI/gemma-4-31B-it-speculator.eagle3 (speculators 0.x): ``layers`` Llama layers of the
    target's width, a hot vocabulary of ``HOT`` of the target's, reading the outputs of its first, middle and
    last layers (before those that read earlier layers' KV, which compute a prompt's last position only)."""
    text = target_config["text_config"]
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    depth = text["num_hidden_layers"] - text.get("num_kv_shared_layers", 0)
    heads = max(2, hidden // 32)
    return {
        "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3", "speculators_version": "0.3.0", "has_no_defaults_at_init": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"architectures": target_config.get("architectures", []), "name_or_path": "test-target"}},
        "draft_vocab_size": int(vocab * HOT), "target_hidden_size": hidden, "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": [1, depth // 2 + 1, depth],  # Hugging Face's hidden states: a layer's output is the next's "tie_word_embeddings": False,
        "transformer_layer_config": {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "head_dim": hidden // heads, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 32768,
            "attention_bias": False, "mlp_bias": False, "vocab_size": vocab, "tie_word_embeddings": False},
        "dtype": "float32",
    }


def build_eagle3(target: Path, out: Path, seed: int = 0) -> Path:
    """An EAGLE-3 drafter for the build at ``target``, written to ``out`` (kept if already there): what
    ``--speculative-config '{"method": "eagle3", "model": out}'`` loads. mlx-vlm's own class with random
    weights (seeded); its hot vocabulary a seeded sample of the target's ids, ``d2t`` each one's offset."""
    from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel, ModelConfig

    if (out / "model.safetensors").exists():
        return out
    config = eagle3_config(json.loads((target / "config.json").read_text()))
    mx.random.seed(seed)
    model = Eagle3DraftModel(ModelConfig.from_dict(config))
    vocab, hot = model.target_vocab_size, model.draft_vocab_size
    ids = mx.sort(mx.random.permutation(vocab)[:hot]).astype(mx.int32)
    model.d2t = ids - mx.arange(hot, dtype=mx.int32)  # the speculators' d2t: target id = draft id + d2t[id]
    return write_drafter(model, config, out)
