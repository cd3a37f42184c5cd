"""[main] Train an EAGLE-3 drafter (mlx-vlm's ``eagle3``, the Red Hat speculators format) for the demo model, by
distillation from the frozen target.

The drafter learns what engine/eagle3.py asks of it at serve time. Its layer reads pairs: at position ``t``, the
embedding of token ``t + 1`` and three target layers' outputs at ``t`` (``fc`` makes them one vector), numbered
by the token's position; it attends to the pairs before, and its output's head drafts token ``t + 2``. The next
draft's pair is the drafted token and that output, at ``t + 1``, and so on for ``DEPTH`` drafts, each attending
to the target's pairs up to ``t`` and to the drafts' own pairs before it (EAGLE-3's "training-time test": every
position of a batch drafts at once, each depth's keys joined to the last's under a diagonal mask). Each draft's
label is the target's greedy token there (given the chat's tokens before), learned only on answer tokens.

The head scores a "hot" vocabulary: the tokens of a few hundred training chats' answers (126 of the demo's
4,096; another 256 chats add ~30 rarer ones, which the drafter never proposes), ``d2t`` mapping each to the
target's id. It starts as the target's own embedding rows for those tokens (Gemma 4 ties its head to them);
the drafter's embedding table is the target's.
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
from vlmserve.testing.eagle3 import eagle3_config

DEPTH = 4  # drafts trained in a row: spec_bench's k
HOT_CHATS = 16  # batches of training chats whose answer tokens make the hot vocabulary


def train_eagle3_drafter(target: Path, out: Path, steps: int = 150, seed: int = 0, batch_size: int = 16,
                         lr: float = 2e-3, scored: int = HELD_OUT) -> dict[str, Any]:
    """Train an EAGLE-3 drafter for the demo model at ``target`` into ``out`` (config.json, model.safetensors,
    training.json); returns what training.json records (``scored``: held-out batches its accuracy is taken on)."""
    from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel, ModelConfig

    start = time.perf_counter()
    model, processor = frozen_target(target)
    target_config = json.loads((target / "config.json").read_text())
    hot = hot_vocabulary(processor, seed, batch_size, target_config["eos_token_id"])
    config = {**eagle3_config(target_config), "draft_vocab_size": len(hot), "dtype": "bfloat16"}
    mx.random.seed(seed)
    drafter = Eagle3DraftModel(ModelConfig.from_dict(config))
    drafter.set_dtype(mx.float32)
    drafter.bind(model)  # the target's embedding table: frozen with it
    ids = mx.array(hot)
    drafter.d2t = ids - mx.arange(len(hot), dtype=mx.int32)  # the speculators' d2t: target id = draft id + d2t
    drafter.freeze(recurse=False, keys=["d2t"])  # a map, not a weight
    drafter.lm_head.weight = mx.array(model.language_model.model.embed_tokens.weight[ids])
    layers = [int(i) for i in drafter.config.capture_layer_ids]
    to_draft = np.full(target_config["text_config"]["vocab_size"], -1, dtype=np.int32)
    to_draft[hot] = np.arange(len(hot))

    def make(host: HostBatch) -> dict[str, Any]:
        return _pairs(target_layers(model, host, layers), to_draft)

    losses = fit(drafter, _loss, make, batches(processor, seed, batch_size), steps, lr, "training a demo EAGLE-3 drafter")
    accuracy = held_out(_loss, drafter, make, batches(processor, seed, batch_size, held_out=True), scored)
    info = {"kind": "eagle3", "steps": steps, "seed": seed, "depth": DEPTH, "hot_vocabulary": len(hot),
            "batch_size": batch_size, "lr": lr, "held_out_accuracy_per_depth": accuracy}
    return save(out, config, parameters(drafter), info, losses, start)


def hot_vocabulary(processor: Any, seed: int, batch_size: int, eos: int | list[int]) -> list[int]:
    """The sorted token ids of ``HOT_CHATS`` batches of training chats' answers, and the end-of-answer ids."""
    stream = batches(processor, seed + 2000, batch_size, held_out=True)
    found = set(eos if isinstance(eos, list) else [eos])
    for _ in range(HOT_CHATS):
        found.update(int(t) for t in next(stream).targets)
    return sorted(found)


def _pairs(batch: dict[str, Any], to_draft: np.ndarray) -> dict[str, Any]:
    """Each depth's input tokens, labels (hot ids) and where they count, for anchors ``t = 0 .. L - DEPTH - 1``."""
    full, answer, greedy = batch["full"], batch["answer"], batch["greedy"]
    n = greedy.shape[1] - DEPTH
    valid = answer[:, 1:n + 1]  # the anchor's pair reads a sampled token
    tokens, labels, counted = [], [], []
    for d in range(1, DEPTH + 1):
        valid = valid & answer[:, d + 1:d + 1 + n]
        tokens.append(full[:, d:d + n])
        labels.append(to_draft[greedy[:, d:d + n]])
        counted.append(valid)
    return {"hidden": batch["hidden"][:, :n], "tokens": mx.array(np.stack(tokens)),
            "labels": mx.array(np.maximum(np.stack(labels), 0)), "counted": mx.array(np.stack(counted)),
            "hot": mx.array(np.stack(labels) >= 0)}


class _Depths:
    """A drafter layer's keys over the depths so far (its ``cache`` argument): each depth's joined to the last's."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
        self.values = values if self.values is None else mx.concatenate([self.values, values], axis=2)
        return self.keys, self.values


def _loss(drafter: nn.Module, batch: dict[str, Any]) -> tuple[mx.array, mx.array]:
    """Cross-entropy of each depth's draft where it counts and its label is hot, summed over the depths (each a
    mean); each depth's accuracy where it counts (a label outside the hot vocabulary is a miss)."""
    model: Any = drafter
    tokens, labels, counted, hot = batch["tokens"], batch["labels"], batch["counted"], batch["hot"]
    n = tokens.shape[-1]
    causal = mx.arange(n)[None, :] <= mx.arange(n)[:, None]
    caches = [_Depths() for _ in model.layers]
    h = model._prepare_target_hidden(batch["hidden"])
    total, accuracies = mx.array(0.0), []
    for d in range(DEPTH):
        seen = mx.concatenate([causal] + [mx.eye(n, dtype=mx.bool_)] * d, axis=1)
        mask = mx.where(seen, 0.0, -mx.inf).astype(h.dtype)
        first, *rest = model.layers
        h = first(model.embed_tokens(tokens[d]), h, mask, caches[0], d + 1)  # the pair's token at t + 1 + d
        for layer, cache in zip(rest, caches[1:]):
            h = layer(h, mask, cache, d + 1)
        logits = model._logits(h)
        weight = (counted[d] & hot[d]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, labels[d])
        total = total + (loss * weight).sum() / mx.maximum(weight.sum(), 1.0)
        right = (mx.argmax(logits, axis=-1) == labels[d]) & hot[d] & counted[d]
        accuracies.append(right.sum() / mx.maximum(counted[d].sum(), 1))
    return total, mx.stack(accuracies)
