"""[worker] Speculative decoding's verify step: every decode row's input and draft in one forward.

Each row feeds its input and its draft (``k`` tokens, ragged across rows; a row without one feeds
its input alone, padded). At each of the row's positions the target's own token is sampled exactly
as a decode step would sample it there: the same logits processing, grammar mask and random key
(the key a row splits per token, so a seeded request repeats with or without drafts). The row keeps
its draft up to the first token that differs from the target's, then the target's token there:
``a + 1`` tokens for ``a`` accepted. With a draft that is one token (no distribution), comparing to
the target's sample is rejection sampling: a draft token is kept with its target probability, and
what follows a rejection is the target's. Each row's caches are then cut back to its input and its
accepted tokens (mlx-vlm's speculative cache transaction: trimmed, rolled back or replayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from vlmserve.engine import guided
from vlmserve.engine.batch import DecodeBatch
from vlmserve.engine.drafter import AnyDrafter
from vlmserve.engine.models import ModelAdapter
from vlmserve.engine.plan import Sample
from vlmserve.engine.sampler import RowState, sample


@dataclass(slots=True)
class StepDrafts:
    """A decode step's drafts once the batch's inputs are read: the samples of the step before that
    were still unread (by row id), each row's input, and the draft that follows it (maybe none)."""

    earlier: dict[str, Sample]
    inputs: list[int]
    rows: list[tuple[int, ...]]
    missed: set[str]  # rows whose guess at their input was wrong: one draft token refused, no forward run


@dataclass(slots=True)
class Verified:
    """What one verify forward gave: per row, its tokens in order, and per drafted row (draft tokens
    verified, accepted)."""

    samples: dict[str, list[Sample]]
    counts: dict[str, tuple[int, int]]


def read_drafts(batch: DecodeBatch, drafts: dict[str, tuple[int, ...]]) -> StepDrafts:
    """Read the batch's unread inputs, and keep of each row's planned draft what follows its input:
    where the plan guessed the input (pipelined decode), the rest of the draft if the guess was right."""
    guessed = [u is not None for u in batch.unread]
    earlier = batch.read_unread()
    assert batch.tokens is not None
    inputs = cast(list[int], batch.tokens.tolist())
    out = StepDrafts(earlier, inputs, [], set())
    for rid, guess, token in zip(batch.request_ids, guessed, inputs):
        planned = drafts.get(rid, ())
        if guess and planned and planned[0] != token:
            out.missed.add(rid)
        out.rows.append(planned if not guess else planned[1:] if rid not in out.missed else ())
    return out


def verify(adapter: ModelAdapter, batch: DecodeBatch, drafts: StepDrafts, errors: dict[str, str],
           drafter: AnyDrafter | None = None) -> Verified:
    """Verify each row's draft in one forward; a guided row whose grammar refuses its input lands in
    ``errors``, as in decode. A drafter is given the hidden states at each row's kept positions."""
    assert batch.cache is not None
    inputs, rows = drafts.inputs, drafts.rows
    if guided.guided(batch.sampling):
        refused = guided.consume(batch.sampling, inputs)
        errors.update({batch.request_ids[i]: why for i, why in refused.items()})
        rows = guided.within_grammar(batch.sampling, rows)
    width = 1 + max(len(d) for d in rows)
    tokens = mx.array([[t, *d, *[t] * (width - 1 - len(d))] for t, d in zip(inputs, rows)], dtype=mx.int32)
    row_state, sink = drafter.hidden_sink(batch.row_state) if drafter is not None else (batch.row_state, None)
    logits, transaction = adapter.verify(tokens, batch.cache, row_state)
    try:
        picked, accepted = _pick(logits, batch.sampling, inputs, rows)
    except BaseException:
        transaction.abort()
        raise
    adapter.commit(transaction, batch.cache, accepted, width)
    if drafter is not None and sink:
        drafter.after_verify(batch, [[s.token_id for s in p] for p in picked], drafter.recorded(sink))
    guided.roll_back(batch.sampling, [len(d) - a for d, a in zip(rows, accepted)])
    batch.set_inputs([p[-1].token_id for p in picked])
    counts = {rid: (len(d), a) for rid, d, a in zip(batch.request_ids, rows, accepted) if d}
    return Verified(dict(zip(batch.request_ids, picked)), counts)


def _pick(logits: mx.array, sampling: list[RowState], inputs: list[int],
          drafts: list[tuple[int, ...]]) -> tuple[list[list[Sample]], list[int]]:
    """Sample the target's token at each row's positions (its input's, then each draft token's), read
    them, and keep each row's draft up to its first miss; returns each row's samples and accepted count."""
    where = [(row, j) for row, d in enumerate(drafts) for j in range(len(d) + 1)]
    flat = logits[mx.array([r for r, _ in where]), mx.array([j for _, j in where])]
    keys = [row.key for row in sampling]  # a keyed row splits its key once per position sampled
    allowed = guided.allowed_at(sampling, drafts, flat.shape[-1])
    step = sample(flat, [sampling[r] for r, _ in where], mx.array([inputs[r] for r, _ in where]), allowed)
    tokens = cast(list[int], step.tokens.tolist())
    picked, accepted, at = [], [], 0
    for row, draft in enumerate(drafts):
        ours = tokens[at:at + len(draft) + 1]
        a = next((j for j, (t, d) in enumerate(zip(ours, draft)) if t != d), len(draft))
        picked.append([step.read(at + j) for j in range(a + 1)])
        accepted.append(a)
        _rewind_key(sampling[row], keys[row], a + 1)
        at += len(draft) + 1
    return picked, accepted


def _rewind_key(row: RowState, key: Any, used: int) -> None:
    """A sampled, seeded row's key as if it had sampled ``used`` tokens (its positions past the accepted
    ones were sampled too, and their draws must not be spent)."""
    if key is None or row.params.greedy:
        return
    for _ in range(used):
        key, _ = mx.random.split(key)
    row.key = key

