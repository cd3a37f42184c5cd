"""[main] What the demo drafters' training shares (``drafter.py``: mtp, ``drafter_dflash.py``, ``drafter_eagle3.py``):
the frozen target, its forward over a batch of the demo's own chats, the training loop and the files written.

Every array is made on the calling thread; only the batches' host work (``batches.prefetch``) runs beside it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from vlmserve.blas import openblas_preloaded
from vlmserve.testing.demo.batches import HostBatch, batch_stream, prefetch

DRAFTER_INFO = "training.json"
HELD_OUT = 8  # held-out batches each drafter is scored on

Loss = Callable[[nn.Module, dict[str, Any]], tuple[mx.array, mx.array]]  # (loss, accuracy per drafted token)


def frozen_target(path: Path) -> tuple[nn.Module, Any]:
    """The demo model at ``path`` in float32, frozen, and its processor."""
    from mlx_vlm import load

    model, processor = load(str(path))
    model.freeze()
    model.set_dtype(mx.float32)
    return model, processor


def embedded(model: nn.Module, host: HostBatch) -> tuple[mx.array, dict[str, Any]]:
    """A batch's token ids and the keywords its language model's forward takes (images embedded)."""
    ids = mx.array(host.input_ids)
    arrays = {k: mx.array(v) for k, v in host.arrays.items()}
    pixel_values = arrays.pop("pixel_values", None)
    features = model.get_input_embeddings(ids, pixel_values, mask=mx.ones(ids.shape, dtype=mx.int32), **arrays)
    extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    return ids, {"inputs_embeds": features.inputs_embeds, **arrays, **extra}


def answers(host: HostBatch) -> tuple[np.ndarray, np.ndarray]:
    """``[B, L + 1]`` token ids (the batch's inputs and its last targets) and whether each is an answer token."""
    rows, width = host.input_ids.shape
    full = np.zeros((rows, width + 1), dtype=np.int32)
    full[:, :width] = host.input_ids
    answer = np.zeros((rows, width + 1), dtype=bool)
    row, state = np.divmod(host.positions, width)
    full[row, state + 1] = host.targets
    answer[row, state + 1] = True
    return full, answer


def target_layers(model: nn.Module, host: HostBatch, layers: list[int]) -> dict[str, Any]:
    """The frozen target over one batch: the outputs of its decoder ``layers`` side by side (``hidden``,
    ``[B, L, layers * H]``: what the engine records, engine/models/base.py), its greedy next token at every
    position (``greedy``, ``[B, L]``: the labels, so the drafter learns what the target would answer), the
    tokens and which are answers."""
    ids, keywords = embedded(model, host)
    out = model.language_model(ids, capture_layer_ids=sorted(layers), **keywords)
    hidden = mx.concatenate(out.hidden_states, axis=-1)
    greedy = mx.argmax(out.logits, axis=-1).astype(mx.int32)
    mx.eval(hidden, greedy)
    full, answer = answers(host)
    return {"hidden": mx.stop_gradient(hidden), "greedy": np.array(greedy), "full": full, "answer": answer}


def batches(processor: Any, seed: int, batch_size: int, held_out: bool = False) -> Iterator[HostBatch]:
    """The seeded stream of training chats (another for the held-out score), drawn ahead on a thread."""
    stream = batch_stream(processor, np.random.default_rng([seed + (1000 if held_out else 0), 7]), batch_size)
    return stream if held_out else prefetch(stream)


def fit(drafter: nn.Module, loss: Loss, make: Callable[[HostBatch], dict[str, Any]], stream: Iterator[HostBatch],
        steps: int, lr: float, desc: str) -> list[float]:
    """``steps`` AdamW steps (cosine decay, gradients clipped to 1) of ``loss`` on the drafter's trainable
    parameters, each on ``make`` of the stream's next batch; every step's loss."""
    from vlmserve.progress import progress

    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr * 0.05), weight_decay=0.0)
    grad = nn.value_and_grad(drafter, loss)
    losses: list[float] = []
    with progress(range(steps), desc=desc, file=sys.stderr) as bar:
        for _ in bar:
            (value, _), grads = grad(drafter, make(next(stream)))
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            optimizer.update(drafter, grads)
            mx.eval(value, drafter.parameters(), optimizer.state)
            losses.append(float(value.item()))
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return losses


def held_out(loss: Loss, drafter: nn.Module, make: Callable[[HostBatch], dict[str, Any]],
             stream: Iterator[HostBatch], count: int = HELD_OUT) -> list[float]:
    """Each drafted token's accuracy on answer positions of ``count`` held-out batches (teacher-forced:
    given the tokens before it were right)."""
    totals: np.ndarray | None = None
    for _ in range(count):
        _, accuracy = loss(drafter, make(next(stream)))
        row = np.array(accuracy.tolist())
        totals = row if totals is None else totals + row
    assert totals is not None
    return [round(float(a) / count, 4) for a in totals]


def save(out: Path, config: dict[str, Any], weights: dict[str, mx.array], info: dict[str, Any],
         losses: list[float], start: float) -> dict[str, Any]:
    """config.json, model.safetensors (bfloat16, as the demo model is stored) and training.json into ``out``;
    returns what training.json records."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    stored = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), stored)
    info = {**info, "first_loss": round(losses[0], 4), "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "train_seconds": round(time.perf_counter() - start, 1), "mlx": mx.__version__,
            "blas": "OpenBLAS preloaded" if openblas_preloaded() else "the mlx wheel's own BLAS"}
    (out / DRAFTER_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def parameters(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, mx.array]:
    """A module's parameters by their dotted names, less those starting with one of ``skip``."""
    return {k: v for k, v in tree_flatten(module.parameters()) if not k.startswith(skip)}
