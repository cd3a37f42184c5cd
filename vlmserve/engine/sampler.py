"""[worker] Per-row sampling over one step's logits: greedy, temperature, top-k/p, min-p, penalties, bias,
min_tokens, logprobs.

``sample`` builds the graph and evaluates nothing, so the runner can dispatch a decode step with
``mx.async_eval`` and read it a step later. Only what some row needs is computed: greedy rows
take an argmax of the raw logits; the full-vocabulary log-softmax runs only for rows that asked
for logprobs; penalties keep each row's recent tokens on the device; a row's ``logit_bias`` goes to
the device once; a row under its ``min_tokens`` has its stop tokens ruled out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import Sample, TokenLogprob

PENALTY_CONTEXT = 64  # how many recent tokens the penalties look at


@dataclass(slots=True)
class RowState:
    """The sampling state of one running request: its params, RNG key and recent tokens (device arrays)."""

    params: SamplingParams
    key: mx.array | None = None
    history: mx.array | None = None  # the last PENALTY_CONTEXT tokens, for penalties only
    matcher: Any = None  # constrained decoding: this request's own copy of its grammar's matcher (engine/guided.py)
    bias: tuple[mx.array, mx.array] | None = None  # logit_bias as device arrays (ids, values), made at first use
    # min_tokens: the tokens that would stop the row (EOS unless ignored, stop_token_ids), ruled out while
    # fewer than min_tokens have been sampled for it (``made``; a verify step counts every position it
    # samples, but rows draft only once past min_tokens, so the count is exact while it matters)
    holds: tuple[int, ...] = ()
    made: int = 0
    held: mx.array | None = None  # ``holds`` as a device array, made at first use

    @classmethod
    def create(cls, params: SamplingParams, context: Sequence[int], eos_token_ids: Iterable[int] = ()) -> RowState:
        key = mx.random.key(params.seed) if params.seed is not None else None
        history = mx.array(list(context[-PENALTY_CONTEXT:]), dtype=mx.int32) if params.needs_history else None
        matcher = params.guide.template.deep_copy() if params.guide is not None else None
        stops = {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}
        return cls(params, key, history, matcher, holds=tuple(sorted(stops)) if params.min_tokens else ())

    @property
    def holding(self) -> bool:
        return bool(self.holds) and self.made < self.params.min_tokens


@dataclass(slots=True)
class SampledBatch:
    """One step's samples, still lazy: ``arrays`` for ``mx.async_eval``, ``read`` once they are needed."""

    tokens: mx.array  # [B] int32
    wants_logprobs: tuple[int, ...]  # per row: 0 none, else 1 + how many top logprobs
    logprobs: mx.array | None = None  # [B] the chosen tokens' logprobs
    top_ids: mx.array | None = None  # [B, K]
    top_logprobs: mx.array | None = None  # [B, K]
    _values: list[list[Any]] | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def read(self, row: int) -> Sample:
        """Row ``row``'s sample; the first read evaluates (and waits for) the whole step."""
        if self._values is None:
            arrays = (self.tokens, self.logprobs, self.top_ids, self.top_logprobs)
            self._values = [cast(list[Any], a.tolist()) for a in arrays if a is not None]
        token = self._values[0][row]
        want = self.wants_logprobs[row]
        if not want:
            return Sample(token)
        top = zip(self._values[2][row][: want - 1], self._values[3][row][: want - 1]) if want > 1 else ()
        # A token the grammar ruled out (-inf) is not among the likely ones, and JSON has no -inf.
        return Sample(token, TokenLogprob(token, self._values[1][row], tuple(t for t in top if t[1] > -math.inf)))


def sample(logits: mx.array, rows: Sequence[RowState], inputs: mx.array | None = None,
           allowed: mx.array | None = None) -> SampledBatch:
    """Pick one token per row of ``logits`` (``[B, vocab]``), lazily; ``inputs`` (decode) are the tokens
    just fed, which join each penalised row's history first; ``allowed`` (``[B, vocab]`` bool, from
    constrained decoding) rules the other tokens out."""
    assert logits.shape[0] == len(rows)
    if any(r.params.needs_history or r.params.logit_bias or r.holding for r in rows):
        logits = mx.concatenate([_hold(_bias(_penalize(logits[i], r, inputs, i), r), r)[None]
                                 for i, r in enumerate(rows)])
    for row in rows:
        row.made += 1
    if allowed is not None:
        logits = mx.where(allowed, logits, -math.inf)
    wants = tuple((1 + r.params.top_logprobs) if r.params.logprobs else 0 for r in rows)
    if all(r.params.greedy for r in rows):
        tokens = mx.argmax(logits, axis=-1)
    else:
        tokens = mx.concatenate([_sample_row(logits[i : i + 1], r) for i, r in enumerate(rows)])
    out = SampledBatch(tokens.astype(mx.int32), wants)
    if any(wants):
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        out.logprobs = mx.take_along_axis(logprobs, out.tokens[:, None], axis=-1)[:, 0]
        k = max(wants) - 1
        if k:
            out.top_ids = mx.argsort(-logprobs, axis=-1)[:, :k]
            out.top_logprobs = mx.take_along_axis(logprobs, out.top_ids, axis=-1)
    return out


def _sample_row(logits: mx.array, row: RowState) -> mx.array:
    p = row.params
    if p.greedy:
        return mx.argmax(logits, axis=-1)
    # Shift-invariant from here on, so unnormalised logits sample as logprobs would.
    scores = logits.astype(mx.float32) / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = mx.sort(scores, axis=-1)[:, -p.top_k][:, None]
        scores = mx.where(scores < kth, -math.inf, scores)
    if p.min_p > 0:
        floor = mx.max(scores, axis=-1, keepdims=True) + math.log(p.min_p)
        scores = mx.where(scores < floor, -math.inf, scores)
    if p.top_p < 1:
        scores = _top_p(scores, p.top_p)
    if row.key is None:
        return mx.random.categorical(scores, axis=-1)
    row.key, sub = mx.random.split(row.key)
    return mx.random.categorical(scores, axis=-1, key=sub)


def _top_p(scores: mx.array, top_p: float) -> mx.array:
    probs = mx.softmax(scores, axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, scores, -math.inf)


def _penalize(logits: mx.array, row: RowState, inputs: mx.array | None, i: int) -> mx.array:
    """One row (``[vocab]``): repetition, presence and frequency penalties over its recent tokens."""
    p = row.params
    if not p.needs_history:
        return logits
    assert row.history is not None
    if inputs is not None:
        row.history = mx.concatenate([row.history, inputs[i : i + 1].astype(mx.int32)])[-PENALTY_CONTEXT:]
    if row.history.size == 0:
        return logits
    logits = logits.astype(mx.float32)
    counts = mx.zeros(logits.shape, dtype=mx.float32).at[row.history].add(1.0)
    seen = counts > 0
    if p.repetition_penalty != 1.0:
        rp = p.repetition_penalty
        logits = mx.where(seen, mx.where(logits < 0, logits * rp, logits / rp), logits)
    return logits - p.presence_penalty * seen - p.frequency_penalty * counts


def _hold(logits: mx.array, row: RowState) -> mx.array:
    """One row (``[vocab]``) with its stop tokens ruled out while it is under its ``min_tokens``."""
    if not row.holding:
        return logits
    if row.held is None:
        row.held = mx.array([t for t in row.holds if t < logits.shape[-1]], dtype=mx.int32)
    return logits.at[row.held].add(-math.inf) if row.held.size else logits


def _bias(logits: mx.array, row: RowState) -> mx.array:
    """One row (``[vocab]``) with its request's ``logit_bias`` added; ids past the logits are ignored."""
    if not row.params.logit_bias:
        return logits
    if row.bias is None:
        kept = [(t, b) for t, b in row.params.logit_bias if t < logits.shape[-1]]
        row.bias = (mx.array([t for t, _ in kept], dtype=mx.int32), mx.array([b for _, b in kept], dtype=mx.float32))
    ids, values = row.bias
    if ids.size == 0:
        return logits
    return logits.astype(mx.float32).at[ids].add(values)
