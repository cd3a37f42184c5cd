"""[worker] Constrained decoding inside the batched step: each guided row's allowed tokens, as a mask.

Every step, each guided row's matcher (llguidance, on the CPU) first consumes the token the row
is about to be fed, then writes the bitmask of tokens its grammar allows next. Unguided rows get
an all-ones mask, so ``where(allowed, logits, -inf)`` leaves their logits exactly as they were:
a constrained request batches with unconstrained ones and changes none of their tokens. A batch
without guided rows builds no mask at all, and keeps its pipelined decode.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


def guided(rows: Sequence[Any]) -> bool:
    return any(r.matcher is not None for r in rows)


def consume(rows: Sequence[Any], tokens: Sequence[int]) -> dict[int, str]:
    """Each guided row's matcher takes the token fed to it in this step; returns the rows whose
    grammar refused it (row -> why). They cannot be constrained any more: the caller fails them
    rather than let them go on unconstrained."""
    refused = {}
    for i, (row, token) in enumerate(zip(rows, tokens)):
        if row.matcher is not None and not row.matcher.is_error() and not row.matcher.consume_token(int(token)):
            error = row.matcher.get_error().splitlines()[0] if row.matcher.get_error() else "no detail"
            log.warning("constrained decoding: the grammar refused token %d: %s", token, error)
            refused[i] = f"constrained decoding failed: the grammar refused token {token} ({error})"
    return refused


def allowed(rows: Sequence[Any], width: int) -> mx.array | None:
    """``[B, width]`` bool: the tokens each row may sample next; None when no row is guided."""
    if not guided(rows):
        return None
    words = np.full((len(rows), math.ceil(width / 32)), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        _fill(words[i], row.matcher)
    return _unpack(words, width)


def within_grammar(rows: Sequence[Any], drafts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Each row's draft up to the first token its grammar refuses (a guided row's matcher has consumed
    the row's input already); drafted tokens past it could never be accepted."""
    out = []
    for row, draft in zip(rows, drafts):
        matcher = row.matcher
        if matcher is not None and draft:
            draft = draft[: matcher.validate_tokens(list(draft))] if not matcher.is_error() else ()
        out.append(draft)
    return out


def allowed_at(rows: Sequence[Any], drafts: list[tuple[int, ...]], width: int) -> mx.array | None:
    """``[positions, width]`` bool for a verify: at each row's input and draft tokens in turn, what its
    grammar allows after the draft tokens before it. Each guided matcher is left having consumed its
    whole draft (``roll_back`` then undoes the rejected part). None when no row is guided."""
    if not guided(rows):
        return None
    words = np.full((sum(len(d) + 1 for d in drafts), math.ceil(width / 32)), -1, dtype=np.int32)
    at = 0
    for row, draft in zip(rows, drafts):
        for j in range(len(draft) + 1):
            _fill(words[at + j], row.matcher)
            if j < len(draft) and row.matcher is not None and not row.matcher.is_error():
                row.matcher.consume_token(int(draft[j]))
        at += len(draft) + 1
    return _unpack(words, width)


def roll_back(rows: Sequence[Any], counts: Sequence[int]) -> None:
    """Undo the last ``counts[i]`` tokens row ``i``'s matcher consumed (its rejected draft tokens)."""
    for row, n in zip(rows, counts):
        if row.matcher is not None and n and not row.matcher.is_error():
            row.matcher.rollback(n)


def _fill(words: np.ndarray, matcher: Any) -> None:
    """One row of packed allow bits from ``matcher`` (left all ones without a grammar)."""
    if matcher is None or matcher.is_error():
        return  # its request fails with this step (consume); meanwhile every token stays possible
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[: words.shape[0]]
    words[:] = 0
    words[: bits.size] = bits


def _unpack(words: np.ndarray, width: int) -> mx.array:
    shifts = mx.arange(32, dtype=mx.int32)
    unpacked = (mx.array(words)[:, :, None] >> shifts) & 1  # [N, words, 32], bit j of word w is token 32w+j
    return unpacked.reshape(words.shape[0], -1)[:, :width].astype(mx.bool_)
