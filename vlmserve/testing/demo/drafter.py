"""[main] Train the demo model's drafter: a Gemma 4 assistant (mlx-vlm's ``gemma4_assistant``, the
``mtp`` kind) that reads the demo model's last hidden state and KV and proposes its next tokens.

Runs on the calling thread, which owns every array it makes. The target is frozen; each step runs it
once over a batch of fresh training chats (the demo's own, built as inference builds them), then
trains the drafter on what the server will ask of it. At every position ``t`` the drafter sees the
target's KV up to ``t`` and its normalized hidden state there, with the next token's embedding, and
learns the token after that; its own output state and that token's embedding then learn the one
after, for ``depth`` tokens in all (mlx-vlm's ``draft_block``: the position stays ``t`` throughout).
Every position of a batch trains at once, each query masked to the keys up to its own position.
Only answer tokens are learned: the server drafts only while it decodes.

The head starts as the target's own embedding table (Gemma 4 ties its head to it): the drafter's
first guess is near the target's next-token guess, and training moves it one token on.
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
    answers,
    batches,
    embedded,
    fit,
    frozen_target,
    held_out,
    parameters,
    save,
)
from vlmserve.testing.gemma4 import assistant_config


def train_drafter(target: Path, out: Path, steps: int = 400, seed: int = 0, depth: int = 4, batch_size: int = 16,
                  lr: float = 2e-3, scored: int = HELD_OUT) -> dict[str, Any]:
    """Train a drafter for the demo model at ``target`` into ``out`` (config.json, model.safetensors,
    training.json); returns what training.json records (``scored``: held-out batches its accuracy is taken on)."""
    from mlx_vlm.speculative.drafters.gemma4_assistant import Gemma4AssistantDraftModel
    from mlx_vlm.speculative.drafters.gemma4_assistant.config import Gemma4AssistantConfig

    start = time.perf_counter()
    model, processor = frozen_target(target)
    config = assistant_config(json.loads((target / "config.json").read_text()), layers=2)
    mx.random.seed(seed)
    drafter = Gemma4AssistantDraftModel(Gemma4AssistantConfig.from_dict(config))
    embed = model.language_model.model.embed_tokens.weight
    drafter.model.embed_tokens.weight = mx.array(embed.astype(mx.float32))
    drafter.set_dtype(mx.float32)

    def loss(d: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array]:
        return _loss(d, batch, model.language_model, depth)

    def make(host: HostBatch) -> dict[str, Any]:
        return _drafter_batch(model, host)

    losses = fit(drafter, loss, make, batches(processor, seed, batch_size), steps, lr,
                 "training demo-gemma4-assistant")
    accuracy = held_out(loss, drafter, make, batches(processor, seed, batch_size, held_out=True), scored)
    info = {"kind": "mtp", "steps": steps, "seed": seed, "depth": depth, "batch_size": batch_size, "lr": lr,
            "held_out_accuracy_per_depth": accuracy}
    return save(out, config, parameters(drafter), info, losses, start)


def _drafter_batch(model: nn.Module, host: HostBatch) -> dict[str, Any]:
    """The frozen target over one batch: its normalized hidden states, the KV the drafter reads, and
    each position's next tokens with whether they are answer tokens."""
    ids, keywords = embedded(model, host)
    full, answer = answers(host)
    shared: dict[str, tuple[mx.array, mx.array]] = {}
    # the final norm's output: the drafter's input (mlx-vlm's speculative_draft_hidden)
    hidden = model.language_model.model(ids, shared_kv_sink=shared, **keywords)
    mx.eval(hidden, shared)
    return {"hidden": mx.stop_gradient(hidden), "shared": {k: (mx.stop_gradient(a), mx.stop_gradient(b))
                                                            for k, (a, b) in shared.items()},
            "full": mx.array(full), "answer": answer}


def _loss(drafter: nn.Module, batch: dict[str, Any], target: nn.Module, depth: int) -> tuple[mx.array, mx.array]:
    """Cross-entropy of each of the ``depth`` drafted tokens at every answer position, summed over the
    depths (each a mean); also each depth's accuracy."""
    hidden, shared, full, answer = batch["hidden"], batch["shared"], batch["full"], batch["answer"]
    keys = hidden.shape[1]  # the target's positions (width)
    embed = target.model.embed_tokens
    scale = target.model.embed_scale
    state = hidden
    total = mx.array(0.0)
    accuracies = []
    for k in range(1, depth + 1):
        n = keys - k  # queries t = 0..n-1: the input token t + k, the label t + k + 1
        if n < 1:
            break
        tokens = full[:, k:k + n]
        rows, cols = np.nonzero(answer[:, k + 1:k + 1 + n])  # the head runs at answer positions only
        if rows.size == 0:
            break
        where = mx.array(rows * n + cols)
        labels = full[:, k + 1:k + 1 + n].reshape(-1)[where]
        inputs = mx.concatenate([embed(tokens) * scale, state[:, :n]], axis=-1)
        state, normed = _draft_forward(drafter, inputs, shared, keys)
        logits = drafter.model.embed_tokens.as_linear(normed.reshape(-1, normed.shape[-1])[where])
        total = total + nn.losses.cross_entropy(logits, labels).mean()
        accuracies.append((mx.argmax(logits, axis=-1) == labels).astype(mx.float32).mean())
    return total, mx.stack(accuracies)


def _draft_forward(drafter: Any, inputs: mx.array, shared: dict[str, tuple[mx.array, mx.array]],
                   keys: int) -> tuple[mx.array, mx.array]:
    """The drafter's forward for queries at positions 0..n-1, each seeing the target's keys up to its
    own position (as at inference, where the KV ends there); returns its output state and the
    normalized state its head reads."""
    n = inputs.shape[1]
    window = drafter.config.text_config.sliding_window
    q = mx.arange(n)[:, None]
    s = mx.arange(keys)[None, :]
    full_mask = mx.where(s <= q, 0.0, -mx.inf)[None, None]
    sliding_mask = mx.where((s <= q) & (s > q - window), 0.0, -mx.inf)[None, None]
    h = drafter.pre_projection(inputs)
    for layer in drafter.model.layers:
        mask = sliding_mask if layer.layer_type == "sliding_attention" else full_mask
        h, _, _ = layer(h, mask=mask.astype(h.dtype), cache=None, per_layer_input=None,
                        shared_kv=shared[layer.layer_type], offset=mx.array(0))
    h = drafter.model.norm(h)
    return drafter.post_projection(h), h
