"""[worker] The MTP drafter's state of a stored prefix, kept beside the target's KV (issue 58: drafters that remember).

A prefix store keeps a prompt's KV as a list of cache layers; with Qwen3.5's MTP drafter on, one more
"layer" ends the list: ``DraftPrefix``, the drafter's entries for the prefix's positions but its last,
and the target's hidden state at that last position. That position's pair needs the token after the
prefix, which is the next prompt's own (a later turn parts from this one right there), so it waits,
as a prompt's last position waits for its first token. It travels wherever the list does: the memory
stores (copied on reuse), eviction to the disk tier and back (``state``, ``meta_state``: the cache
protocol ``disk_tier.to_host`` reads). A reused prefix then gives the drafter the whole context a cold
prefill would, not only the positions after it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vlmserve.engine.mtp import DraftRows


class DraftPrefix:
    """The drafter's entries for positions ``[position - n, position)`` of one prompt (``keys``/``values``
    per drafter layer, ``[1, kv heads, n, head dim]``) and the hidden state at ``position`` (``[1, 1, H]``);
    empty (``hidden`` None) where the prompt had no drafter state."""

    def __init__(self, keys: list[mx.array] | None = None, values: list[mx.array] | None = None,
                 hidden: mx.array | None = None, position: int = 0) -> None:
        self.keys, self.values = keys or [], values or []
        self.hidden, self.position = hidden, position

    @classmethod
    def of(cls, rows: DraftRows | None, end: int, last_hidden: mx.array | None) -> DraftPrefix:
        """A one-row prompt state for the prefix ending at ``end``: at the prompt's end the last position
        waits already (``rows.waiting``); inside it (a snapshot), its pair with the prompt's own next token
        is the newest entry, dropped here, and ``last_hidden`` is the hidden state there."""
        if rows is None:
            return cls()
        assert len(rows) == 1
        n, hidden = (rows.size, rows.waiting) if rows.waiting is not None else (rows.size - 1, last_hidden)
        if hidden is None or n < 0:
            return cls()
        keys = [k[..., :n, :] for k in rows.keys] if n else []
        values = [v[..., :n, :] for v in rows.values] if n else []
        mx.eval(keys, values, hidden)
        return cls(keys, values, hidden, end - 1)

    def rows(self, layers: int) -> DraftRows | None:
        """The prompt's drafter state as its prefill left it before the waiting pair (None: empty)."""
        if self.hidden is None:
            return None
        n = self.keys[0].shape[2] if self.keys else 0
        rows = DraftRows.start(layers, 1, self.position)
        if n:
            rows.keys, rows.values = list(self.keys), list(self.values)
            rows.valid, rows.size, rows.counts = mx.ones((1, n), dtype=mx.bool_), n, [n]
        rows.waiting = self.hidden
        return rows

    # -- the cache protocol the prefix stores and the disk tier use --------------------

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in [*self.keys, *self.values]) + (self.hidden.nbytes if self.hidden is not None else 0)

    def is_trimmable(self) -> bool:
        return False  # the waiting position is the prefix's last: cut back, it would be another's

    @property
    def state(self) -> tuple[Any, ...]:
        return (tuple(self.keys), tuple(self.values), self.hidden)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        keys, values, hidden = value
        self.keys, self.values, self.hidden = list(keys), list(values), hidden

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.position),)

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        self.position = int(value[0])
