"""[main] Distill a draft model cut from its target (vlmserve/testing/draft_model.py) on the target's own
next-token choices, in a few CPU minutes: what makes benchmarks/spec_bench.py's ``draft_model`` cell on the
real-weights SmolLM2-135M a drafter at all (its first layers alone agree with the target on ~2% of tokens).

The target is the whole text model in the same mlx-lm layout (``build_draft_model(target, dir)`` with every
layer). Each step runs it over a batch of chats (ChatML-free plain sequences: a prompt and an answer, both
from Python's own docstrings, and passages to repeat, so that the draft sees the copy and free-writing shapes
the benchmark asks of it) and trains the draft's layers and final norm, teacher-forced, on the target's
greedy token at every position: acceptance in greedy verify is exactly agreement with that token. The
embeddings and head stay the target's own (frozen), as a draft cut from it shares them.
"""

from __future__ import annotations

import json
import pydoc
import random
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

MODULES = ("json", "textwrap", "argparse", "collections", "pathlib", "asyncio", "dataclasses", "functools",
           "itertools", "logging", "random", "re", "string", "subprocess", "threading", "typing", "unittest",
           "email", "http.client", "urllib.request", "shutil", "tempfile", "inspect", "socket", "csv", "enum")


def corpus(seed: int = 0) -> list[str]:
    """English paragraphs: the docstrings of the standard library's modules, their classes and functions."""
    import importlib

    paragraphs: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            doc = pydoc.getdoc(obj) if callable(obj) or obj is module else ""
            paragraphs += [p.replace("\n", " ") for p in doc.split("\n\n") if len(p) > 120 and ">>>" not in p]
    paragraphs = sorted(set(paragraphs))
    random.Random(seed).shuffle(paragraphs)
    return paragraphs


def chats(tokenizer: Any, paragraphs: list[str], seed: int) -> list[list[int]]:
    """One chat per paragraph: repeat it (every third), or a question with a paragraph as its answer."""
    rng = random.Random(seed)
    out = []
    for i, text in enumerate(paragraphs):
        if i % 3 == 0:
            ask, answer = f"Repeat the following passage word for word.\n\n{text}", text
        else:
            ask, answer = f"Explain this: {rng.choice(paragraphs)[:80]}", text
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=True))
    return out


def _batches(sequences: list[list[int]], size: int, length: int, seed: int) -> Any:
    rng = random.Random(seed)
    while True:
        picked = [rng.choice(sequences)[:length] for _ in range(size)]
        width = max(len(s) for s in picked)
        yield mx.array([s + [0] * (width - len(s)) for s in picked]), mx.array(
            [[1.0] * len(s) + [0.0] * (width - len(s)) for s in picked])


def _forward(model: nn.Module, tokens: mx.array) -> mx.array:
    return model(tokens)


def agreement(draft: nn.Module, target: nn.Module, sequences: list[list[int]]) -> float:
    """The share of positions where the draft's greedy token is the target's (teacher-forced)."""
    hits = total = 0
    for seq in sequences:
        tokens = mx.array([seq])
        same = (_forward(draft, tokens).argmax(-1) == _forward(target, tokens).argmax(-1))
        hits, total = hits + int(same.sum().item()), total + len(seq)
    return hits / total


def distill(target_dir: Path, draft_dir: Path, minutes: float = 4.0, batch_size: int = 8, length: int = 192,
            lr: float = 3e-4, seed: int = 0) -> dict[str, Any]:
    """Train the draft model at ``draft_dir`` (in place) toward the target at ``target_dir`` for ``minutes``;
    returns the teacher-forced agreement on held-out chats before and after, and the steps taken."""
    import mlx_lm

    target, tokenizer = mlx_lm.load(str(target_dir))
    draft, _ = mlx_lm.load(str(draft_dir))
    target.freeze()
    draft.freeze()
    for layer in draft.model.layers:
        layer.unfreeze()
    draft.model.norm.unfreeze()
    sequences = chats(tokenizer, corpus(seed), seed)
    held, train = sequences[:12], sequences[12:]
    before = agreement(draft, target, held)
    optimizer = optim.Adam(learning_rate=lr)

    def loss_fn(model: nn.Module, tokens: mx.array, labels: mx.array, mask: mx.array) -> mx.array:
        losses = nn.losses.cross_entropy(_forward(model, tokens), labels)
        return (losses * mask).sum() / mask.sum()

    step_fn = nn.value_and_grad(draft, loss_fn)
    deadline, steps = time.monotonic() + minutes * 60, 0
    for tokens, mask in _batches(train, batch_size, length, seed):
        labels = mx.stop_gradient(_forward(target, tokens).argmax(-1))
        loss, grads = step_fn(draft, tokens, labels, mask)
        optimizer.update(draft, grads)
        mx.eval(draft.parameters(), optimizer.state, loss)
        steps += 1
        if steps % 5 == 0:
            print(f"step {steps}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            break
    after = agreement(draft, target, held)
    mx.save_safetensors(str(draft_dir / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    info = {"steps": steps, "minutes": minutes, "agreement_before": round(before, 3), "agreement_after": round(after, 3)}
    (draft_dir / "distill.json").write_text(json.dumps(info, indent=1))
    return info
