"""[worker] The decode batch: every per-row tensor and state of the running requests, in one row order.

KV cache rows, per-row model state (e.g. M-RoPE ``rope_deltas`` ``[B, 1]``), sampling rows and
each row's next input token live here and nowhere else. ``extend`` and ``filter`` move them
together, so a row can never be paired with another request's state (mlx-lm's GenerationBatch).

Decode is pipelined: a row's next input may still be computing (``mx.async_eval``) when the next
step is built on it; ``unread`` says where to read it once the next step is on its way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from vlmserve.engine.plan import Sample
from vlmserve.engine.sampler import RowState, SampledBatch


@dataclass(slots=True)
class DecodeBatch:
    request_ids: list[str] = field(default_factory=list)
    cache: list[Any] | None = None  # left-padded batch caches, one per layer
    row_state: dict[str, mx.array] = field(default_factory=dict)  # name -> [B, ...]
    sampling: list[RowState] = field(default_factory=list)
    tokens: mx.array | None = None  # [B] int32: each row's last sampled token, its next input (maybe in flight)
    # Per row: the step whose sample ``tokens`` holds and the row there, until it is read and reported.
    unread: list[tuple[SampledBatch, int] | None] = field(default_factory=list)
    # With a drafter (engine/drafter.py): the last forward's recorded hidden states ``[B', W, H]``, and
    # per row where in them its newest position's is (the drafter's input with the row's input token);
    # None until a decode gives one.
    hidden: mx.array | None = None
    hidden_at: list[tuple[int, int] | None] = field(default_factory=list)
    # A drafter with a KV of its own (engine/mtp.py): its rows, moved with the batch's
    draft: Any = None

    def __len__(self) -> int:
        return len(self.request_ids)

    def extend(self, request_ids: list[str], cache: list[Any], row_state: dict[str, mx.array],
               sampling: list[RowState], tokens: list[int], draft: Any = None) -> None:
        """Append prefilled requests as the last rows; ``cache`` holds their rows (batch caches), ``draft``
        their drafter state where the drafter keeps one."""
        assert not set(request_ids) & set(self.request_ids)
        assert not self.request_ids or row_state.keys() == self.row_state.keys(), "rows must carry the same state"
        first = mx.array(tokens, dtype=mx.int32)
        if self.cache is None or self.tokens is None:
            self.cache, self.row_state, self.tokens, self.draft = cache, dict(row_state), first, draft
        else:
            assert (draft is None) == (self.draft is None), "every row has a drafter state, or none"
            if draft is not None:
                self.draft.extend(draft)
            for layer, rows in zip(self.cache, cache):
                layer.extend(rows)
            self.row_state = {k: mx.concatenate([v, row_state[k]]) for k, v in self.row_state.items()}
            self.tokens = mx.concatenate([self.tokens, first])
        self.request_ids += request_ids
        self.sampling += sampling
        self.unread += [None] * len(request_ids)  # their first tokens went out with their prefill
        self.hidden_at += [None] * len(request_ids)

    def remove(self, request_ids: Iterable[str]) -> None:
        gone = set(request_ids)
        if gone.intersection(self.request_ids):
            self.filter([i for i, rid in enumerate(self.request_ids) if rid not in gone])

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order) of every per-row thing; frees the others' KV."""
        self.request_ids = [self.request_ids[i] for i in keep]
        self.sampling = [self.sampling[i] for i in keep]
        self.unread = [self.unread[i] for i in keep]
        self.hidden_at = [self.hidden_at[i] for i in keep]
        if not keep:
            self.cache, self.row_state, self.tokens, self.hidden, self.draft = None, {}, None, None, None
            return
        index = mx.array(keep)
        if self.draft is not None:
            self.draft.filter(index, keep)
        for layer in self.cache or []:
            layer.filter(index)
        self.row_state = {k: v[index] for k, v in self.row_state.items()}
        assert self.tokens is not None
        self.tokens = self.tokens[index]

    def record_hidden(self, hidden: mx.array, columns: list[int]) -> None:
        """A forward's recorded hidden states; each row's newest position is at its ``columns`` entry."""
        self.hidden, self.hidden_at = hidden, [(row, column) for row, column in enumerate(columns)]

    def read_unread(self) -> dict[str, Sample]:
        """Read every row's unread input now (it waits for the step computing it): the samples not
        reported yet, by row. Each row's input is then known on the host (``tokens`` is evaluated)."""
        unread, self.unread = self.unread, [None] * len(self.request_ids)
        return {rid: where[0].read(where[1]) for rid, where in zip(self.request_ids, unread) if where is not None}

    def set_inputs(self, tokens: list[int]) -> None:
        """Each row's next input, known on the host (after a verify: every sample was read)."""
        assert len(tokens) == len(self.request_ids)
        self.tokens = mx.array(tokens, dtype=mx.int32)
        self.unread = [None] * len(tokens)

    def advance(self, step: SampledBatch) -> dict[str, Sample]:
        """``step`` (dispatched, not read) becomes every row's next input; returns the samples of the
        step before it, read now: the rows' current inputs that were not reported yet."""
        unread, self.unread = self.unread, [(step, i) for i in range(len(self.request_ids))]
        self.tokens = step.tokens
        return {rid: where[0].read(where[1]) for rid, where in zip(self.request_ids, unread) if where is not None}
