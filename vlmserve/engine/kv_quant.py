"""[worker] Quantized KV (``--kv-bits``): full-attention layers keep their keys and values packed.

As mlx-lm's and mlx-vlm's ``generate_step`` do: a layer's cache turns into a quantized one
(``mx.quantize``, ``bits`` per value, a scale and a bias per ``group_size`` values) after the first
forward that leaves it holding ``start`` positions or more; from then on every new position is
quantized as it is written, and attention reads the packed cache (mlx-vlm's quantized attention).
So a prompt shorter than ``start`` is served in full precision, and a prompt's first forward is
computed exactly, as a single mlx-vlm request computes it. The oracle in the tests is mlx-vlm's own
``generate_step(kv_bits=...)``.

One departure, where mlx-lm loses accuracy for nothing: a later forward of several positions (a long
prompt's next chunk, a prompt after a reused prefix) attends to its own positions exact and to the
stored ones dequantized, where mlx-lm's cache packs the chunk before attending to it
(``PackedKVCache``). On SmolLM2-135M's logprobs over 600 tokens in chunks of 64, the mean error
against full precision falls from mlx-lm's 0.018 nats to 0.006 at 8 bits and from 0.34 to 0.12 at 4
(benchmarks/kv_quant_accuracy.py). Decode, one position a step, reads the packed
cache through mlx-vlm's quantized attention, as mlx-lm does.

Only plain KV layers are quantized. Sliding-window layers (a ring buffer, rotated in place) and
recurrent or convolution state stay in full precision: mlx-vlm quantizes neither. A decode batch's
rows share one cache per layer, so the batch is quantized as a whole: when a quantized row joins,
or when its longest row reaches ``start``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models import cache as lm_cache
from mlx_vlm.models import cache as vlm_cache

_SINGLE = (lm_cache.KVCache, vlm_cache.KVCache)
_BATCH = (lm_cache.BatchKVCache, vlm_cache.BatchKVCache)
_QUANTIZED = (vlm_cache.QuantizedKVCache, vlm_cache.BatchQuantizedKVCache)


class PackedKVCache(vlm_cache.QuantizedKVCache):
    """mlx-vlm's quantized cache, whose forward of several positions gets floats: the stored positions
    dequantized and its own exact (they are stored packed all the same). mlx-vlm's attention picks the
    quantized kernel where a cache has ``bits``, so ``bits`` is hidden while a fetch is floats; the
    next fetch or ``KVQuant.settle`` (after every forward) shows it again."""

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        self.floats = False
        super().__init__(group_size=group_size, bits=bits)

    @property
    def bits(self) -> int:
        if self.floats:
            raise AttributeError("bits")  # hasattr(cache, "bits") is False: mlx-vlm attends to floats
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self.floats = False
        prev, width = self.offset, keys.shape[2]
        fetched = super().update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
        if width == 1 or prev == 0:
            return fetched
        stored = [self._dequantize(parts, prev) for parts in (cast(Any, self.keys), cast(Any, self.values))]
        self.floats = True
        return (mx.concatenate([stored[0].astype(keys.dtype), keys], axis=2),
                mx.concatenate([stored[1].astype(values.dtype), values], axis=2))

    def _dequantize(self, parts: tuple[mx.array, mx.array, mx.array], length: int) -> mx.array:
        packed, scales, biases = (p[..., :length, :] for p in parts)
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self._bits)


@dataclass(slots=True, frozen=True)
class KVQuant:
    """What ``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start`` ask for."""

    bits: int
    group_size: int = 64
    start: int = 0

    def settle(self, cache: list[Any]) -> None:
        """Quantize, in place, each plain layer that holds ``start`` positions or more (an empty layer
        waits for its first forward)."""
        for i, layer in enumerate(cache):
            if isinstance(layer, PackedKVCache):
                layer.floats = False
            size = _positions(layer)
            if size and size >= self.start:
                cache[i] = self.quantized(layer)

    def quantized(self, layer: Any) -> Any:
        """``layer`` with its KV packed (a plain cache, one request's or a batch's); any other as it is."""
        if isinstance(layer, lm_cache.CacheList):
            layer.caches = tuple(self.quantized(c) for c in layer.caches)
            return layer
        if type(layer) in _SINGLE:
            out: Any = PackedKVCache(group_size=self.group_size, bits=self.bits)
            if layer.keys is not None:
                out.keys, out.values = self._pack(layer.keys, layer.offset), self._pack(layer.values, layer.offset)
            out.offset = layer.offset
            return out
        if type(layer) in _BATCH:
            batch: Any = vlm_cache.BatchQuantizedKVCache([0], group_size=self.group_size, bits=self.bits)
            if layer.keys is not None:
                batch.keys, batch.values = self._pack(layer.keys, layer._idx), self._pack(layer.values, layer._idx)
            batch.offset, batch.left_padding, batch._idx = layer.offset, layer.left_padding, layer._idx
            return batch
        return layer

    def _pack(self, x: mx.array, length: int) -> tuple[mx.array, ...]:
        if x.shape[-1] % self.group_size:
            raise ValueError(f"--kv-group-size {self.group_size} does not divide this model's head size "
                             f"{x.shape[-1]}: choose one that does (32 divides every family's)")
        packed: tuple[mx.array, ...] = tuple(mx.quantize(x[..., :length, :], group_size=self.group_size,
                                                         bits=self.bits))
        return packed

    def align(self, batch: list[Any], rows: list[Any]) -> None:
        """Before ``rows`` (batch caches) join ``batch``: where one side's layer is quantized and the
        other's is not, quantize the other, in place."""
        for i, (mine, theirs) in enumerate(zip(batch, rows)):
            if is_quantized(mine) != is_quantized(theirs):
                batch[i], rows[i] = self.quantized(mine), self.quantized(theirs)


def is_quantized(layer: Any) -> bool:
    if isinstance(layer, lm_cache.CacheList):
        return any(is_quantized(c) for c in layer.caches)
    return isinstance(layer, _QUANTIZED)


def merge_rows(layer: Any, rows: int) -> Any:
    """One request's layer cache copied into a batch cache of ``rows`` rows (n > 1 forks): what
    ``type(layer).merge`` does, for the quantized cache too (mlx-vlm gives it no ``merge``)."""
    if not isinstance(layer, vlm_cache.QuantizedKVCache):
        return type(layer).merge([layer] * rows)
    layer = cast(Any, layer)  # mlx-vlm types a fresh cache's keys as None
    batch: Any = vlm_cache.BatchQuantizedKVCache([0] * rows, group_size=layer.group_size, bits=layer.bits)
    if layer.keys is not None and layer.offset:
        batch.keys, batch.values = (_rows(layer.keys, layer.offset, rows), _rows(layer.values, layer.offset, rows))
        batch.offset = mx.array([layer.offset] * rows)
        batch._idx = layer.offset
    return batch


def _rows(parts: Sequence[mx.array], length: int, rows: int) -> tuple[mx.array, ...]:
    return tuple(mx.concatenate([p[..., :length, :]] * rows) if rows > 1 else p[..., :length, :] for p in parts)


def compact_layer(layer: Any) -> Any:
    """A quantized single-request layer cut to its filled positions (stored prefixes hold no spare
    capacity); any other layer as it is."""
    if not isinstance(layer, vlm_cache.QuantizedKVCache):
        return layer
    layer = cast(Any, layer)  # mlx-vlm types a fresh cache's keys as None
    if layer.keys is not None and layer.keys[0].shape[2] > layer.offset:
        cut: Any = type(layer)(group_size=layer.group_size, bits=layer.bits)
        cut.keys, cut.values = _rows(layer.keys, layer.offset, 1), _rows(layer.values, layer.offset, 1)
        cut.offset = layer.offset
        mx.eval(cut.keys, cut.values)
        return cut
    return layer


def _positions(layer: Any) -> int:
    """The positions a plain layer holds (0 for any other, and for an empty one)."""
    if isinstance(layer, lm_cache.CacheList):
        return max((_positions(c) for c in layer.caches), default=0)
    if type(layer) in _SINGLE:
        return int(layer.offset) if layer.keys is not None else 0
    if type(layer) in _BATCH:
        return int(layer._idx) if layer.keys is not None else 0
    return 0


def kv_quant_for(cache: list[Any], config_bits: int | None, group_size: int, start: int, family: str | None,
                 reads_target_kv: bool, pipeline: bool) -> tuple[KVQuant | None, str | None]:
    """The quantization one model is served with (None: full precision), and why it is off where it
    was asked for: ``cache`` is a fresh one-request cache of the model, ``family`` why its family cannot
    (the adapter's ``packs_kv``), ``reads_target_kv`` a drafter that reads the target's KV as floats
    (Gemma 4's assistant), ``pipeline`` serving across ranks."""
    if config_bits is None:
        return None, None
    if family is not None:
        return None, family
    if pipeline:
        return None, "the ranks of a pipeline keep full-precision KV (each rank would have to pack its own)"
    if reads_target_kv:
        return None, "the drafter reads the target's KV as floats (Gemma 4's assistant)"
    if not any(_plain(layer) for layer in cache):
        return None, "no layer keeps plain KV (sliding-window and recurrent state stay in full precision)"
    return KVQuant(config_bits, group_size, start), None


def _plain(layer: Any) -> bool:
    if isinstance(layer, lm_cache.CacheList):
        return any(_plain(c) for c in layer.caches)
    return type(layer) in _SINGLE
