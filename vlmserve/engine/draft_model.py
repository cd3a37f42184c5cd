"""[worker] A draft model (vLLM's and mlx-lm's ``draft_model``): a small model of the target's tokenizer drafting
for it on the same worker, with a KV of its own per row in the continuous batch.

The draft model is an mlx-lm text model (a small one of the target's family: a Qwen2.5 for a Qwen2.5-VL, a
Qwen3 for a Qwen3-VL), loaded with ``mlx_lm.load``; a VLM checkpoint serves through mlx-lm's text view of it.
It reads tokens only, so it sees a row's text: the prompt without its image and video tokens (mlx-lm's server
is text-only; here the target's media placeholders are dropped and the text around them is contiguous), then
every token the row keeps. Its drafts are verified as any others (engine/verify.py): what it sees changes how
many tokens a step keeps, never which.

- **prompt:** as the prompt's row joins the batch (or its prefix is stored), its text goes through the draft
  model in one forward per ``PREFILL_CHUNK`` tokens (``prefill``), then each row's first token, its input
  (``enter``; ``n`` > 1 forks copy the prompt's KV). The prompt's KV is stored with its prefix (a ``DraftPrefix``,
  engine/mtp_prefix.py, in memory and on disk): a prompt that reuses a prefix prefills only its new text, and
  drafts as its cold prefill would. A row whose prefill could not pay (the policy's ``pays_prefill``, decided as
  it is admitted) is *off*: nothing of the draft model's runs for it, and it never drafts;
- **decode and verify:** each target forward leaves the tokens each row kept (``after_decode``,
  ``after_verify``) in the row's ``lag``; they go through the draft model with the row's input when the next
  step drafts, in one forward. A step that does not draft runs nothing of the draft model's, but for a forward
  of the lag every ``LAG`` steps, so that the rows' KV never misses a token;
- **drafting:** ``k`` tokens greedily from each row's output at its input (its *seed*), one forward for every
  drafting row at once per token after the first. The entries the draft tokens write are dropped; the next
  step writes the ones the target accepted again (in its lag's forward): the KV holds what the target kept.

The rows' KV lives in the buffers the MTP drafter uses (``DraftRows``, engine/mtp.py): one column per append
for every row, masked where a row has none there; each row's RoPE position is its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.mtp import DraftColumns, DraftRows
from vlmserve.engine.mtp_prefix import DraftPrefix

if TYPE_CHECKING:
    from vlmserve.engine.batch import DecodeBatch

# mlx-lm's text models whose layers are all plain attention, called as ``layer(h, mask, cache)`` with RoPE at
# ``cache.offset`` (a hybrid such as Qwen3.5's has recurrent layers whose state a rejected draft cannot cut)
SUPPORTED = ("qwen2", "qwen3", "llama")
PREFILL_CHUNK = 2048  # prompt tokens per draft-model forward
TIMED_TOKENS = 64  # a prompt prefill this long or longer measures the draft model's cost per prompt token
LAG = 32  # kept tokens a row may wait with while no step drafts, before they go through the draft model
MEDIA_IDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id")


class DraftModelError(ValueError):
    """The draft model cannot serve this target (one line)."""


@dataclass(slots=True)
class ModelRows:
    """The draft model's per-row state for a batch (or one prompt), in the batch's row order."""

    kv: DraftRows  # its KV (and ``seed``: its output at each row's newest token in it): each row's text but its lag
    lag: mx.array  # [B, W] int32: each row's kept tokens not in ``kv`` yet, its first ``lag_n[row]``
    lag_n: list[int]
    fed: list[bool]  # the row's input is in ``kv`` (it joined with it, or drafted from it this step)
    on: list[bool]  # the row drafts; an off row's ``kv`` holds its first token alone, and its lag stays empty
    # Plain decode steps' inputs ``[B]`` since, every row's (the lag's last columns, kept apart: a step adds none
    # of the ops a ragged append takes)
    steps: list[mx.array] = field(default_factory=list)

    @classmethod
    def merge(cls, parts: list[ModelRows]) -> ModelRows:
        for part in parts:
            part.fold()
        width = max(p.lag.shape[1] for p in parts)
        lag = mx.concatenate([mx.pad(p.lag, [(0, 0), (0, width - p.lag.shape[1])]) for p in parts])
        return cls(DraftRows.merge([p.kv for p in parts]), lag, [n for p in parts for n in p.lag_n],
                   [f for p in parts for f in p.fed], [o for p in parts for o in p.on])

    def __len__(self) -> int:
        return len(self.lag_n)

    def arrays(self) -> list[mx.array]:
        return [*self.kv.arrays(), self.lag]

    def bytes_per_position(self) -> int:
        return self.kv.bytes_per_position()

    def filter(self, index: mx.array, keep: list[int]) -> None:
        self.fold()
        self.kv.filter(index, keep)
        self.lag, self.lag_n, self.fed = self.lag[index], [self.lag_n[i] for i in keep], [self.fed[i] for i in keep]
        self.on = [self.on[i] for i in keep]

    def extend(self, other: ModelRows) -> None:
        merged = ModelRows.merge([self, other])
        self.kv, self.lag, self.lag_n, self.fed, self.on = merged.kv, merged.lag, merged.lag_n, merged.fed, merged.on

    def append(self, tokens: mx.array, lengths: list[int]) -> None:
        """Each row's first ``lengths[row]`` of ``tokens`` ``[B, W]`` after its lag (no host read); none for an
        off row."""
        self.fold()
        lengths = [n if on else 0 for n, on in zip(lengths, self.on)]
        width = max(n + m for n, m in zip(self.lag_n, lengths))
        if width == 0:
            return
        source = mx.arange(width)[None, :] - mx.array(self.lag_n)[:, None]  # where in ``tokens`` each column's is
        taken = (source >= 0) & (source < mx.array(lengths)[:, None])
        tokens = mx.pad(tokens, [(0, 0), (0, max(0, width - tokens.shape[1]))])
        picked = mx.take_along_axis(tokens, mx.clip(source, 0, tokens.shape[1] - 1), axis=1)
        lag = self.lag[:, :width] if self.lag.shape[1] >= width else \
            mx.pad(self.lag, [(0, 0), (0, width - self.lag.shape[1])])
        self.lag = mx.where(taken, picked, lag)
        self.lag_n = [n + m for n, m in zip(self.lag_n, lengths)]

    def fold(self) -> None:
        """The decode steps' inputs into the lag."""
        if self.steps:
            steps, self.steps = mx.stack(self.steps, axis=1), []
            self.append(steps, [steps.shape[1]] * len(self))

    @property
    def waiting(self) -> int:
        """The most tokens a row waits with (an off row waits with none)."""
        return max(self.lag_n, default=0) + len(self.steps) if any(self.on) else 0

    def take_lag(self) -> tuple[mx.array, list[int]]:
        self.fold()
        lag, lengths = self.lag, self.lag_n
        self.lag, self.lag_n = mx.zeros((len(lengths), 0), dtype=mx.int32), [0] * len(lengths)
        return lag, lengths


class _Positions(DraftColumns):
    """The cache a draft-model layer writes through: the MTP's columns, each row's RoPE from its own next
    position (a draft model's layers apply RoPE at ``cache.offset``)."""

    @property
    def offset(self) -> mx.array:  # type: ignore[override]  # per row, where the MTP's is one int
        return self.rows.position


class DraftModel:
    """A loaded draft model; every call runs on the worker that loaded it and its target."""

    reads_prompt = False  # it reads the prompt's tokens, not the target's states: nothing to record in prefill

    def __init__(self, model: nn.Module, media: frozenset[int]) -> None:
        self.model: Any = model
        self.text: Any = getattr(model, "language_model", model)  # mlx-lm's text view of a VLM checkpoint
        self.media = media  # the target's image and video placeholder ids: not the draft model's to see
        self.prefilled = 0  # prompt text tokens put through it (a prefix hit's new text only)
        self.prefill_s, self.prefill_tokens = 0.0, 0  # the timed prefills: their seconds and tokens

    @classmethod
    def load(cls, path: str, target: nn.Module, tokenizer: Any, name: str) -> DraftModel:
        """The draft model at ``path`` for the model ``target`` (served as ``name``, its tokenizer
        ``tokenizer``); DraftModelError, in one line, where it cannot serve it."""
        import mlx_lm

        try:
            model, theirs = cast(tuple[nn.Module, Any], mlx_lm.load(path))
        except Exception as exc:  # noqa: BLE001 - any failure to load is the one-line start-up error
            why = " ".join(str(exc).split())
            raise DraftModelError(f"draft model {path!r} could not be loaded: {type(exc).__name__}: {why}") from exc
        text = getattr(model, "language_model", model)
        kind = type(text).__module__.rsplit(".", 1)[-1]
        if kind not in SUPPORTED or _windowed(text.args):
            raise DraftModelError(f"draft model {path!r} is a {kind} model; this server drafts with "
                                  f"{', '.join(SUPPORTED)} models whose layers all attend to every position")
        if (unlike := _unlike(tokenizer, theirs)) is not None:
            raise DraftModelError(f"draft model {path!r} does not share {name}'s tokenizer: {unlike}")
        return cls(model, _media_ids(target))

    # -- the target's forwards ------------------------------------------------------

    @staticmethod
    def hidden_sink(row_state: dict[str, mx.array]) -> tuple[dict[str, Any], list[mx.array]]:
        """Nothing of the target's to record: a sink that is never empty, so that each forward's kept tokens come."""
        return row_state, [mx.zeros((0,))]

    @staticmethod
    def recorded(sink: list[mx.array]) -> mx.array:
        return sink[0]

    def after_decode(self, batch: DecodeBatch, tokens: mx.array, hidden: mx.array) -> None:
        """After a decode forward: each row's input (maybe still computing) joins its lag, unless it is in the
        KV already."""
        state = _rows(batch)
        assert batch.tokens is not None
        if not any(state.on):
            return
        if any(state.fed):
            state.append(batch.tokens[:, None], [0 if fed else 1 for fed in state.fed])
            state.fed = [False] * len(state)
        else:
            state.steps.append(batch.tokens)
        if state.waiting >= LAG:  # drafting is off: the lag goes in now, not all at once later
            self._catch_up(state)
            mx.async_eval(*state.arrays())  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated

    def after_verify(self, batch: DecodeBatch, picked: list[list[int]], hidden: mx.array) -> None:
        """After a verify forward: each row's input (unless it is in the KV already) and the draft tokens it
        accepted (all it kept but the last, its next input) join its lag."""
        state = _rows(batch)
        assert batch.tokens is not None
        inputs = cast(list[int], batch.tokens.tolist())  # read already (engine/verify.py read_drafts)
        kept = [[*([] if fed else [t]), *p[:-1]] for fed, t, p in zip(state.fed, inputs, picked)]
        width = max(len(k) for k in kept)
        state.append(mx.array([[*k, *[0] * (width - len(k))] for k in kept], dtype=mx.int32), [len(k) for k in kept])
        state.fed = [False] * len(state)

    # -- prompts --------------------------------------------------------------------

    def prefill(self, kv: DraftRows | None, input_ids: mx.array, end: int) -> DraftRows:
        """A prompt's KV (``kv``: the text so far, or None) through the text of its first ``end`` positions."""
        text = [t for t in cast(list[int], input_ids[0, :end].tolist()) if t not in self.media]
        kv = kv if kv is not None else DraftRows.start(len(self.text.model.layers), 1, 0)
        new = text[kv.counts[0]:]
        start = time.perf_counter()
        for first in range(0, len(new), PREFILL_CHUNK):
            self._forward(kv, mx.array([new[first:first + PREFILL_CHUNK]], dtype=mx.int32), None)
            mx.eval(kv.arrays())
        self.prefilled += len(new)
        if len(new) >= TIMED_TOKENS:  # a short one's fixed costs would pass for a prompt token's
            self.prefill_s, self.prefill_tokens = self.prefill_s + time.perf_counter() - start, self.prefill_tokens + len(new)
        kv.seed = None  # a prompt's last output: its first token's replaces it
        return kv

    @property
    def prefill_token_s(self) -> float:
        """The seconds a prompt text token takes through the draft model, measured (0: not yet)."""
        return self.prefill_s / self.prefill_tokens if self.prefill_tokens else 0.0

    def remembered(self, prefix: DraftPrefix) -> DraftRows | None:
        """A stored prefix's KV of its text (None: it has none), at the positions it ends with."""
        kv = prefix.rows(len(self.text.model.layers))
        if kv is not None:
            kv.position = mx.array([kv.size], dtype=mx.int32)  # its own: text positions, not the target's
        return kv

    def enter(self, prompts: list[mx.array], firsts: list[list[int]], kvs: list[DraftRows | None],
              on: list[bool]) -> ModelRows:
        """Prompts' rows (``prompts``: their token ids ``[1, L]``; ``kvs``: their text's KV so far), in order: a
        row per first token (``n`` > 1 forks copy a prompt's KV). Each prompt that drafts (``on``) has its text
        through the draft model, then each row its first token (its input: a row drafts from its input's
        output, its seed); an off prompt's rows start from their first token alone."""
        parts = []
        for input_ids, kv, drafts in zip(prompts, kvs, on):
            kv = self.prefill(kv, input_ids, input_ids.shape[1]) if drafts else \
                DraftRows.start(len(self.text.model.layers), 1, 0)
            parts.append(ModelRows(kv, mx.zeros((1, 0), dtype=mx.int32), [0], [True], [drafts]))
        rows = ModelRows.merge([p for p, tokens in zip(parts, firsts) for _ in tokens])
        self._forward(rows.kv, mx.array([t for tokens in firsts for t in tokens], dtype=mx.int32)[:, None], None)
        mx.eval(rows.arrays())
        return rows

    # -- drafting -------------------------------------------------------------------

    def draft(self, batch: DecodeBatch, rows: list[int], inputs: list[int], k: int) -> dict[int, tuple[int, ...]]:
        """``k`` draft tokens for the batch rows ``rows`` (``inputs``: every row's input). Every row's lag and
        input go into its KV first, in one forward whose last positions are the rows' seeds."""
        state = _rows(batch)
        state.append(mx.array(inputs, dtype=mx.int32)[:, None], [0 if fed else 1 for fed in state.fed])
        self._catch_up(state)
        state.fed = [True] * len(state)
        return dict(zip(rows, self.propose(state.kv, rows, k))) if rows else {}

    def propose(self, kv: DraftRows, which: list[int], k: int) -> list[tuple[int, ...]]:
        """``k`` draft tokens for each of the rows ``which``, from their seeds; read on the host. The entries the
        drafts write are dropped."""
        assert kv.seed is not None
        every = which == list(range(len(kv)))
        if every:
            chain, saved = kv, (kv.size, kv.position, list(kv.counts), kv.seed)
        else:
            index = mx.array(which)
            chain = DraftRows([k_[index] for k_ in kv.keys], [v[index] for v in kv.values], kv.valid[index],
                              kv.size, [kv.counts[i] for i in which], kv.position[index], kv.seed[index])
        token = self._greedy(cast(mx.array, chain.seed))
        drafted = [token]
        for _ in range(k - 1):
            self._forward(chain, token, None)
            token = self._greedy(cast(mx.array, chain.seed))
            drafted.append(token)
        tokens = cast(list[list[int]], mx.concatenate(drafted, axis=1).tolist())
        if every:
            kv.size, kv.position, kv.counts, kv.seed = saved
        return [tuple(t) for t in tokens]

    # -- the forward ----------------------------------------------------------------

    def _catch_up(self, state: ModelRows) -> None:
        """Every row's lag into its KV, in one forward (a row without one keeps its seed)."""
        if state.waiting:
            self._forward(state.kv, *state.take_lag())
            state.kv.compact()

    def _greedy(self, seed: mx.array) -> mx.array:
        """Each row's argmax token ``[B, 1]`` from its seed ``[B, 1, H]``."""
        text = self.text
        if getattr(text.args, "tie_word_embeddings", False):
            logits = text.model.embed_tokens.as_linear(seed)
        else:
            logits = text.lm_head(seed)
        return mx.argmax(logits[:, 0], axis=-1).astype(mx.int32)[:, None]

    def _forward(self, rows: DraftRows, tokens: mx.array, lengths: list[int] | None) -> None:
        """Tokens ``[B, W]`` at each row's next positions, the first ``lengths[row]`` of them real (None: all):
        appends their entries; each row's seed becomes its output at its last real one."""
        text = self.text
        batch, width = tokens.shape
        column = mx.arange(width)
        real = mx.array(lengths, dtype=mx.int32)[:, None, None] if lengths is not None else mx.array(width)
        # A query sees the row's entries, and the new columns up to itself that are real (a padding query sees
        # itself too, so that no row of the mask is empty)
        new = (column[None, None, :] <= column[None, :, None]) & (
            (column[None, None, :] < real) | (column[None, None, :] == column[None, :, None]))
        seen = mx.concatenate([mx.broadcast_to(rows.valid[:, None, :rows.size], (batch, width, rows.size)),
                               mx.broadcast_to(new, (batch, width, width))], axis=-1)
        h = text.model.embed_tokens(tokens)
        mask = mx.where(seen, 0.0, -mx.inf).astype(h.dtype)[:, None]
        for i, layer in enumerate(text.model.layers):
            h = layer(h, mask, _Positions(rows, i))
        used = lengths if lengths is not None else [width] * batch
        rows.valid[:, rows.size:rows.size + width] = column[None, :] < mx.array(used)[:, None]
        rows.size += width
        rows.counts = [c + u for c, u in zip(rows.counts, used)]
        rows.position = rows.position + mx.array(used, dtype=mx.int32)
        last = text.model.norm(h[mx.arange(batch), mx.maximum(mx.array(used) - 1, 0)])[:, None]
        if rows.seed is None or min(used) > 0:
            rows.seed = last
        else:  # a row with nothing here keeps its seed
            rows.seed = mx.where(mx.array(used)[:, None, None] > 0, last, rows.seed)


def _windowed(args: Any) -> bool:
    """Whether a text model's config gives some layers a sliding window (or another kind of layer)."""
    types = getattr(args, "layer_types", None) or ()
    return bool(getattr(args, "use_sliding_window", False)) or any(t != "full_attention" for t in types)


def _unlike(ours: Any, theirs: Any) -> str | None:
    """How the draft model's tokenizer differs from the target's (None: it does not)."""
    mine, other = ours.get_vocab(), theirs.get_vocab()
    if mine == other:
        return None
    differ = sorted(set(mine.items()) ^ set(other.items()), key=lambda item: item[1])
    token = differ[0][0]
    return (f"{len(mine)} tokens against its {len(other)}; e.g. {token!r} is {mine.get(token)} in the target's, "
            f"{other.get(token)} in its own")


def _media_ids(target: Any) -> frozenset[int]:
    """The target's image, video and audio placeholder token ids (its config's, or its text config's)."""
    configs = [target.config, getattr(target.config, "text_config", None)]
    found = {getattr(c, name, None) for c in configs if c is not None for name in MEDIA_IDS}
    return frozenset(i for i in found if isinstance(i, int))


def _rows(batch: DecodeBatch) -> ModelRows:
    assert isinstance(batch.draft, ModelRows) and len(batch.draft) == len(batch), "a decode row without its draft KV"
    return batch.draft
