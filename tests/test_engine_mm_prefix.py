"""The opt-in image-keyed prefix cache (issue 33, first families) on the real worker and real MLX.

A conversation about a picture reuses the KV of its earlier turns only with ``mm_prefix_cache`` on,
only where the key (tokens, each image's placeholders written as its content hash) matches, and
the answer is the one a cold prefill gives, token for token. Off (the default), an image prompt
never reuses KV.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import gather, running_engine, scene

from vlmserve.engine.params import SamplingParams
from vlmserve.testing import build_model

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
RED, BLUE = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220))


def micro_model(arch: str, tmp_path: Path) -> Path:
    """A micro model; ``smolvlm_tiles``: SmolVLM's with image splitting on, as the real processor's, so that
    a 96 px picture is a 2x2 grid of 64 px tiles (rows broken by newline tokens) and then its global view."""
    if arch != "smolvlm_tiles":
        return build_model(arch, "micro")
    path = tmp_path / "smolvlm-tiles"
    shutil.copytree(build_model("smolvlm", "micro"), path)
    config = json.loads((path / "processor_config.json").read_text())
    config["image_processor"].update(do_image_splitting=True, size={"longest_edge": 128})
    (path / "processor_config.json").write_text(json.dumps(config))
    return path


def _turns(answer: str, image_first: bool = True) -> list[dict[str, Any]]:
    first = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    return [{"role": "user", "content": first if image_first else first[::-1]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": "And what colour is it?"}]}]


async def _run(engine, rid: str, messages: list[dict[str, Any]], images) -> tuple[list[int], int]:
    """The reply's tokens, and how many prompt tokens came from the cache (negated: none, and the
    prompt's length when nothing was cached, so that the first turn's length is known)."""
    result = await gather(engine.generate_chat(rid, messages, images, None, GREEDY))
    return result.token_ids, result.num_cached_tokens or -result.num_prompt_tokens


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "gemma3", "gemma4", "llava", "glm4v",
                                  "glm4v_moe", "llama4", "kimi_vl", "qwen3_vl_moe", "internvl_chat", "smolvlm",
                                  "smolvlm_tiles"])
def test_a_later_turn_reuses_the_picture_and_answers_as_a_cold_prefill(arch, tmp_path):
    model = micro_model(arch, tmp_path)
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]

    async def scenario(mm: bool):
        async with running_engine(model, mm_prefix_cache=mm) as engine:
            answer, cached_first = await _run(engine, "t1", first, [RED])
            text = engine.tokenizer.decode(answer, skip_special_tokens=True)
            second, cached = await _run(engine, "t2", _turns(text), [RED])
            other, cached_other = await _run(engine, "t3", _turns(text), [BLUE])  # same words, another picture
            prompt = await engine.preprocess(lambda p: p.build(_turns(text), [BLUE], None))
            media = engine.loaded.adapter.media_token_ids()
            before = next(i for i, t in enumerate(prompt.input_ids) if t in media)  # the text before the picture
            stats = await engine.stats()
            return second, cached, other, (cached_other, before), cached_first, stats

    second, cached, other, cached_other, cached_first, stats = asyncio.run(scenario(True))
    cold_second, cold_cached, cold_other, _, _, cold_stats = asyncio.run(scenario(False))
    assert second == cold_second and other == cold_other  # exact: what a whole prefill gives
    # the whole first prompt, the picture included (its last token may merge with the reply's text)
    assert -cached_first - 1 <= cached <= -cached_first
    assert 0 < cached_other[0] <= cached_other[1]  # only the text before the picture: another image never matches
    assert cold_cached < 0 and cold_stats.mm_prefix is None and stats.mm_prefix.hits >= 1


@pytest.mark.parametrize("arch", ["paligemma", "llava_next"])
def test_families_where_reuse_is_not_proven_exact_keep_the_default(arch):
    """PaliGemma's prompt tokens see later ones; LLaVA-NeXT merges more features than it has tokens.
    With the flag they never reuse an image prompt's KV."""
    async def scenario():
        async with running_engine(build_model(arch, "micro"), mm_prefix_cache=True) as engine:
            await _run(engine, "a", _turns("A red circle."), [RED])
            _, cached = await _run(engine, "b", _turns("A red circle."), [RED])
            return cached, (await engine.stats()).mm_prefix

    cached, store = asyncio.run(scenario())
    assert cached < 0 and (store is None or store.hits == 0)


def test_an_image_prompt_longer_than_the_sliding_window_is_not_reused():
    from vlmserve.engine.caches import EngineCaches
    from vlmserve.engine.prefix_cache import PrefixCache
    from vlmserve.inputs import ImageItem, PromptInputs

    def prompt(n: int) -> PromptInputs:
        return PromptInputs([1, 7, 7, 7, *range(10, 10 + n)], {"pixel_values": np.zeros((1, 3))}, 1,
                            (ImageItem("ab" * 16, {}),))

    caches = EngineCaches(None, None, PrefixCache(4, 1 << 20), frozenset({7}), mm_limit=12)
    assert caches.reuses(prompt(8)) and not caches.reuses(prompt(9))  # 12 positions at most


def test_the_flag_through_the_server_and_the_openai_client(tmp_path):
    """``vlmserve serve --mm-prefix-cache``: the second turn's usage says what came from the cache."""
    import openai
    from server_utils import image_data_url, start_server

    server = start_server(["--model", str(build_model("qwen2_5_vl", "micro")), "--mm-prefix-cache"],
                          tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        asked = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(RED)}},
                                              {"type": "text", "text": "What is this?"}]}]
        first = client.chat.completions.create(model=model, messages=asked, max_tokens=4, temperature=0)
        later = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            *asked, {"role": "assistant", "content": "A circle."},
            {"role": "user", "content": "And its colour?"}])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        reused = later.usage.prompt_tokens_details.cached_tokens
        assert reused >= first.usage.prompt_tokens - 1
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        seen = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(vlmserve_mm_prefix_cache_\w+)\{.*\} (\S+)$",
                                                                   metrics, re.M)}
        assert seen["vlmserve_mm_prefix_cache_hits_total"] == 1 and seen["vlmserve_mm_prefix_cache_misses_total"] == 1
        assert seen["vlmserve_mm_prefix_cache_hit_tokens_total"] == reused
        assert seen["vlmserve_mm_prefix_cache_entries"] >= 1 and seen["vlmserve_mm_prefix_cache_bytes"] > 0
        asked_tokens = first.usage.prompt_tokens + later.usage.prompt_tokens
        assert seen["vlmserve_mm_prefix_cache_query_tokens_total"] == asked_tokens
        vllm = {m.group(1): float(m.group(2)) for m in re.finditer(r'^(vllm:prefix_cache_\w+)\{model_name="[^"]+"\} (\S+)$',
                                                                   metrics, re.M)}
        # vLLM's counters: tokens, over both stores (the caches start empty after the warm-up)
        assert vllm["vllm:prefix_cache_queries_total"] == asked_tokens
        assert vllm["vllm:prefix_cache_hits_total"] == reused
    finally:
        server.stop()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3", "pixtral", "lfm2_vl", "internvl_chat"])
def test_two_chats_with_the_same_words_about_pictures_one_pixel_apart_never_share_kv(arch):
    """200 interleaved turns: 10 rounds of two 10-turn chats whose words are the same and whose pictures
    differ by one pixel (another pixel each round; chat a's picture is the same every round). Every
    answer is the cold prefill's; chat b's first turn never reuses past the text before its picture
    (chat a's turns are cached: same tokens, other image), and every later turn reuses its own."""
    model = build_model(arch, "micro")
    rounds, turns = 10, 10

    def other(r: int) -> Any:
        picture = RED.copy()
        picture.putpixel((40 + r, 40), (0, 0, 0))  # one pixel (its processed pixel values differ: checked below)
        return picture

    def prompt(k: int) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        for i in range(1, k):
            messages += [{"role": "assistant", "content": f"Answer number {i}."},
                         {"role": "user", "content": [{"type": "text", "text": f"Question {i}?"}]}]
        return messages

    async def scenario(mm: bool):
        async with running_engine(model, mm_prefix_cache=mm) as engine:
            out = []
            for r in range(rounds):
                for k in range(1, turns + 1):
                    for name, picture in (("a", RED), ("b", other(r))):
                        out.append(await _run(engine, f"{r}{name}{k}", prompt(k), [picture]))
            if mm:  # the keys the cache sees (LFM2-VL's pictures are keyed only with the cache on)
                keys = [(await engine.preprocess(lambda p, x=x: p.build(prompt(1), [x], None))).images[0].key
                        for x in (RED, *(other(r) for r in range(rounds)))]
                assert len(set(keys)) == rounds + 1  # the model would see a different picture each time
            probe = await engine.preprocess(lambda p: p.build(prompt(1), [RED], None))
            media = engine.loaded.adapter.media_token_ids()
            return out, next(i for i, t in enumerate(probe.input_ids) if t in media)

    cached, before = asyncio.run(scenario(True))
    cold, _ = asyncio.run(scenario(False))
    assert len(cached) == 200 and [tokens for tokens, _ in cached] == [tokens for tokens, _ in cold]
    for r in range(rounds):
        reused = [n for _, n in cached[2 * turns * r: 2 * turns * (r + 1)]]
        # b's first turn: a's picture is not b's (LFM2-VL's recurrent state cannot be cut back to the text
        # before it: nothing is reused)
        assert reused[1] <= before and (reused[1] > 0 or arch == "lfm2_vl"), (r, reused)
        assert all(n > before for n in reused[2:]), (r, reused)  # later turns: each chat's own, picture included


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "llava",
                                  "pixtral", "mistral3", "lfm2_vl", "glm4v", "glm4v_moe", "llama4",
                                  "kimi_vl", "qwen3_vl_moe", "qwen3_5_moe", "internvl_chat", "smolvlm",
                                  "smolvlm_tiles"])
def test_four_turns_with_a_second_picture_in_turn_three_batched_with_other_traffic(arch, tmp_path):
    """Issue 33's exactness check: each turn runs beside a text request and another image request;
    every turn's greedy tokens equal the cache-off engine's, and turns 2-4 report cached tokens."""
    model = micro_model(arch, tmp_path)

    def prompt(k: int) -> tuple[list[dict[str, Any]], list]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        images = [RED]
        for i in range(1, k):
            messages.append({"role": "assistant", "content": f"Answer number {i}."})
            if i == 2:  # turn 3 brings a second picture
                messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]})
                images.append(BLUE)
            else:
                messages.append({"role": "user", "content": [{"type": "text", "text": f"Question {i}?"}]})
        return messages, images

    async def scenario(mm: bool):
        async with running_engine(model, mm_prefix_cache=mm, max_batch_size=4) as engine:
            out = []
            for k in range(1, 5):
                messages, images = prompt(k)
                turn, *_ = await asyncio.gather(
                    _run(engine, f"t{k}", messages, images),
                    _run(engine, f"text{k}", [{"role": "user", "content": f"Tell me about shape {k}."}], []),
                    _run(engine, f"img{k}", [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                      "text": f"Shape {k}?"}]}],
                         [scene("triangle", (30, 170, 60 + k))]))
                out.append(turn)
            first = await engine.preprocess(lambda p: p.build(*prompt(1), None))
            media = engine.loaded.adapter.media_token_ids()
            return out, next(i for i, t in enumerate(first.input_ids) if t in media)

    (cached, before), (cold, _) = asyncio.run(scenario(True)), asyncio.run(scenario(False))
    assert [t for t, _ in cached] == [t for t, _ in cold]
    # turn 1: at most the text before its picture (a text request's chat header may be cached by then)
    assert cached[0][1] <= before and all(n > 0 for _, n in cached[1:]), [n for _, n in cached]


def test_the_stores_count_against_the_kv_budget_and_give_way_to_requests():
    """Six image chats fill the image-keyed store; then a budget that holds four long requests and none
    of it. The requests are admitted (the store drops its prefixes, least recently used first), a later
    turn that reused a prefix just before it was dropped still answers as cold (it holds a copy), and at
    every step the stores and the running requests' reservations hold no more than the budget together."""
    model = build_model("qwen2_5_vl", "micro")
    pictures = [scene(kind, (40 * i, 200 - 30 * i, 90)) for i, kind in enumerate(
        ("circle", "square", "triangle", "circle", "square", "triangle"))]
    long = SamplingParams(max_tokens=160, ignore_eos=True)

    async def scenario(mm: bool) -> tuple[list[list[int]], list[int], Any]:
        async with running_engine(model, mm_prefix_cache=mm, max_batch_size=8) as engine:
            first = [await _run(engine, f"chat{i}", _turns("")[:1], [p]) for i, p in enumerate(pictures)]
            limit = 4 * engine.kv.footprint.row_bytes(300)  # four long requests (and the turn) fit; no stored prefix

            def set_budget() -> None:
                engine.kv.limit_bytes = limit

            await engine.worker.run(set_budget)
            overs: list[int] = []

            def watch(m: Any) -> None:
                stored = sum(s.bytes for s in (m.prefix, m.mm_prefix) if s is not None)
                overs.append(m.kv_reserved_bytes + stored - limit)

            engine.on_step = watch

            async def text(i: int) -> list[int]:
                chat = [{"role": "user", "content": f"Count to {i}."}]
                return (await gather(engine.generate_chat(f"long{i}", chat, [], None, long))).token_ids

            started = asyncio.Event()

            async def turn2() -> tuple[list[int], int]:
                """A later turn of chat 0: it reuses the stored prefix, then the long requests come in."""
                tokens, cached = [], 0
                async for out in engine.generate_chat("turn2", _turns("An answer."), [pictures[0]], None, GREEDY):
                    tokens += out.token_ids
                    cached = out.num_cached_tokens
                    started.set()
                return tokens, cached

            async def after_turn2(i: int) -> list[int]:
                await started.wait()
                return await text(i)

            results = await asyncio.gather(turn2(), *(after_turn2(i) for i in range(4)))
            return [first_turn for first_turn, _ in first] + [results[0][0], *results[1:]], overs, \
                ((await engine.stats()).mm_prefix, results[0][1])

    cached, overs, (stats, reused) = asyncio.run(scenario(True))
    cold, _, _ = asyncio.run(scenario(False))
    assert cached == cold
    assert reused > 0  # looked up as it was admitted, before the long requests made room
    assert overs and max(overs) <= 0, max(overs)
    assert stats.budget_evictions >= 6


@pytest.mark.parametrize("arch, template_kwargs", [("qwen3_5", {}), ("qwen3_5", {"enable_thinking": False}),
                                                   ("lfm2_vl", {}), ("qwen3_5_moe", {})])
def test_recurrent_state_is_snapshotted_where_the_next_turn_repeats_the_prompt(arch, template_kwargs):
    """Qwen3.5 and LFM2-VL keep recurrent (and convolution) state, which a cached prefix cannot be cut
    back to: each prompt's cache is snapshotted at its stem, before the generation prompt, which the
    next turn's prompt repeats (the reply is re-rendered after it: Qwen3.5's without its think block,
    while the live reply followed ``<think>``). On the published templates, each later turn of an
    8-turn chat (text: the default text prefix cache) reuses exactly the previous prompt's stem and
    answers as a cold prefill, token for token."""
    model = build_model(arch, "micro")
    thinks = arch.startswith("qwen3_5") and template_kwargs.get("enable_thinking", True)

    def turn(k: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello, can you count shapes?"}]
        for i in range(1, k):
            reply = f"<think>\nThe user asked {i} things.\n</think>\n\nYes, {i}." if thinks else f"Yes, {i}."
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And {i} more?"}]
        return messages

    async def scenario(cache: bool) -> tuple[list[list[int]], list[int], list[int | None]]:
        async with running_engine(model, prefix_cache=cache, prefill_chunk=16) as engine:
            tokens, cached, stems = [], [], []
            for k in range(1, 9):
                built = await engine.preprocess(lambda p, k=k: p.build(turn(k), template_kwargs=template_kwargs))
                result = await gather(engine.generate(f"t{k}", built, GREEDY))
                tokens.append(result.token_ids)
                cached.append(result.num_cached_tokens)
                stems.append(built.stem)
            return tokens, cached, stems

    warm, cached, stems = asyncio.run(scenario(True))
    cold, none, _ = asyncio.run(scenario(False))
    assert warm == cold and not any(none)
    assert all(stem is not None for stem in stems)
    assert cached == [0, *stems[:-1]]  # each turn: the previous prompt's stem, what the next turn repeats of it


@pytest.mark.parametrize("arch", ["pixtral", "mistral3"])
def test_an_image_padded_beside_a_larger_one_hashes_as_alone(arch):
    """Pixtral's processor pads a prompt's images to its largest: the item is cut to the image's own
    size, so its hash (the prefix key's, the vision cache's) does not depend on its companions."""
    async def keys():
        async with running_engine(build_model(arch, "micro")) as engine:
            small = scene("circle", (220, 30, 30)).resize((96, 24))  # wide: fewer rows than the square
            large = scene("square", (30, 60, 220), size=96)
            alone = await engine.preprocess(lambda p: p.build(_turns("")[:1], [small], None))
            parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Both?"}]
            both = await engine.preprocess(lambda p: p.build([{"role": "user", "content": parts}], [small, large], None))
            return alone, both

    alone, both = asyncio.run(keys())
    assert both.arrays["pixel_values"].shape[2:] != alone.arrays["pixel_values"].shape[2:]  # padded
    assert both.images[0].key == alone.images[0].key != both.images[1].key


@pytest.mark.parametrize("arch", ["gemma4", "gemma3"])
def test_on_gemma_the_text_after_a_reused_prefix_goes_by_tokens(arch):
    """Gemma's image prompts go by layers (their vision spans attend both ways). Once a reused prefix
    covers every image, what is left is causal text: it goes in token chunks of ``prefill_chunk`` (16
    here) instead of one step, and each turn still answers as the cold engine does."""
    model = build_model(arch, "micro")
    question = "Tell me more about its colour and its edges, and whether it is round or square, please. " * 2

    def turn(k: int) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        for i in range(1, k):
            messages += [{"role": "assistant", "content": f"Answer {i}."}, {"role": "user", "content": question}]
        return messages

    async def scenario(mm: bool) -> tuple[list[list[int]], list[int], list[int]]:
        async with running_engine(model, mm_prefix_cache=mm, prefill_chunk=16) as engine:
            steps: list[int] = []  # prompt tokens each step finished (a prompt by layers: all at its last piece)
            seen = [0]

            def watch(m: Any) -> None:
                steps.append(m.prompt_tokens - seen[0])
                seen[0] = m.prompt_tokens

            engine.on_step = watch
            out, cached = [], []
            for k in range(1, 4):
                if k == 2:
                    steps.clear()
                tokens, n = await _run(engine, f"t{k}", turn(k), [RED])
                out.append(tokens)
                cached.append(n)
            return out, cached, steps

    warm, cached, steps = asyncio.run(scenario(True))
    cold, _, cold_steps = asyncio.run(scenario(False))
    assert warm == cold and all(n > 0 for n in cached[1:])
    assert max(steps) <= 16 < max(cold_steps), (steps, cold_steps)  # turns 2-3: 16-token chunks, not whole


def test_a_stored_prefix_holds_its_kv_and_no_more():
    """mlx's KV caches grow in 256-position steps; the store keeps each layer cut to its filled
    positions, so a stored turn costs exactly its KV (the footprint measured at start-up)."""
    async def scenario():
        async with running_engine(build_model("qwen2_5_vl", "micro"), mm_prefix_cache=True) as engine:
            sizes = []
            messages = _turns("A red circle.")[:1]
            for k in range(3):
                _, n = await _run(engine, f"t{k}", messages, [RED])
                stats = (await engine.stats()).mm_prefix
                length = -n if n < 0 else len(await engine.preprocess(lambda p, m=messages: p.build(m, [RED], None)))
                sizes.append((stats.entries, stats.bytes, engine.kv.footprint.row_bytes(length)))
                messages = [*messages, {"role": "assistant", "content": "A red circle."},
                            {"role": "user", "content": f"And {k}?"}]
            return sizes

    sizes = asyncio.run(scenario())
    assert all(entries == 1 and stored == kv for entries, stored, kv in sizes), sizes  # a longer turn replaces its prefix


def _key_before(prompt, media_ids):
    """``prefix_key``'s walk before SmolVLM's tiles (one run, one image), kept to show every other family's
    keys are unchanged."""
    key, images, previous_media, pseudo = [], iter(prompt.images), False, 0
    for token in prompt.input_ids:
        media = token in media_ids
        if media and not previous_media:
            item = next(images, None)
            if item is None:
                return None
            pseudo = -1 - int(item.key[:15], 16)
        key.append(pseudo if media else token)
        previous_media = media
    return key if next(images, None) is None else None


def test_only_smolvlm_pairs_several_runs_with_one_image_and_every_other_key_is_unchanged():
    from vlmserve.engine.models import _ADAPTERS
    from vlmserve.engine.models.base import ModelAdapter
    from vlmserve.engine.params import prefix_key
    from vlmserve.inputs import ImageItem, PromptInputs

    marking = [a for a in _ADAPTERS if a.last_run_marks is not ModelAdapter.last_run_marks]
    assert [a.model_types for a in marking] == [("smolvlm",)]  # every other family passes no marks
    rng = np.random.default_rng(0)
    for _ in range(300):  # multi-image prompts of every layout: runs of 7, span tokens 8 and 9, text 1-6
        ids = [int(t) for t in rng.choice([1, 2, 3, 4, 5, 6, 7, 7, 7, 8, 9], size=int(rng.integers(1, 40)))]
        runs = sum(1 for i, t in enumerate(ids) if t in (7, 8, 9) and (i == 0 or ids[i - 1] not in (7, 8, 9)))
        for images in {runs, max(runs - 1, 0), runs + 1}:
            items = tuple(ImageItem(f"{k:032x}", {}) for k in range(1, images + 1))
            prompt = PromptInputs(ids, {"pixel_values": np.zeros((1, 3))}, images, items)
            assert prefix_key(prompt, frozenset({7, 8, 9})) == _key_before(prompt, frozenset({7, 8, 9}))


def test_a_tiled_smolvlm_image_keys_all_its_runs_with_its_own_hash(tmp_path):
    async def keys():
        async with running_engine(micro_model("smolvlm_tiles", tmp_path), mm_prefix_cache=True) as engine:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And"},
                                                     {"type": "image"}]}]
            adapter = engine.loaded.adapter
            media, marks = adapter.media_token_ids(), adapter.last_run_marks(engine.loaded.processor)
            out = []
            for pictures in ([RED, BLUE], [RED, BLUE], [RED, RED], [BLUE, BLUE]):
                prompt = await engine.preprocess(lambda p, i=pictures: p.build(messages, i, None))
                out.append((prompt.input_ids, prefix_key(prompt, media, marks)))
            return out, media

    from vlmserve.engine.params import prefix_key

    out, media = asyncio.run(keys())
    ids, key = out[0]
    runs = [i for i, t in enumerate(ids) if t in media and ids[i - 1] not in media]
    assert len(runs) == 10 and len(key) == len(ids)  # 2x2 tiles and the global view, twice
    first, second = {key[i] for i in runs[:5]}, {key[i] for i in runs[5:]}
    assert len(first) == len(second) == 1 and first != second and min(first | second) < 0
    assert out[1][1] == key  # the same pictures: the same key
    same_first = next(i for i, (a, b) in enumerate(zip(key, out[2][1])) if a != b)
    assert same_first == runs[5]  # another second picture: the keys part at its first tile
    assert next(i for i, (a, b) in enumerate(zip(key, out[3][1])) if a != b) == runs[0]
