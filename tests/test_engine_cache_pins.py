"""Pinned prefixes (Anthropic's cache_control) in the prefix cache: kept from eviction until their TTL ends,
on a clock the test moves; real mlx-lm KV layers in the real store."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from vlmserve.engine.prefix_cache import PrefixCache, compact


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kv(n: int) -> list[KVCache]:
    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 1, n, 2)), mx.ones((1, 1, n, 2)))
    return [layer]


def prompt(topic: int, n: int = 8) -> list[int]:
    return [topic * 100 + i for i in range(n)]


def cached(store: PrefixCache, tokens: list[int]) -> int:
    reuse = store.search(tokens + [7])  # the prompt and one more token: its whole self if kept
    return reuse.length if reuse is not None else 0


def test_a_pinned_prefix_outlives_any_number_of_others_until_its_ttl_ends():
    clock = Clock()
    store = PrefixCache(4, 1 << 30, clock=clock)
    store.store(prompt(1), kv(8), ttl=300)
    store.store(prompt(2), kv(8))  # the same without a pin
    for topic in range(3, 23):  # 20 other prompts through a store of 4
        store.store(prompt(topic), kv(8))
    assert (cached(store, prompt(1)), cached(store, prompt(2))) == (8, 0)
    assert store.stats().pinned == 1 and store.stats().entries == 4
    clock.now += 301  # the TTL has ended: an entry like any other, the least recently stored
    store.store(prompt(30), kv(8))
    assert cached(store, prompt(1)) == 0 and store.stats().pinned == 0


def test_when_every_entry_is_pinned_the_soonest_to_expire_goes_first():
    clock = Clock()
    store = PrefixCache(2, 1 << 30, clock=clock)
    store.store(prompt(1), kv(8), ttl=3600)
    store.store(prompt(2), kv(8), ttl=300)
    store.store(prompt(3), kv(8), ttl=3600)
    assert [cached(store, prompt(t)) for t in (1, 2, 3)] == [8, 0, 8]


def test_the_kv_budget_takes_unpinned_prefixes_first_and_pinned_ones_last():
    """Running requests come before pins: a release that needs more than the unpinned entries hold takes
    pinned ones too."""
    clock = Clock()
    store = PrefixCache(8, 1 << 30, clock=clock)
    store.store(prompt(1), kv(8), ttl=300)
    store.store(prompt(2), kv(8))
    store.store(prompt(3), kv(8))
    one = store.nbytes // 3
    store.release(2 * one)
    assert [cached(store, prompt(t)) for t in (1, 2, 3)] == [8, 0, 0]
    store.release(one)
    assert store.nbytes == 0 and store.stats().pinned == 0


def test_the_next_turn_inherits_the_pin_of_the_prefix_it_replaces():
    """A trimmable cache keeps only the longest entry of a path: the next turn's entry (stored without a
    breakpoint) replaces the pinned turn before it, and keeps its pin, since it still serves that prefix."""
    clock = Clock()
    store = PrefixCache(2, 1 << 30, clock=clock)
    store.store(prompt(1), kv(8), ttl=300)
    store.store(prompt(1, 12), kv(12))  # the same session, one turn longer
    assert store.stats().entries == 1 and store.stats().pinned == 1
    for topic in range(2, 10):
        store.store(prompt(topic), kv(8))
    assert cached(store, prompt(1, 12)) == 12
    assert store.search(prompt(1) + [5]).length == 8  # the pinned prefix, cut back from the longer entry


def test_an_entry_that_cannot_be_cut_back_keeps_its_own_pin_beside_a_longer_one():
    """Recurrent state (ArraysCache) cannot be cut back: the longer entry does not replace the pinned one."""
    clock = Clock()

    def state(n: int) -> list[ArraysCache]:
        layer = ArraysCache(1)
        layer[0] = mx.full((1, 4), float(n))
        return [layer]

    store = PrefixCache(2, 1 << 30, clock=clock)
    store.store(prompt(1), state(8), ttl=300)
    store.store(prompt(1, 12), state(12))
    store.store(prompt(2), state(8))
    assert store.stats().entries == 2 and store.stats().pinned == 1
    assert cached(store, prompt(1)) == 8 and cached(store, prompt(1, 12)) == 8  # the longer one went


def test_a_prompt_larger_than_the_store_is_not_kept_and_evicts_nothing(caplog):
    """Its KV alone is more than the store's bytes: inserted, it would evict every other entry and then itself.
    It is left out (said once in the log), and the others stay."""
    one = sum(c.nbytes for c in compact(kv(8)))  # as stored: cut to its filled positions
    store = PrefixCache(8, 3 * one)
    store.store(prompt(1), kv(8))
    store.store(prompt(2), kv(8))
    with caplog.at_level("WARNING", logger="vlmserve.engine.prefix_cache"):
        store.store(prompt(3, 40), kv(40))
        store.store(prompt(4, 40), kv(40))
    assert [cached(store, prompt(t)) for t in (1, 2)] == [8, 8] and cached(store, prompt(3, 40)) == 0
    assert store.oversize == 2 and len([r for r in caplog.records if "more than this prefix cache" in r.message]) == 1
