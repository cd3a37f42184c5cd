"""Quantized KV (``--kv-bits``, issue 45) on the real worker, runner and MLX, with micro models.

The oracle is mlx-vlm's own ``generate_step(kv_bits=...)`` (sliding-window layers left in full
precision, as ours are: its own packing raises on them): our engine, alone and batched, gives its
greedy tokens. Every family where quantization is on serves text, images and a four-turn image chat
under the image-keyed prefix cache at 8 and 4 bits; the KV budget counts packed bytes, so a fixed
budget runs more long requests at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import gather, running_engine, scene

from vlmserve.engine.params import SamplingParams
from vlmserve.testing import ARCHS, FAMILY_BUILDS, build_family, build_model
from vlmserve.testing.reference import reference_greedy

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
RED, BLUE = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220))
GROUP = 32  # the micro models' head size is 32 (real models': 64 and up, where the default 64 divides)


def _chat(k: int, second: bool = True) -> tuple[list[dict[str, Any]], list[Any]]:
    """Turn ``k`` of a conversation about a picture; turn 3 brings a second one (where a family takes two)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": "What is this?"}]}]
    images = [RED]
    for i in range(1, k):
        messages.append({"role": "assistant", "content": f"Answer number {i}."})
        if i == 2 and second:
            messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]})
            images.append(BLUE)
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": f"Question {i}?"}]})
    return messages, images


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_serves_text_images_and_an_image_chat_at_8_and_4_bits(arch: str) -> None:
    model = build_model(arch, "micro")

    async def scenario(bits: int) -> tuple[Any, list[int], bool]:
        async with running_engine(model, kv_bits=bits, kv_group_size=GROUP, mm_prefix_cache=True,
                                  max_batch_size=4) as engine:
            text = await gather(engine.generate_chat("text", [{"role": "user", "content": "Name three shapes."}], [],
                                                     None, GREEDY))
            image = await gather(engine.generate_chat("image", *_chat(1), None, GREEDY))
            cached, second = [], (engine.loaded.adapter.max_images or 2) > 1
            for k in range(1, 5):
                turn = await gather(engine.generate_chat(f"t{k}", *_chat(k, second), None, GREEDY))
                assert turn.error is None and len(turn.token_ids) == GREEDY.max_tokens, turn.error
                cached.append(turn.num_cached_tokens or 0)
            assert text.error is None and image.error is None and len(text.token_ids) == len(image.token_ids) == 10
            return engine.loaded.adapter.kv_quant, cached, engine.loaded.adapter.mm_prefix_exact

    for bits in (8, 4):
        quant, cached, reuses = asyncio.run(scenario(bits))
        if arch == "paligemma":  # its attention multiplies float keys itself: off, said at start-up
            assert quant is None
            continue
        assert quant is not None and quant.bits == bits
        if reuses:  # the image-keyed cache is on here: later turns reuse packed KV
            assert all(n > 0 for n in cached[1:]), cached


@pytest.mark.parametrize("arch", [a for a in FAMILY_BUILDS if a != "paligemma"])
def test_greedy_tokens_equal_mlx_vlm_quantized_generate_alone_and_batched(arch: str) -> None:
    model = build_family(arch)

    async def scenario() -> None:
        # No prefix cache: a reused prefix is packed, and the rest of a prompt then reads packed KV; prompts
        # in one forward, as mlx-vlm's prefill_step_size (2048) has them: packing starts after it
        async with running_engine(model, kv_bits=4, kv_group_size=GROUP, max_batch_size=4,
                                  prefill_chunk=4096, prefix_cache=False) as engine:
            if engine.loaded.adapter.packs_kv is not None:  # off, said at start-up (Gemma 4 E2B's shared KV)
                assert engine.loaded.adapter.kv_quant is None
                pytest.skip(engine.loaded.adapter.packs_kv)
            prompts = [engine.prompter.build([{"role": "user", "content": f"Tell me about shape number {i}."}], [])
                       for i in range(3)]
            image = engine.prompter.build(*_chat(1))
            quant = {"kv_bits": 4, "kv_group_size": GROUP, "quantized_kv_start": 0}
            refs = [engine.worker.call(reference_greedy, engine.loaded.model, p, 10, **quant) for p in prompts]
            fp = engine.worker.call(reference_greedy, engine.loaded.model, prompts[0], 10)
            alone = [(await gather(engine.generate(f"a{i}", p, GREEDY))).token_ids for i, p in enumerate(prompts)]
            together = await asyncio.gather(*(gather(engine.generate(f"b{i}", p, GREEDY))
                                              for i, p in enumerate([*prompts, image])))
            assert alone == refs
            assert [r.token_ids for r in together[:3]] == refs
            ref_image = engine.worker.call(reference_greedy, engine.loaded.model, image, 10, **quant)
            # An image prompt prefilled whole (Gemma's spans attend both ways) computes its last token against
            # exact KV; mlx-vlm splits that token off and computes it against packed KV
            assert together[3].token_ids == ref_image or not engine.loaded.adapter.can_chunk(image)
            assert refs[0] != fp or arch != "qwen2_5_vl"  # 4 bits changes this one's answer: the KV is packed

    asyncio.run(scenario())


def test_a_fixed_budget_runs_more_long_requests_at_once_when_packed() -> None:
    model = build_model("qwen2_5_vl", "micro")
    long = "Tell me everything about the colours and shapes you know, one by one, slowly. " * 12
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    async def peak(bits: int | None, budget: int) -> tuple[int, int]:
        async with running_engine(model, kv_bits=bits, kv_group_size=GROUP, kv_cache_bytes=budget,
                                  max_batch_size=16, prefix_cache=False) as engine:
            runs = [asyncio.create_task(gather(engine.generate_chat(f"r{i}", [{"role": "user", "content": f"{i} {long}"}],
                                                                    [], None, params))) for i in range(16)]
            most = 0
            while not all(r.done() for r in runs):
                await asyncio.sleep(0.01)
                most = max(most, engine.metrics.batch_size if engine.metrics else 0)
            assert all(r.result().error is None for r in runs)
            return most, engine.kv.footprint.per_position

    full, per_full = asyncio.run(peak(None, 1 << 20))
    budget = 2 * per_full * 800  # two long requests (~600 prompt + 64 positions each) in full precision
    full, _ = asyncio.run(peak(None, budget))
    eight, per_eight = asyncio.run(peak(8, budget))
    four, per_four = asyncio.run(peak(4, budget))
    assert full == 2, full
    assert per_full / per_eight >= 1.8 and per_full / per_four >= 3
    assert eight >= 1.8 * full and four >= 3 * full, (full, eight, four)


def test_from_a_start_a_prompt_stays_exact_until_its_cache_holds_that_many_positions() -> None:
    """``quantized_kv_start``: a short prompt decodes in full precision until its cache reaches the start,
    a long one is packed after its prefill; both as mlx-vlm's ``generate_step`` with that start."""
    model = build_model("qwen2_5_vl", "micro")
    start = 48

    async def scenario() -> None:
        async with running_engine(model, kv_bits=4, kv_group_size=GROUP, quantized_kv_start=start, prefix_cache=False,
                                  prefill_chunk=4096) as engine:
            footprint = engine.kv.footprint
            assert footprint.packed is not None and footprint.packed[1] == start
            assert footprint.row_bytes(start * 4) < footprint.per_position * start * 4  # packed past the start
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            quant = {"kv_bits": 4, "kv_group_size": GROUP, "quantized_kv_start": start}
            for words in ("Hi.", "Tell me everything about the colours and shapes you know, one by one. " * 3):
                prompt = engine.prompter.build([{"role": "user", "content": words}], [])
                ours = (await gather(engine.generate(words[:8], prompt, params))).token_ids
                ref = engine.worker.call(reference_greedy, engine.loaded.model, prompt, 40, **quant)
                full = engine.worker.call(reference_greedy, engine.loaded.model, prompt, 40)
                assert ours == ref, (len(prompt), words[:8])
                assert len(prompt) < start < len(prompt) + 40 or len(prompt) > start
                assert ref != full  # packing happened, mid-decode for the short one

    asyncio.run(scenario())


@pytest.mark.parametrize("arch, method", [("qwen2_5_vl", "ngram"), ("qwen3_5", "mtp"), ("qwen3_vl_moe", "ngram")])
def test_drafts_verified_on_packed_kv_never_change_the_answer(arch: str, method: str, tmp_path: Any) -> None:
    """ngram drafts and Qwen3.5's MTP drafter verify against packed KV, which each row keeps up to what it
    accepted: the greedy tokens are the packed engine's without drafts."""
    from vlmserve.engine.speculative import SpeculativeConfig

    model = build_model(arch, "micro")
    spec = SpeculativeConfig(prompt_lookup_min=1, adaptive=False)
    if method == "mtp":
        from vlmserve.testing.qwen3_5 import build_mtp
        spec = SpeculativeConfig(method="mtp", model=str(build_mtp(model, tmp_path / "mtp")), adaptive=False)
    words = "red circle blue square red circle blue square red circle"
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def run(speculative: SpeculativeConfig | None) -> tuple[list[list[int]], int]:
        async with running_engine(model, kv_bits=4, kv_group_size=GROUP, speculative=speculative,
                                  prefix_cache=False) as engine:
            assert engine.loaded.adapter.kv_quant is not None
            prompts = [engine.prompter.build([{"role": "user", "content": f"{words} {i}"}], []) for i in range(3)]
            results = await asyncio.gather(*(gather(engine.generate(f"r{i}", p, params)) for i, p in enumerate(prompts)))
            drafted = (await engine.stats()).spec_draft_tokens
            return [r.token_ids for r in results], drafted

    (plain, _), (drafted, draft_tokens) = asyncio.run(run(None)), asyncio.run(run(spec))
    assert drafted == plain and draft_tokens > 0


def test_gemma4s_assistant_drafter_keeps_full_precision_kv_and_says_why(tmp_path: Any,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Gemma 4's assistant reads the target's KV as floats: with it, --kv-bits is off, said at start-up."""
    from vlmserve.engine.speculative import SpeculativeConfig
    from vlmserve.testing.gemma4 import build_assistant

    model = build_model("gemma4", "micro")
    spec = SpeculativeConfig(method="mtp", model=str(build_assistant(model, tmp_path / "assistant")), adaptive=False)

    async def scenario() -> None:
        async with running_engine(model, kv_bits=8, kv_group_size=GROUP, speculative=spec) as engine:
            assert engine.loaded.adapter.kv_quant is None  # and start-up says why, below
            result = await gather(engine.generate_chat("x", [{"role": "user", "content": "Hi."}], [], None, GREEDY))
            assert result.error is None and len(result.token_ids) == GREEDY.max_tokens

    with caplog.at_level("WARNING"):
        asyncio.run(scenario())
    assert "--kv-bits is off: the drafter reads the target's KV as floats" in caplog.text
