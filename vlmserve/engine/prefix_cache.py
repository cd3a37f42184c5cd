"""[worker] Prefix cache: reuse the KV of the longest cached token prefix.

The text store never serves a prompt with pixel_values past the text before its first image: the
same token ids with a different image must not share KV (the engine asks ``prompt.has_images``, not
the model config's image token: Gemma 4 sets no ``image_token_index``). Prompts with images are kept
in a second store of this class only when the opt-in image-keyed cache is on, under a key that holds
every image's content hash (``engine/caches.py``).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache, PromptTrie, can_trim_prompt_cache, trim_prompt_cache
from mlx_vlm.models.cache import KVCache as VlmKVCache

from vlmserve.engine.disk_tier import DiskTier
from vlmserve.engine.kv_quant import compact_layer

_PLAIN_KV = (KVCache, VlmKVCache)  # mlx-lm's and mlx-vlm's own: the same layout (keys [B, heads, capacity, dim])

log = logging.getLogger(__name__)

_KEY = "model"  # LRUPromptCache is keyed by model too; one cache serves one model


@dataclass(slots=True, frozen=True)
class PrefixCacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    hit_tokens: int
    query_tokens: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries; hit_tokens its hits)
    budget_evictions: int = 0  # entries dropped to give the KV budget to running requests
    disk_hits: int = 0  # lookups served from the disk tier (counted in hits too)
    disk_hit_tokens: int = 0
    pinned: int = 0  # entries kept from eviction until their TTL ends (Anthropic's cache_control)
    limit_bytes: int = 0  # the store's cap (its entries' drafter state included)


@dataclass(slots=True, frozen=True)
class Reuse:
    """A cached prefix a prompt reuses: ``length`` positions of the ``stored`` KV, ``trim`` positions past
    them cut off. The stored layers belong to the store, which never changes them (an entry is replaced,
    not written): held here, they stay whole even if the store evicts the entry before ``take``."""

    stored: list[Any]
    length: int
    trim: int = 0
    private: bool = False  # read back from the disk tier: already the request's own

    def take(self) -> list[Any]:
        """The request's own KV of the prefix."""
        cache = self.stored if self.private else copy.deepcopy(self.stored)
        if self.trim:
            trim_prompt_cache(cache, self.trim)
        return cache


class PrefixCache:
    """An LRU of per-request KV caches bounded in entries and bytes (mlx-lm's trie-backed LRU); with a
    disk tier, what it evicts goes to disk under this store's ``marker`` and is looked up there too.

    An entry stored with a TTL (a request's ``cache_control`` breakpoints) is pinned until it ends: the
    bounds and the KV budget evict every unpinned entry first, then pinned ones, the soonest to expire
    first (running requests still win over pins). A longer entry that replaces a pinned prefix of its own
    (a trimmable cache keeps only the longest) inherits the pin: it still serves that prefix."""

    def __init__(self, max_entries: int, max_bytes: int, tier: DiskTier | None = None, marker: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self._pins: dict[tuple[int, ...], float] = {}  # an entry's tokens -> when its pin ends (clock's time)
        self._clock = clock
        self._lru._lru = _PinnedOrder(self._pins, clock)
        self.tier, self.marker = tier, marker
        if tier is not None:  # every entry the LRU lets go of (its bounds, the KV budget) passes through pop
            self._lru._trie = _SpillingTrie(lambda tokens, cache: tier.spill(marker, tokens, cache))
        self.disk_hits = 0
        self.disk_hit_tokens = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.budget_evictions = 0
        self.oversize = 0  # prompts whose KV alone was more than the store holds (said once in the log)

    def find(self, tokens: list[int]) -> Reuse | None:
        """The longest cached prefix of ``tokens`` to reuse (at least one token is left to compute), not yet
        copied: its ``take`` makes the request's own KV (the runner's, when it enters the request)."""
        reuse = self.search(tokens)
        self.count(len(tokens), reuse)
        return reuse

    def search(self, tokens: list[int]) -> Reuse | None:
        """As ``find``, uncounted: a prompt looked up in two stores is counted once, by the one it reuses."""
        reuse = self._nearest(tokens)
        cached = reuse.length if reuse is not None else 0
        if self.tier is not None and cached < len(tokens) - 1:  # memory fell short of the whole prompt
            found = self.tier.lookup(self.marker, tokens, cached)
            if found is not None:  # more of the prompt than memory had, read back as the request's own
                reuse = Reuse(found[0], found[1], private=True)
        return reuse if reuse is not None and reuse.length > 0 else None

    def count(self, prompt_tokens: int, reuse: Reuse | None) -> None:
        """One prompt of ``prompt_tokens`` looked up here, and what it reuses (None: a miss)."""
        self.query_tokens += prompt_tokens
        if reuse is None:
            self.misses += 1
            return
        self.hits += 1
        self.hit_tokens += reuse.length
        if reuse.private:  # read back from the disk tier
            self.disk_hits += 1
            self.disk_hit_tokens += reuse.length

    def _nearest(self, tokens: list[int]) -> Reuse | None:
        """As mlx-lm's ``LRUPromptCache.fetch_nearest_cache`` chooses (the prompt whole, a longer entry cut
        back where its cache can be, else the longest shorter one), without its copy; the prompt's last
        token is always left to compute (its logits are the first token's)."""
        trie = self._lru._trie
        found = trie.search(_KEY, tokens)
        shorter = len(found.shorter) if found.shorter is not None else 0
        if found.exact is not None:
            stored = trie.get(found.model, found.exact).prompt_cache
            return Reuse(stored, len(tokens) - 1, trim=1) if can_trim_prompt_cache(stored) else None
        if found.longer is not None and found.common_prefix > shorter:
            stored = trie.get(found.model, found.longer).prompt_cache
            if can_trim_prompt_cache(stored):
                keep = min(len(tokens) - 1, found.common_prefix)
                return Reuse(stored, keep, trim=len(found.longer) - keep)
        if found.shorter is not None and shorter:
            return Reuse(trie.get(found.model, found.shorter).prompt_cache, shorter)
        return None

    def store(self, tokens: list[int], cache: list[Any], ttl: float = 0.0) -> None:
        """Keep a finished prefill's KV, compacted (``compact``), pinned for ``ttl`` seconds (0: not); the
        caller must not mutate ``cache`` afterwards. A prompt whose KV alone is more than the store holds
        goes to the disk tier, if any, and never evicts the others for nothing (said once in the log)."""
        cache = compact(cache)
        size = sum(c.nbytes for c in cache)
        if size > self._lru.max_bytes:
            self._oversize(len(tokens), size)
            if self.tier is not None:
                self.tier.spill(self.marker, list(tokens), cache)
            return
        key, now = tuple(tokens), self._clock()
        until = max([now + ttl if ttl > 0 else 0.0, *self._absorbed(key, cache, now)])
        if until > now:  # before the insert: its bounds must not evict the new entry as unpinned
            self._pins[key] = max(until, self._pins.get(key, 0.0))
        self._lru.insert_cache(_KEY, list(tokens), cache)

    def _oversize(self, tokens: int, size: int) -> None:
        self.oversize += 1
        if self.oversize == 1:
            log.warning("a prompt of %d tokens holds %.0f MiB of KV, more than this prefix cache's %.0f MiB: it is "
                        "not kept in memory%s (raise --prefix-cache-gb / --mm-prefix-cache-gb for long sessions)",
                        tokens, size / 2**20, self._lru.max_bytes / 2**20,
                        ", only on disk" if self.tier is not None else "; --prefix-cache-dir keeps it on disk")

    def _absorbed(self, key: tuple[int, ...], cache: list[Any], now: float) -> list[float]:
        """The pins of the stored prefixes of ``key`` that storing it drops (a trimmable cache keeps only
        the longest entry of a path): their ends, now the new entry's."""
        for pinned, until in list(self._pins.items()):
            if until <= now:
                del self._pins[pinned]
        if not can_trim_prompt_cache(cache):
            return []
        shorter = [p for p in self._pins if len(p) < len(key) and key[:len(p)] == p]
        return [self._pins.pop(p) for p in shorter]

    def spill_all(self) -> None:
        """Every entry to the disk tier (a clean shutdown's)."""
        if self.tier is not None:
            self._lru.trim_to(n_sequences=0)

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def release(self, n_bytes: int) -> int:
        """Drop least recently used entries until ``n_bytes`` are freed (or none is left); the bytes freed.
        A request that reused an entry holds its own copy: dropping the entry never touches it."""
        before, entries = self.nbytes, len(self._lru)
        self._lru.trim_to(n_bytes=before - n_bytes)
        self.budget_evictions += entries - len(self._lru)
        return before - self.nbytes

    def stats(self) -> PrefixCacheStats:
        now = self._clock()
        return PrefixCacheStats(len(self._lru), self.nbytes, self.hits, self.misses, self.hit_tokens,
                                self.query_tokens, self.budget_evictions, self.disk_hits, self.disk_hit_tokens,
                                sum(until > now for until in self._pins.values()), int(self._lru.max_bytes))


class _PinnedOrder(LRUPromptCache.CacheOrder):
    """mlx-lm's eviction order, pins first: the least recently stored unpinned entry goes first; when
    every entry is pinned, the one whose pin ends soonest. An evicted entry's pin goes with it."""

    def __init__(self, pins: dict[tuple[int, ...], float], clock: Callable[[], float]) -> None:
        super().__init__()
        self._pins, self._clock = pins, clock

    def pop(self) -> tuple[Any, list[int]]:
        now = self._clock()
        live = {key: until for key, until in self._pins.items() if until > now}
        if not live:  # nothing pinned: mlx-lm's own order
            model, tokens = super().pop()  # type: ignore[no-untyped-call]
        else:
            entries = [entry for lru in self._lrus.values() for entry in lru]
            free = [e for e in entries if tuple(e[1]) not in live]
            model, tokens = free[0] if free else min(entries, key=lambda e: live[tuple(e[1])])
            self.remove(model, tokens)
        self._pins.pop(tuple(tokens), None)
        return model, tokens


class _SpillingTrie(PromptTrie):
    """mlx-lm's prompt trie, handing each entry it pops (evicted) to ``spill`` first."""

    def __init__(self, spill: Callable[[list[int], list[Any]], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx-lm leaves it unannotated
        self.spill = spill

    def pop(self, model: Any, tokens: list[int]) -> Any:
        entry = super().pop(model, tokens)
        if entry is not None:
            self.spill(list(tokens), entry.prompt_cache)
        return entry


def compact(cache: list[Any]) -> list[Any]:
    """The cache with each plain KV layer cut to its filled positions. mlx-lm's and mlx-vlm's ``KVCache``
    grow in 256-position steps, so a stored prompt held up to 255 empty positions per layer (measured: 3.0 MB
    for 1.7 MB of KV at 294 positions). A layer of any other kind is kept as it is; a later prefill
    from the compact copy grows it again."""
    out = []
    for layer in cache:
        if type(layer) in _PLAIN_KV and layer.keys is not None and layer.keys.shape[2] > layer.offset:
            cut = type(layer)()
            cut.keys, cut.values = layer.keys[..., :layer.offset, :], layer.values[..., :layer.offset, :]
            cut.offset = layer.offset
            mx.eval(cut.keys, cut.values)
            layer = cut
        out.append(compact_layer(layer))
    return out
