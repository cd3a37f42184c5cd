"""[main] Train a DFlash drafter (mlx-vlm's ``gemma4_dflash``, the ``dflash`` kind) for the demo model, by
distillation from the frozen target.

The drafter learns what engine/dflash.py asks of it at serve time. A row whose input token ``x_p`` sits at
position ``p`` has, in its context, the chosen target layers' outputs at every position before ``p``; the block
``[x_p, mask * (W - 1)]`` at positions ``p .. p + W - 1`` runs once through the drafter's layers, attending to
that context and to the whole block (both ways), and block position ``j`` drafts token ``p + j``. Here every
answer token of a batch is such an anchor, each a row of its own over its chat's context; block position
``j``'s label is the target's greedy token there (its argmax at ``p + j - 1``, given the chat's tokens before),
weighted less the further it drafts (``DECAY``, as the DFlash paper does). The block is trained at the width
it is served at (``BLOCK``), since its positions attend to each other. The drafter's embedding and head are the
target's (bound at load, not stored), so only its context projection and layers learn.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from vlmserve.testing.demo.batches import HostBatch
from vlmserve.testing.demo.drafter_common import (
    HELD_OUT,
    batches,
    fit,
    frozen_target,
    held_out,
    parameters,
    save,
    target_layers,
)
from vlmserve.testing.qwen3_5 import dflash_config

BLOCK = 8  # the trained (and served) block: its first token and 7 drafts, of which spec_bench's k=4 uses 4
DECAY = 3.0  # block position j's loss weighs exp(-(j - 1) / DECAY)
SCORED = 4  # the block positions whose held-out accuracy is reported (those k=4 drafts)


def demo_dflash_config(target_config: dict[str, Any]) -> dict[str, Any]:
    """The drafter's config.json: two layers of the target's width reading all four of its layers' outputs,
    a block of ``BLOCK``, the target's last vocabulary id as the mask (no demo answer uses it)."""
    config = dflash_config(target_config)
    depth = target_config["text_config"]["num_hidden_layers"]
    config["block_size"] = BLOCK
    config["dflash_config"]["target_layer_ids"] = list(range(depth))
    config["final_logit_softcapping"] = target_config["text_config"].get("final_logit_softcapping")
    config["dtype"] = "bfloat16"
    return config


def train_dflash_drafter(target: Path, out: Path, steps: int = 300, seed: int = 0, batch_size: int = 16,
                         lr: float = 2e-3, scored: int = HELD_OUT) -> dict[str, Any]:
    """Train a DFlash drafter for the demo model at ``target`` into ``out`` (config.json, model.safetensors,
    training.json); returns what training.json records (``scored``: held-out batches its accuracy is taken on)."""
    from mlx_vlm.speculative.drafters.gemma4_dflash import Gemma4DFlashConfig, Gemma4DFlashDraftModel

    start = time.perf_counter()
    model, processor = frozen_target(target)
    config = demo_dflash_config(json.loads((target / "config.json").read_text()))
    mx.random.seed(seed)
    drafter = Gemma4DFlashDraftModel(Gemma4DFlashConfig.from_dict(config))
    drafter.set_dtype(mx.float32)
    drafter.bind(model)  # the target's embedding and head: frozen with it
    layers = list(config["dflash_config"]["target_layer_ids"])
    rng = np.random.default_rng([seed, 11])

    def make(host: HostBatch) -> dict[str, Any]:
        return _blocks(target_layers(model, host, layers), rng)

    losses = fit(drafter, _loss, make, batches(processor, seed, batch_size), steps, lr, "training a demo DFlash drafter")
    accuracy = held_out(_loss, drafter, make, batches(processor, seed, batch_size, held_out=True), scored)
    info = {"kind": "dflash", "steps": steps, "seed": seed, "block": BLOCK, "batch_size": batch_size, "lr": lr,
            "held_out_accuracy_per_depth": accuracy}
    return save(out, config, parameters(drafter, skip=("embed_tokens",)), info, losses, start)


def _blocks(batch: dict[str, Any], rng: np.random.Generator, most: int = 512) -> dict[str, Any]:
    """Every answer token's block (at most ``most``, drawn at random): its chat row, position, tokens and each
    block position's label and weight (0 past the answer)."""
    full, answer, greedy = batch["full"], batch["answer"], batch["greedy"]
    width = greedy.shape[1]
    rows, positions = np.nonzero(answer[:, :width])
    if rows.size > most:
        keep = np.sort(rng.choice(rows.size, most, replace=False))
        rows, positions = rows[keep], positions[keep]
    offsets = np.arange(1, BLOCK)
    at = positions[:, None] + offsets[None, :]  # the drafted tokens' positions
    inside = at <= width  # the last target has a label too: the target's argmax at width - 1
    labels = greedy[rows[:, None], np.minimum(at - 1, width - 1)]
    real = inside & answer[rows[:, None], np.minimum(at, width)]
    weights = real * np.exp(-(offsets - 1) / DECAY)[None, :]
    return {"hidden": batch["hidden"], "rows": mx.array(rows), "positions": mx.array(positions.astype(np.int32)),
            "tokens": mx.array(full[rows, positions]), "labels": mx.array(labels), "weights": mx.array(weights),
            "real": mx.array(real)}


def _loss(drafter: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array]:
    """The blocks' weighted cross-entropy; the accuracy of each of the first ``SCORED`` drafts."""
    logits = drafter._logits(_block_hidden(drafter, batch)[:, 1:])
    labels, weights, real = batch["labels"], batch["weights"], batch["real"]
    loss = (nn.losses.cross_entropy(logits, labels) * weights).sum() / mx.maximum(weights.sum(), 1e-6)
    right = (mx.argmax(logits, axis=-1) == labels) & real
    accuracy = right[:, :SCORED].sum(axis=0) / mx.maximum(real[:, :SCORED].sum(axis=0), 1)
    return loss, accuracy


def _block_hidden(drafter: Any, batch: dict[str, Any]) -> mx.array:
    """The drafter over each block ``[n, BLOCK]``: its context the chosen layers' outputs before its position
    (engine/dflash.py's ``propose`` over its ``_context``); the final norm's output."""
    rows, positions = batch["rows"], batch["positions"]
    context = drafter.hidden_norm(drafter.fc(batch["hidden"]))  # [B, L, H]
    size = context.shape[1]
    seen = mx.concatenate([mx.broadcast_to((mx.arange(size)[None, :] < positions[:, None])[:, None, :],
                                           (rows.size, BLOCK, size)),
                           mx.ones((rows.size, BLOCK, BLOCK), dtype=mx.bool_)], axis=-1)[:, None]
    block = mx.concatenate([batch["tokens"][:, None], mx.full((rows.size, BLOCK - 1), drafter.config.mask_token_id,
                                                              dtype=mx.int32)], axis=1)
    h = drafter._embed_input_tokens(block)
    for layer in drafter.layers:
        attn = layer.self_attn
        keys, values = attn._project_kv(context)
        keys = drafter.rope(attn.k_norm(keys.reshape(*keys.shape[:2], attn.n_kv_heads, -1)).transpose(0, 2, 1, 3))
        values = values.reshape(*values.shape[:2], attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        h = h + _attend(drafter, attn, layer.input_layernorm(h), keys[rows], values[rows], seen, positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


def _attend(drafter: Any, attn: Any, x: mx.array, ctx_keys: mx.array, ctx_values: mx.array, seen: mx.array,
            positions: mx.array) -> mx.array:
    """One layer's attention for the blocks ``x`` at ``positions``: their contexts (where ``seen``) and their own
    keys, as engine/dflash.py's ``_attend``."""
    n, width, _ = x.shape
    queries = attn.q_norm(attn.q_proj(x).reshape(n, width, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    keys, values = attn._project_kv(x)
    keys = attn.k_norm(keys.reshape(n, width, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(n, width, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = drafter.rope(queries, offset=positions), drafter.rope(keys, offset=positions)
    out = mx.fast.scaled_dot_product_attention(
        queries, mx.concatenate([ctx_keys, keys], axis=2), mx.concatenate([ctx_values, values], axis=2),
        scale=attn.scale, mask=seen)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(n, width, -1))
