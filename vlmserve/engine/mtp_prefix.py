"""[worker] A drafter's own state of a stored prefix, kept beside the target's KV (issue 58: drafters that remember).

A prefix store keeps a prompt's KV as a list of cache layers; with a drafter that keeps a KV of its own
(Qwen3.5's MTP, DFlash, a draft model), one more "layer" ends the list: ``DraftPrefix``, the drafter's
entries for the prefix's positions. DFlash's context at a position depends on the target's states there
only: every position of the prefix is kept. A draft model's entries are those of the prefix's text (its
media placeholders are not the draft model's to see): fewer than ``end``, at positions of its own. The MTP drafter's entry pairs a position with the token after it, which
for the prefix's last position is the next prompt's own (a later turn parts from this one right there):
that position's hidden state is kept instead, and waits, as a prompt's last position waits for its
first token. It travels wherever the list does: the memory stores (copied on reuse), eviction to the
disk tier and back (``state``, ``meta_state``: the cache protocol ``disk_tier.to_host`` reads). A reused
prefix then gives the drafter the whole context a cold prefill would, not only the positions after it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vlmserve.engine.mtp import DraftRows


class DraftPrefix:
    """A drafter's entries for one prompt's first ``end`` positions (``keys``/``values`` per drafter layer,
    ``[1, kv heads, n, head dim]``: the newest ``n``), the MTP drafter's but the last, whose hidden state
    (``[1, 1, H]``) waits; empty (``end`` 0) where the prompt had no drafter state."""

    def __init__(self, keys: list[mx.array] | None = None, values: list[mx.array] | None = None,
                 hidden: mx.array | None = None, end: int = 0) -> None:
        self.keys, self.values = keys or [], values or []
        self.hidden, self.end = hidden, end

    @classmethod
    def of(cls, rows: DraftRows | None, end: int, waits: bool, last_hidden: mx.array | None) -> DraftPrefix:
        """A one-row prompt state for the prefix ending at ``end``. ``waits`` (the MTP's): at the prompt's end
        its last position waits already (``rows.waiting``); inside it (a snapshot), that position's pair with
        the prompt's own next token is the newest entry, dropped here, and ``last_hidden`` is its hidden state."""
        if rows is None:
            return cls()
        assert len(rows) == 1
        n, hidden = rows.size, None
        if waits:
            n, hidden = (rows.size, rows.waiting) if rows.waiting is not None else (rows.size - 1, last_hidden)
            if hidden is None or n < 0:
                return cls()
        keys = [k[..., :n, :] for k in rows.keys] if n else []
        values = [v[..., :n, :] for v in rows.values] if n else []
        mx.eval(keys, values, *([hidden] if hidden is not None else []))
        return cls(keys, values, hidden, end)

    def rows(self, layers: int) -> DraftRows | None:
        """The prompt's drafter state as its prefill left it, the waiting position apart (None: empty)."""
        if not self.end:
            return None
        n = self.keys[0].shape[2] if self.keys else 0
        rows = DraftRows.start(layers, 1, self.end - (self.hidden is not None))
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
        return True

    def trim(self, n: int) -> int:
        """The last ``n`` positions cut off (a longer stored prompt serving a shorter one); returns ``n``. A waiting
        position's state is the old last one's: dropped, so the new last position has no entry (a gap in the
        drafter's context; the drafts are still verified): the target's hidden state there is in no stored
        entry (the MTP's pairs it with the old next token), and keeping every position's would cost a hidden
        state per position for a rare hit. Only a family whose caches trim gets here (Gemma 4's with an EAGLE-3
        drafter, or a draft model's target), never Qwen3.5's. A draft model's text entries are cut ``n`` too,
        which may be more than the text among those positions: its prefill reads the rest again."""
        if self.end:
            keep = max(0, (self.keys[0].shape[2] if self.keys else 0) - n)
            self.keys, self.values = [k[..., :keep, :] for k in self.keys], [v[..., :keep, :] for v in self.values]
            self.end, self.hidden = max(0, self.end - n), None if n else self.hidden
        return n

    @property
    def state(self) -> tuple[Any, ...]:
        return (tuple(self.keys), tuple(self.values), self.hidden)

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        keys, values, hidden = value
        self.keys, self.values, self.hidden = list(keys), list(values), hidden

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.end),)

    @meta_state.setter
    def meta_state(self, value: tuple[str, ...]) -> None:
        self.end = int(value[0])
