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
        matcher = row.matcher
        if matcher is None or matcher.is_error():
            continue  # its request fails with this step (consume); meanwhile every token stays possible
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[: words.shape[1]]
        words[i] = 0
        words[i, : bits.size] = bits
    shifts = mx.arange(32, dtype=mx.int32)
    unpacked = (mx.array(words)[:, :, None] >> shifts) & 1  # [B, words, 32], bit j of word w is token 32w+j
    return unpacked.reshape(len(rows), -1)[:, :width].astype(mx.bool_)
