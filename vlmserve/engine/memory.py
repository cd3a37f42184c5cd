"""[worker] The KV-cache memory budget: what a request's cache costs, and whether a batch fits.

A decode batch keeps one left-padded KV tensor per layer, so every row costs as many positions
as the longest row. Admission therefore bounds ``rows x bytes(longest need)``, where a request's
need is its prompt plus ``max_tokens`` (capped at the context): reserved up front, so a batch that
was admitted can always run to its end. The bytes per position are measured once, after the
warm-up, from a real prefilled cache of the model's own layer types: full attention grows with
every position, sliding-window layers stop at their window, recurrent and convolution state
(Qwen3.5, LFM2-VL) is a fixed cost per row; an MTP drafter's own KV (engine/mtp.py) grows with every
position too. With quantized KV (engine/kv_quant.py) the measure is of the packed cache, and where
packing starts past the prompt, of both: a row costs what it holds before, or after, whichever is more. The prefix stores (text, and image-keyed) have their own
bounds and count against this budget too: the scheduler drops their least recently used prefixes
when a batch that fits without them needs the room, and after a store, so that the stores and the
running requests' reservations never hold more than the budget together.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import EncodeChunk, NewRequest, PrefillChunk, SchedulerOutput
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.decode_budget import give_memory_back


@dataclass(slots=True, frozen=True)
class KVFootprint:
    """Bytes one row of the cache holds at a number of positions."""

    per_position: int = 0  # over the full-attention layers
    windows: tuple[tuple[int, int], ...] = ()  # (bytes per position, window) of sliding-window layers
    fixed: int = 0  # state that does not grow with positions
    # Quantized KV from a start (--quantized-kv-start > 0): (bytes per position once packed, the start).
    # Before it the full-attention layers cost ``per_position`` each; from it, all their positions are packed.
    packed: tuple[int, int] | None = None

    def row_bytes(self, positions: int) -> int:
        windowed = sum(per * min(positions, window) for per, window in self.windows)
        full = self.per_position * positions
        if self.packed is not None:  # the most it holds on its way there: just before, or at the end
            per, start = self.packed
            full = max(self.per_position * min(positions, start), per * positions)
        return full + windowed + self.fixed

    @classmethod
    def measure(cls, cache: Sequence[Any]) -> KVFootprint:
        """From one request's prefilled cache (mlx-lm's KVCache, RotatingKVCache, ArraysCache, and the
        quantized caches, whose keys and values are each a packed array, scales and biases)."""
        per_position, windows, fixed = 0, [], 0
        for layer in cache:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            parts = [*_parts(keys), *_parts(values)]
            if parts and keys is not None and values is not None:
                per = sum(p.nbytes for p in parts) // max(1, parts[0].shape[2])  # [batch, heads, positions, dim]
                window = getattr(layer, "max_size", None)
                if window:
                    windows.append((per, int(window)))
                else:
                    per_position += per
            else:
                fixed += sum(a.nbytes for a in _arrays(getattr(layer, "state", ())))
        return cls(per_position, tuple(windows), fixed)


def _parts(x: Any) -> list[Any]:
    """A layer's keys (or values) as arrays: one, or a quantized cache's three; none if not arrays."""
    parts = list(x) if isinstance(x, tuple) else [x]
    return parts if all(hasattr(p, "shape") and hasattr(p, "nbytes") for p in parts) else []


def measure_footprint(runner: Any, prompt: PromptInputs) -> KVFootprint:
    """Prefill ``prompt`` alone through an idle runner (a ModelRunner) and measure its cache: one
    plan to enter and embed it, one to prefill it whole, one to let it go."""
    probe = "kv-probe"
    assert not runner.batch, "measure the footprint on an idle runner"
    try:
        out = runner.execute(SchedulerOutput(new=[NewRequest(probe, prompt, SamplingParams(max_tokens=1))],
                                             encode=[EncodeChunk(probe)]))
        if not out.errors:
            out = runner.execute(SchedulerOutput(prefill=[PrefillChunk(probe, 0, out.prompt_lengths[probe])]))
        if out.errors:
            raise RuntimeError(f"could not measure the KV cache: {out.errors[probe]}")
        footprint = KVFootprint.measure(runner.batch.cache)
        quant = runner.adapter.kv_quant
        if quant is not None and quant.start > 0:  # packed from a start: what a packed row costs, too
            packed = KVFootprint.measure([quant.quantized(layer) for layer in runner.batch.cache])
            footprint = replace(footprint, packed=(packed.per_position, quant.start))
        draft = runner.batch.draft  # a drafter with a KV of its own (engine/mtp.py): an entry per position too
        if draft is not None:
            footprint = replace(footprint, per_position=footprint.per_position + draft.bytes_per_position())
        return footprint
    finally:
        runner.execute(SchedulerOutput(finished=[probe]))


def _arrays(state: Any) -> Iterable[Any]:
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "nbytes") and hasattr(item, "shape"):
            yield item


@dataclass(slots=True)
class KVBudget:
    """Admission's memory bound; ``limit_bytes`` None means unbounded (the footprint is still known)."""

    limit_bytes: int | None
    footprint: KVFootprint = KVFootprint()

    def batch_bytes(self, needs: Sequence[int]) -> int:
        """What a batch of rows with these needs (positions) holds at most."""
        return len(needs) * self.footprint.row_bytes(max(needs)) if needs else 0

    def fits(self, needs: Sequence[int]) -> bool:
        return self.limit_bytes is None or len(needs) <= 1 or self.batch_bytes(needs) <= self.limit_bytes

    def refusal(self, need: int, rows: int = 1) -> str | None:
        """Why a request of this need (``rows`` of it: n > 1) can never run, however empty the batch;
        None if it can."""
        if self.limit_bytes is None:
            return None
        cost = self.footprint.row_bytes(need) * rows
        if cost <= self.limit_bytes:
            return None
        return (f"its KV cache would take {cost / 2**20:.1f} MiB ({need} positions: prompt + max_tokens), "
                f"over this server's KV budget of {self.limit_bytes / 2**20:.1f} MiB; lower max_tokens or "
                "shorten the prompt")


def held_bytes(cache: Sequence[Any] | None) -> int:
    """Bytes a cache's layers hold now, as allocated (a KVCache grows its arrays in steps, so more than
    its positions need); the caches ``KVFootprint.measure`` reads."""
    total = 0
    for layer in cache or ():
        parts = [*_parts(getattr(layer, "keys", None)), *_parts(getattr(layer, "values", None))]
        total += sum(p.nbytes for p in parts) if parts else sum(a.nbytes for a in _arrays(getattr(layer, "state", ())))
    return total


def batch_memory(batch: Any) -> tuple[int, int]:
    """A decode batch's (KV bytes, its drafter's own state's bytes) now; (0, 0) for a runner without one."""
    if batch is None:
        return 0, 0
    draft = batch.draft.nbytes() if batch.draft is not None and hasattr(batch.draft, "nbytes") else 0
    return held_bytes(batch.cache), draft


_CACHE_LIMIT_READ = threading.Lock()  # two workers reading at once would leave the cap at the probe's value
_cache_limit: int | None = None


def mlx_cache_limit() -> int:
    """[any] MLX's buffer-cache cap. MLX has no getter for it; setting one returns the one before, which is
    put straight back. Setting takes the allocator's lock, which an evaluation in flight holds: the call
    waits for the step being computed. Each step reading it that way undid the pipelining of decode (the
    next step's graph was built only after the one dispatched before had finished), so the cap is read
    once per process. Nothing in vlmserve sets it after."""
    global _cache_limit
    with _CACHE_LIMIT_READ:
        if _cache_limit is None:
            _cache_limit = mx.set_cache_limit(1 << 62)
            mx.set_cache_limit(_cache_limit)
        return _cache_limit


def mlx_memory() -> tuple[int, int, int]:
    """[any] MLX's active bytes, its buffer cache's and that cache's cap: the process's, every stream's.
    The two getters read counters and never wait for an evaluation in flight."""
    return mx.get_active_memory(), mx.get_cache_memory(), mlx_cache_limit()


def give_back() -> None:
    """[any] After an engine stopped and was dropped (a model unloaded): collect what still refers to its
    arrays, empty MLX's buffer cache, and hand the freed heap back to the system (``malloc_trim``).
    MLX's cache is the process's, not a stream's: any thread may empty it."""
    gc.collect()
    mx.clear_cache()
    give_memory_back()
