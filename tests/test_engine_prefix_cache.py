"""The prefix cache on the real engine: text prompts reuse KV, image prompts at most the text before their
first image."""

from __future__ import annotations

import asyncio

from conftest import collect, running_engine, scene

from vlmserve.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SYSTEM = "You are a careful assistant. " * 12


def _conversations():
    return [(f"{SYSTEM} Question {q}", []) for q in ("one", "two", "three")]


async def _run_all(path, cases, **config):
    async with running_engine(path, **config) as engine:
        before = await engine.stats()
        results = [await collect(engine, f"r{i}", t, imgs, GREEDY) for i, (t, imgs) in enumerate(cases)]
        after = await engine.stats()
        return results, before.prefix, after.prefix


def test_text_prompts_reuse_the_longest_cached_prefix(gemma4_micro):
    cached, before, after = asyncio.run(_run_all(gemma4_micro, _conversations(), prefix_cache=True))
    fresh, _, nothing = asyncio.run(_run_all(gemma4_micro, _conversations(), prefix_cache=False))
    assert nothing is None
    assert cached[0].num_cached_tokens == 0  # the warm-up had an image: nothing was stored
    assert all(r.num_cached_tokens > 40 for r in cached[1:])  # the long system prompt was reused
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)
    assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]


def test_identical_prompt_reuses_all_but_the_last_token(gemma4_micro):
    results, _, _ = asyncio.run(_run_all(gemma4_micro, [("same words", [])] * 2, prefix_cache=True))
    assert results[1].num_cached_tokens == results[1].num_prompt_tokens - 1
    assert results[0].token_ids == results[1].token_ids


def test_image_prompts_never_share_kv_past_the_text_before_their_image(gemma4_micro):
    """Same text, different images of the same size: never shared KV, outputs as with the cache off. Each
    looks up the text before its image (here a chat header no text prompt left in the store) and is not kept."""
    red, green = scene("circle", (220, 30, 30)), scene("triangle", (30, 170, 60))
    cases = [("what is in the image?", [red]), ("what is in the image?", [green]), ("what is in the image?", [red])]
    cached, before, after = asyncio.run(_run_all(gemma4_micro, cases, prefix_cache=True))
    fresh, _, _ = asyncio.run(_run_all(gemma4_micro, cases, prefix_cache=False))
    assert (after.hits, after.misses - 3, after.entries) == (before.hits, before.misses, before.entries)  # no store
    assert all(r.num_cached_tokens == 0 for r in cached)
    assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
    assert cached[0].token_ids != cached[1].token_ids  # the image really conditions the answer


def test_cache_is_bounded_in_entries(gemma4_micro):
    cases = [(f"topic {i}: " + "word " * (5 + i), []) for i in range(6)]
    _, _, after = asyncio.run(_run_all(gemma4_micro, cases, prefix_cache=True, prefix_cache_entries=2))
    assert after.entries <= 2 and after.bytes > 0


def test_a_reused_prefix_goes_from_the_caches_to_the_runner_and_is_never_left_behind(gemma4_micro):
    """The plan carries ids and counts; the caches hold a reused prefix's copy until the runner enters its
    request, then hold nothing for it, whether it ran or was aborted as it arrived."""

    async def scenario():
        async with running_engine(gemma4_micro, prefix_cache=True) as engine:
            first = await collect(engine, "r0", SYSTEM, [], GREEDY)
            second = await collect(engine, "r1", SYSTEM, [], GREEDY)
            stream = engine.generate_chat("r2", [{"role": "user", "content": SYSTEM}], [], None, GREEDY)
            await stream.__anext__()
            await stream.aclose()  # aborted after it entered, with its prefix
            for _ in range(3):
                await collect(engine, "after", "hi", [], SamplingParams(max_tokens=2))
            caches = engine.core.caches
            return first, second, [caches.take_prefix(r) for r in ("r0", "r1", "r2")]

    first, second, left = asyncio.run(scenario())
    assert second.num_cached_tokens > 40 and second.token_ids == first.token_ids
    assert left == [None, None, None]


def test_a_reserved_prefix_is_whole_even_when_the_store_evicts_it_before_the_runner_takes_it():
    """Admission finds a prefix without copying it; a later admission's room-making may evict the entry
    before the runner enters the request. The request still gets the prefix's KV, cut to what it reuses,
    and the store's own entry (another request's to find) is never changed by a take."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from vlmserve.engine.caches import EngineCaches
    from vlmserve.engine.prefix_cache import PrefixCache
    from vlmserve.inputs import PromptInputs

    layer = KVCache()
    keys = mx.arange(1 * 2 * 10 * 4, dtype=mx.float32).reshape(1, 2, 10, 4)
    layer.update_and_fetch(keys, -keys)
    caches = EngineCaches(PrefixCache(4, 1 << 30), None)
    caches.prefix.store(list(range(10)), [layer])  # a finished prompt of 10 tokens
    assert caches.reserve_prefix("a", PromptInputs(list(range(10)))) == 9  # the same prompt: its last is computed
    assert caches.reserve_prefix("b", PromptInputs([*range(6), 99, 98])) == 6  # shares 6, a longer entry cut back
    caches.release(caches.held_bytes())  # the store makes room: the entry is gone
    assert caches.held_bytes() == 0 and caches.prefix.stats().entries == 0
    (a,), (b,) = caches.take_prefix("a"), caches.take_prefix("b")
    assert (a.offset, b.offset) == (9, 6)
    assert mx.array_equal(a.keys[..., :9, :], keys[..., :9, :])
    assert mx.array_equal(b.values[..., :6, :], -keys[..., :6, :])
    assert caches.take_prefix("a") is None  # taken once


def test_an_image_prompt_looks_up_the_text_before_its_first_image_in_the_text_store():
    """The text store serves a prompt with images up to its first media token (7 here) and never past it,
    where the family allows it (``text_for_images``) and the prompt is within the sliding window; the
    image-keyed store's longer prefix wins; one lookup is counted once, by the store it reuses."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from vlmserve.engine.caches import EngineCaches
    from vlmserve.engine.params import prefix_key
    from vlmserve.engine.prefix_cache import PrefixCache
    from vlmserve.inputs import ImageItem, PromptInputs

    def kv(n: int) -> list[KVCache]:
        layer = KVCache()
        layer.update_and_fetch(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)))
        return [layer]

    def image_prompt(tokens: list[int]) -> PromptInputs:
        return PromptInputs(tokens, {"pixel_values": np.zeros((1, 3))}, 1, (ImageItem("ab" * 16, {}),))

    text, images = PrefixCache(4, 1 << 20), PrefixCache(4, 1 << 20)
    caches = EngineCaches(text, None, images, frozenset({7}), mm_limit=20, text_for_images=True)
    text.store([1, 2, 3, 4, 5, 6], kv(6))  # the previous turn: text, and more text than comes before the image
    text.store([1, 2, 3, 4, 9], kv(5))
    prompt = image_prompt([1, 2, 3, 4, 5, 6, 7, 7, 8])
    assert caches.reserve_prefix("a", prompt) == 6  # the previous prompt whole
    assert caches.reserve_prefix("b", image_prompt([1, 2, 3, 4, 7, 7, 5, 6])) == 4  # never past the first image
    assert (text.stats().hits, text.stats().query_tokens, images.stats().misses) == (2, 17, 0)
    images.store(prefix_key(prompt, caches.media_ids)[:8], kv(8))  # a's first 8, its picture included
    assert caches.reserve_prefix("c", prompt) == 8 and images.stats().hits == 1 and text.stats().hits == 2
    assert caches.reserve_prefix("d", image_prompt([9, 7, 1])) == 0 and images.stats().misses == 1  # own store
    assert caches.reserve_prefix("e", image_prompt([1, 2, 3, 4, 5, 6, 7, *range(20, 40)])) == 0  # past the window
    caches.mm_prefix, caches.text_for_images = None, False  # a family whose image prefixes are not proven exact
    assert caches.reserve_prefix("f", image_prompt([1, 2, 3, 4, 5, 6, 7])) == 0
    assert [caches.take_prefix(r) is not None for r in "abcdef"] == [True] * 3 + [False] * 3
