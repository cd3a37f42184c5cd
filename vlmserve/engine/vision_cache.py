"""[worker] The vision cache: one image's features, computed once, for every request that shows it.

A chat about one picture sends it again on every turn. The prefix cache cannot help (KV computed
with one image must never serve another, so image prompts skip it), but the vision tower's output
depends on the image alone. Keys are phase 1's hashes of each image's processed pixel arrays
(preprocess/image_items.py); values are ``mx.array`` features in the language model's space,
bounded in bytes, least recently used first out. An audio clip's tower output is kept here too, in
the same budget and counters, keyed ``audio:`` and its decoded samples' hash (preprocess/audio.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx


@dataclass(slots=True, frozen=True)
class VisionCacheStats:
    entries: int
    bytes: int
    limit_bytes: int
    hits: int
    misses: int
    evictions: int


class VisionCache:
    """An LRU of image features bounded in bytes; features larger than the whole budget are not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, mx.array] = OrderedDict()
        self.bytes = self.hits = self.misses = self.evictions = 0

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is kept, without counting a hit or a miss (the scheduler's question)."""
        return key in self._entries

    def get(self, key: str) -> mx.array | None:
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return features

    def put(self, key: str, features: mx.array) -> None:
        if key in self._entries or features.nbytes > self.max_bytes:
            return
        while self._entries and self.bytes + features.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
        self._entries[key] = features
        self.bytes += features.nbytes

    def stats(self) -> VisionCacheStats:
        return VisionCacheStats(len(self._entries), self.bytes, self.max_bytes, self.hits, self.misses, self.evictions)
