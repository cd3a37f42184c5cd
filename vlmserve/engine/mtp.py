"""[worker] Qwen3.5's MTP drafter (mlx-vlm's ``qwen3_5_mtp``, the ``mtp`` kind): a decoder layer with a KV of its own.

The drafter reads pairs: at position ``p``, the embedding of token ``p + 1`` and the target's final
(normed) hidden state at ``p``; its output there predicts token ``p + 2``. Its KV holds one entry per
pair, so every position a row has must pass through it once, prompt included (mlx-vlm's
``prefill_from_target_hidden``):

- **prompt:** each prefill chunk's hidden states are recorded as each target forward returns them (the
  adapter's ``hidden_sink``: mlx-vlm's ``return_hidden``) and run through the drafter with the prompt's
  next tokens; the last position waits for the first sampled token (``first``). A prompt that reuses a
  cached prefix starts from the drafter state stored with it (engine/mtp_prefix.py), whose last position
  waits for this prompt's next token;
- **decode and verify:** each target forward leaves every row's kept positions with the tokens kept
  there (``after_decode``, ``after_verify``: a verify keeps ``a + 1``, ragged). They go through the
  drafter when the next step drafts, before it drafts; a step that does not draft drops them, so a
  step without drafts costs nothing more than without a drafter (the drafter's KV then has a gap,
  and its drafts are as good as what it saw);
- **drafting:** from each row's newest output (its *seed*), ``k`` tokens, one forward each for every
  drafting row at once; the entries those write are dropped afterwards (``propose``). The next step
  writes the accepted ones again from the target's own hidden states, where mlx-vlm keeps the
  drafter's: the drafts can differ from mlx-vlm's after an accepted one, never the output.

The rows' entries live in one buffer per drafter layer (``DraftRows``), appended in place at one column
for every row: attention does not depend on the order of keys, only on which are masked, so a row's
entries need not be contiguous. A ragged append leaves masked columns; ``compact`` gathers each row's
entries to the front when they take more than they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from vlmserve.engine.batch import DecodeBatch
    from vlmserve.engine.models import ModelAdapter

GROW = 256  # columns the buffers grow by (mlx-lm's KVCache step)


@dataclass(slots=True)
class DraftRows:
    """The drafter's per-row state for a batch (or one prompt), in the batch's row order."""

    keys: list[mx.array]  # per drafter layer: [B, kv heads, capacity, head dim]
    values: list[mx.array]
    valid: mx.array  # [B, capacity]: which columns hold an entry of the row's
    size: int  # columns in use (the same for every row)
    counts: list[int]  # per row: its entries (host-side, for compaction)
    position: mx.array  # [B] int32: the position of each row's next pair
    seed: mx.array | None = None  # [B, 1, H]: each row's output at its newest pair
    waiting: mx.array | None = None  # a prompt's last hidden state [1, 1, H], until its first token
    # The last target forward's pairs, until a step drafts: tokens [B, W], hidden [B, W, H], per row how many
    pending: tuple[mx.array, mx.array, list[int]] | None = None

    @classmethod
    def start(cls, layers: int, rows: int, position: int) -> DraftRows:
        return cls([mx.zeros((0,))] * layers, [mx.zeros((0,))] * layers,
                   mx.zeros((rows, 0), dtype=mx.bool_), 0, [0] * rows, mx.full((rows,), position, dtype=mx.int32))

    def __len__(self) -> int:
        return len(self.counts)

    def arrays(self) -> list[mx.array]:
        """What to evaluate (a prompt's state, with its cache)."""
        return [*([self.waiting] if self.waiting is not None else []), *self.keys, *self.values, self.valid, self.position, *([self.seed] if self.seed is not None else [])]

    def bytes_per_position(self) -> int:
        """What one position of one row holds in the drafter's layers (its keys and values)."""
        if not self.size:
            return 0
        return sum((k.nbytes + v.nbytes) // (k.shape[0] * k.shape[2]) for k, v in zip(self.keys, self.values))

    def filter(self, index: mx.array, keep: list[int]) -> None:
        if self.size:
            self.keys = [k[index] for k in self.keys]
            self.values = [v[index] for v in self.values]
        self.valid, self.position = self.valid[index], self.position[index]
        self.counts = [self.counts[i] for i in keep]
        if self.seed is not None:
            self.seed = self.seed[index]
        if self.pending is not None:
            tokens, hidden, lengths = self.pending
            self.pending = tokens[index], hidden[index], [lengths[i] for i in keep]

    @classmethod
    def merge(cls, parts: list[DraftRows]) -> DraftRows:
        """Rows of several states, in order, as one (each's columns padded with masked ones to the longest)."""
        size = max(p.size for p in parts)
        shaped = next((p.keys[0] for p in parts if p.size), None)

        def columns(p: DraftRows, a: mx.array) -> mx.array:
            if not p.size:
                assert shaped is not None
                return mx.zeros((len(p), shaped.shape[1], size, shaped.shape[3]), dtype=shaped.dtype)
            a = a[..., :p.size, :]
            return mx.pad(a, [(0, 0), (0, 0), (0, size - p.size), (0, 0)]) if size > p.size else a

        layers = range(len(parts[0].keys))
        if shaped is None:
            keys, values = [mx.zeros((0,))] * len(layers), [mx.zeros((0,))] * len(layers)
        else:
            keys = [mx.concatenate([columns(p, p.keys[i]) for p in parts]) for i in layers]
            values = [mx.concatenate([columns(p, p.values[i]) for p in parts]) for i in layers]
        valid = mx.concatenate([mx.pad(p.valid[:, :p.size], [(0, 0), (0, size - p.size)]) for p in parts])
        seeds = [p.seed for p in parts]
        seed = mx.concatenate(cast(list[mx.array], seeds)) if all(s is not None for s in seeds) else None
        return cls(keys, values, valid, size, [c for p in parts for c in p.counts],
                   mx.concatenate([p.position for p in parts]), seed, pending=_merge_pending(parts))

    def extend(self, other: DraftRows) -> None:
        merged = DraftRows.merge([self, other])
        for name in DraftRows.__slots__:
            setattr(self, name, getattr(merged, name))

    def reserve(self, width: int, like: mx.array) -> None:
        """Room for ``width`` more columns (``like``: new keys ``[B, kv heads, width, head dim]``)."""
        if self.keys[0].ndim == 4 and self.keys[0].shape[2] >= self.size + width:
            return
        grow = ((self.size + width - 1) // GROW + 1) * GROW
        rows, heads, _, dim = like.shape
        for kv in (self.keys, self.values):
            for i, buf in enumerate(kv):
                fresh = mx.zeros((rows, heads, grow, dim), dtype=like.dtype)
                kv[i] = mx.concatenate([buf[..., :self.size, :], fresh], axis=2) if self.size else fresh
        self.valid = mx.concatenate([self.valid[:, :self.size], mx.zeros((rows, grow), dtype=mx.bool_)], axis=1)

    def compact(self) -> None:
        """Each row's entries to the front, where masked columns are most of what is stored."""
        most = max(self.counts, default=0)
        if self.size <= 2 * most + GROW // 4:
            return
        column = mx.arange(self.size)
        order = mx.argsort(mx.where(self.valid[:, :self.size], column, column + self.size), axis=1)[:, :most]
        self.keys = [mx.take_along_axis(k[..., :self.size, :], order[:, None, :, None], axis=2) for k in self.keys]
        self.values = [mx.take_along_axis(v[..., :self.size, :], order[:, None, :, None], axis=2) for v in self.values]
        self.valid = mx.arange(most)[None, :] < mx.array(self.counts)[:, None]
        self.size = most


def _merge_pending(parts: list[DraftRows]) -> tuple[mx.array, mx.array, list[int]] | None:
    """The parts' pending pairs as one batch's: a part without any has none for its rows (length 0)."""
    pending = [p.pending for p in parts]
    shaped = next((q for q in pending if q is not None), None)
    if shaped is None:
        return None
    width, size = max(q[0].shape[1] for q in pending if q is not None), shaped[1].shape[2]
    tokens, hidden, lengths = [], [], []
    for part, q in zip(parts, pending):
        t, h, n = q if q is not None else (mx.zeros((len(part), 0), dtype=mx.int32),
                                           mx.zeros((len(part), 0, size), dtype=shaped[1].dtype), [0] * len(part))
        tokens.append(mx.pad(t, [(0, 0), (0, width - t.shape[1])]))
        hidden.append(mx.pad(h, [(0, 0), (0, width - h.shape[1]), (0, 0)]))
        lengths += n
    return mx.concatenate(tokens), mx.concatenate(hidden), lengths


class DraftColumns:
    """The cache a drafter layer writes through: the state's columns ``[size, size + L)`` for every row."""

    def __init__(self, rows: DraftRows, layer: int) -> None:
        self.rows, self.layer = rows, layer

    @property
    def offset(self) -> int:
        return self.rows.size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rows, i, start = self.rows, self.layer, self.rows.size
        end = start + keys.shape[2]
        rows.reserve(keys.shape[2], keys)
        rows.keys[i][..., start:end, :] = keys
        rows.values[i][..., start:end, :] = values
        return rows.keys[i][..., :end, :], rows.values[i][..., :end, :]


class MtpDrafter:
    """A loaded Qwen3.5 MTP drafter, bound to its target; every call runs on the worker that loaded both."""

    reads_prompt = True  # its KV needs every position's hidden state, the prompt's included

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        self.model: Any = model
        self.adapter = adapter  # the target's: its forwards record their hidden states while asked

    # -- the target's hidden states -------------------------------------------------

    def hidden_sink(self, row_state: dict[str, mx.array]) -> tuple[dict[str, Any], list[mx.array]]:
        """Record the next target forwards' final hidden states (in the list returned) until ``recorded``."""
        sink: list[mx.array] = []
        self.adapter.hidden_sink = sink
        return row_state, sink

    def recorded(self, sink: list[mx.array]) -> mx.array:
        """The recorded hidden states, ``[B, L, H]`` (several forwards of the same rows, side by side);
        stops recording."""
        self.adapter.hidden_sink = None
        assert len({h.shape[0] for h in sink}) == 1, f"forwards of different rows: {[h.shape for h in sink]}"
        return sink[0] if len(sink) == 1 else mx.concatenate(sink, axis=1)

    # -- prompts --------------------------------------------------------------------

    def prefill(self, rows: DraftRows | None, input_ids: mx.array, hidden: mx.array, end: int) -> DraftRows:
        """A prompt's positions ``[end - L, end)`` (``hidden``: ``[1, L, H]``) into its drafter state,
        each with the prompt's next token; the prompt's last position waits for its first token. A state
        restored with a reused prefix has the prefix's last position waiting: it goes first."""
        if rows is not None and rows.waiting is not None:
            hidden, rows.waiting = mx.concatenate([rows.waiting, hidden], axis=1), None
        start, last = end - hidden.shape[1], input_ids.shape[1] - 1
        if rows is None:
            rows = DraftRows.start(len(self.model.layers), 1, start)
        stop = min(end, last)
        if stop > start:
            self._forward(rows, input_ids[:, start + 1:stop + 1], hidden[:, :stop - start], None)
        if end > last:
            rows.waiting = hidden[:, -1:]
        return rows  # evaluated with the prompt's own cache (``arrays``), so its hidden states are not held

    def first(self, prompts: list[DraftRows], tokens: list[list[int]]) -> DraftRows:
        """Prefilled prompts' rows, in order: a row per first token (``n`` > 1 forks copy a prompt's
        state), each first token paired with its prompt's last position: each row's seed."""
        assert all(p.waiting is not None for p in prompts), "a prompt's drafter state before its end"
        rows = DraftRows.merge([p for p, t in zip(prompts, tokens) for _ in t])
        waiting = mx.concatenate([cast(mx.array, p.waiting) for p, t in zip(prompts, tokens) for _ in t])
        for p in prompts:
            p.waiting = None
        self._forward(rows, mx.array([t for ts in tokens for t in ts], dtype=mx.int32)[:, None], waiting, None)
        return rows

    # -- decode ---------------------------------------------------------------------

    def after_decode(self, batch: DecodeBatch, tokens: mx.array, hidden: mx.array) -> None:
        """After a decode forward: each row's position with its new token (``tokens`` ``[B]``, maybe still
        computing), kept for the next step that drafts."""
        _rows(batch).pending = tokens[:, None], hidden, [1] * len(batch)

    def after_verify(self, batch: DecodeBatch, picked: list[list[int]], hidden: mx.array) -> None:
        """After a verify forward: each row's kept positions (``len(picked[row])``) with the tokens kept,
        kept for the next step that drafts."""
        width = max(len(p) for p in picked)
        tokens = mx.array([[*p, *[p[-1]] * (width - len(p))] for p in picked], dtype=mx.int32)
        _rows(batch).pending = tokens, hidden[:, :width], [len(p) for p in picked]

    def draft(self, batch: DecodeBatch, rows: list[int], inputs: list[int], k: int) -> dict[int, tuple[int, ...]]:
        """``k`` draft tokens for the batch rows ``rows``: the last forward's pairs go in first (every row's
        seed is then its newest position's; its inputs are in it)."""
        state = _rows(batch)
        if state.pending is not None:
            tokens, hidden, lengths = state.pending
            state.pending = None
            self._forward(state, tokens, hidden, lengths)
        return dict(zip(rows, self.propose(state, rows, k))) if rows else {}

    def propose(self, rows: DraftRows, which: list[int], k: int) -> list[tuple[int, ...]]:
        """``k`` draft tokens for each of the rows ``which``, from their seeds; read on the host. The
        entries the drafts write are dropped: the next step writes the kept ones from the target's states."""
        assert rows.seed is not None
        every = which == list(range(len(rows)))
        if every:
            chain = rows
            saved = (rows.size, rows.position, rows.seed, list(rows.counts))
        else:
            index = mx.array(which)
            chain = DraftRows([k_[index] for k_ in rows.keys], [v[index] for v in rows.values], rows.valid[index],
                              rows.size, [rows.counts[i] for i in which], rows.position[index], rows.seed[index])
        state = cast(mx.array, chain.seed)
        token = self._greedy(state)
        drafted = [token]
        for _ in range(k - 1):
            self._forward(chain, token, state, None, compact=False)
            state = cast(mx.array, chain.seed)
            token = self._greedy(state)
            drafted.append(token)
        tokens = cast(list[list[int]], mx.concatenate(drafted, axis=1).tolist())
        if every:
            rows.size, rows.position, rows.seed, rows.counts = saved
        return [tuple(t) for t in tokens]

    # -- the forward ----------------------------------------------------------------

    def _greedy(self, state: mx.array) -> mx.array:
        return cast(mx.array, self.model._greedy_token(state)).astype(mx.int32)

    def _forward(self, rows: DraftRows, tokens: mx.array, hidden: mx.array, lengths: list[int] | None,
                 compact: bool = True) -> None:
        """Pairs (``tokens`` ``[B, L]``, target ``hidden`` ``[B, L, H]``) at each row's next positions, the
        first ``lengths[row]`` of them real (None: all); appends their entries and sets each row's seed."""
        batch, width = tokens.shape
        column = mx.arange(width)
        real = mx.array(lengths, dtype=mx.int32)[:, None, None] if lengths is not None else mx.array(width)
        # Each query sees the row's entries, and the new columns up to itself that are real (a padding
        # query sees itself too, so that no row of the mask is empty)
        new = (column[None, None, :] <= column[None, :, None]) & (
            (column[None, None, :] < real) | (column[None, None, :] == column[None, :, None]))
        old = rows.valid[:, None, :rows.size]
        seen = mx.concatenate([mx.broadcast_to(old, (batch, width, rows.size)),
                               mx.broadcast_to(new, (batch, width, width))], axis=-1)
        out = self._layers(rows, tokens, hidden, seen[:, None])
        used = lengths if lengths is not None else [width] * batch
        rows.valid[:, rows.size:rows.size + width] = column[None, :] < mx.array(used)[:, None]
        rows.size += width
        rows.counts = [c + u for c, u in zip(rows.counts, used)]
        rows.position = rows.position + mx.array(used, dtype=mx.int32)
        last = out[mx.arange(batch), mx.maximum(mx.array(used) - 1, 0)][:, None]
        if rows.seed is None or min(used) > 0:
            rows.seed = last
        else:  # a row with no pair here (it joined after the forward) keeps its seed
            rows.seed = mx.where(mx.array(used)[:, None, None] > 0, last, rows.seed)
        if compact:  # not between a draft's forwards: their columns are dropped by size
            rows.compact()

    def _layers(self, rows: DraftRows, tokens: mx.array, hidden: mx.array, seen: mx.array) -> mx.array:
        """The drafter's layers over pairs at each row's next positions (``seen`` ``[B, 1, W, size + W]``: what
        each one attends to), their entries written into ``rows``; the output its head reads, a row's seed."""
        model = self.model
        embed = model._input_embed(tokens) * model._input_embed_scale
        h = model.fc(mx.concatenate([model.pre_fc_norm_embedding(embed), model.pre_fc_norm_hidden(hidden)], -1))
        mask = mx.where(seen, 0.0, -mx.inf).astype(h.dtype)
        positions = rows.position[:, None] + mx.arange(tokens.shape[1])[None, :]
        for i, layer in enumerate(model.layers):
            h = layer(h, mask=mask, cache=DraftColumns(rows, i), position_ids=positions)
        return cast(mx.array, model.norm(h))


def _rows(batch: DecodeBatch) -> DraftRows:
    assert isinstance(batch.draft, DraftRows) and len(batch.draft) == len(batch), "a decode row without its drafter state"
    return batch.draft
