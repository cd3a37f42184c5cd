"""The vision cache on the real worker and MLX: an image is encoded once, however many turns or
requests show it, and every answer equals the answer without the cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import running_engine, scene
from PIL import Image

from vlmserve.engine.params import SamplingParams
from vlmserve.testing import build_model

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
ARCHS = ["gemma4", "qwen2_5_vl", "llava", "glm4v", "glm4v_moe", "qwen3_5_moe", "kimi_vl"]


def _turns(image: Image.Image, n: int) -> list[list[dict[str, Any]]]:
    """A conversation about one picture, as a client resends it on every turn."""
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    history, turns = [first], []
    for k in range(n):
        turns.append(list(history))
        history += [{"role": "assistant", "content": f"Answer {k}."}, {"role": "user", "content": f"And then {k}?"}]
    return turns


async def _tokens(engine, request_id: str, messages: list[dict[str, Any]], images: list[Image.Image]) -> list[int]:
    out: list[int] = []
    async for step in engine.generate_chat(request_id, messages, images, None, GREEDY):
        assert step.error is None, step.error
        out += step.token_ids
    return out


async def _vision(engine):
    return (await engine.stats()).vision


@pytest.mark.parametrize("arch", ARCHS)
def test_four_turns_about_one_image_encode_it_once_and_answer_as_without_the_cache(arch):
    path, image = build_model(arch, "micro"), scene("circle", (220, 30, 30))

    async def run(cache_bytes: int) -> tuple[list[list[int]], Any]:
        async with running_engine(path, vision_cache_bytes=cache_bytes) as engine:
            outs = [await _tokens(engine, f"t{i}", turn, [image]) for i, turn in enumerate(_turns(image, 4))]
            return outs, await _vision(engine)

    cached, stats = asyncio.run(run(64 << 20))
    plain, off = asyncio.run(run(0))
    assert cached == plain
    assert off is None
    assert (stats.misses, stats.hits, stats.entries, stats.evictions) == (1, 3, 1, 0)
    assert stats.bytes > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_images_one_pixel_apart_never_share_features(arch):
    path = build_model(arch, "micro")
    a = scene("square", (30, 60, 220))
    b = a.copy()
    b.putpixel((5, 5), (31, 60, 220))
    b.putpixel((48, 48), (31, 60, 220))  # where a cropping processor looks too (Kimi-VL's crops 96 px to 84)
    msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]

    async def run():
        async with running_engine(path) as engine:
            prompts = [engine.prompter.build(msg, [img]) for img in (a, b, a)]
            await _tokens(engine, "a", msg, [a])
            await _tokens(engine, "b", msg, [b])
            return [p.images[0].key for p in prompts], await _vision(engine)

    (key_a, key_b, key_a2), stats = asyncio.run(run())
    assert key_a != key_b and key_a == key_a2
    assert (stats.misses, stats.hits, stats.entries) == (2, 0, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_same_image_in_concurrent_requests_is_encoded_once(arch):
    path, image = build_model(arch, "micro"), scene("triangle", (30, 170, 60))
    first, second = _turns(image, 2)

    async def run():
        async with running_engine(path, max_batch_size=4) as engine:
            alone = [await _tokens(engine, "s1", first, [image]), await _tokens(engine, "s2", second, [image])]
        async with running_engine(path, max_batch_size=4) as engine:
            together = await asyncio.gather(_tokens(engine, "c1", first, [image]), _tokens(engine, "c2", second, [image]))
            return alone, list(together), await _vision(engine)

    alone, together, stats = asyncio.run(run())
    assert together == alone
    assert (stats.misses, stats.hits) == (1, 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_second_image_alone_is_encoded_when_the_first_is_cached(arch):
    path = build_model(arch, "micro")
    red, blue = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220), size=80)
    both = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}]
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]

    async def run(cache_bytes: int):
        async with running_engine(path, vision_cache_bytes=cache_bytes) as engine:
            await _tokens(engine, "one", one, [red])
            out = await _tokens(engine, "both", both, [red, blue])
            return out, await _vision(engine)

    cached, stats = asyncio.run(run(64 << 20))
    plain, _ = asyncio.run(run(0))
    assert cached == plain
    assert (stats.misses, stats.hits, stats.entries) == (2, 1, 2)  # red once, blue once, red from the cache


@pytest.mark.parametrize("arch", ARCHS)
def test_eviction_under_a_tiny_budget_stays_correct_and_counts_add_up(arch):
    path = build_model(arch, "micro")
    red, blue = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220))
    msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]

    async def run(cache_bytes: int | None):
        async with running_engine(path, vision_cache_bytes=cache_bytes or 64 << 20) as engine:
            outs = []
            for i, image in enumerate([red, blue, red, red]):
                outs.append(await _tokens(engine, f"e{i}", msg, [image]))
            return outs, await _vision(engine)

    _, roomy = asyncio.run(run(None))
    one_image = roomy.bytes // 2  # both images have the same size: room for exactly one
    outs, tiny = asyncio.run(run(one_image))
    plain, _ = asyncio.run(run(None))
    assert outs == plain
    assert (tiny.misses, tiny.hits, tiny.evictions, tiny.entries) == (3, 1, 2, 1)
    assert tiny.hits + tiny.misses == 4 and tiny.bytes <= one_image


def test_gemma4_images_of_different_sizes_both_reach_the_model():
    """Gemma 4's processor returns one pixel array per image when their sizes differ; both count."""
    path = build_model("gemma4", "micro")
    wide, small = scene("circle", (220, 30, 30)).resize((128, 64)), scene("square", (30, 60, 220), size=64)
    other = scene("triangle", (30, 170, 60), size=64)
    msg = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]}]

    async def run(cache_bytes: int):
        async with running_engine(path, vision_cache_bytes=cache_bytes) as engine:
            prompt = engine.prompter.build(msg, [wide, small])
            assert isinstance(prompt.arrays["pixel_values"], tuple) and len(prompt.images) == 2
            return await _tokens(engine, "a", msg, [wide, small]), await _tokens(engine, "b", msg, [wide, other])

    with_small, with_other = asyncio.run(run(64 << 20))
    assert with_small != with_other  # the second image matters
    assert asyncio.run(run(0)) == (with_small, with_other)


def test_the_vision_cache_is_counted_in_metrics(server, model_name):
    import re

    import httpx
    from server_utils import image_data_url

    def counters() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {name: float(re.search(rf"^vlmserve_vision_cache_{name}(?:_total)?{{[^}}]*}} (\S+)$", text, re.M).group(1))
                for name in ("hits", "misses", "bytes", "entries")}

    url = image_data_url(scene("star", (200, 200, 30), size=72))
    body = {"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]}
    before = counters()
    for _ in range(2):
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    after = counters()
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (1, 1)
    assert after["entries"] == before["entries"] + 1 and after["bytes"] > before["bytes"]
    assert "vlmserve_vision_seconds_total" in httpx.get(server.url + "/metrics").text
