"""n > 1 on the real worker and real MLX: one prompt, prefilled once, forked into rows of its own.

A fork's first token comes from the prompt's own last logits and its KV is a copy of the prompt's,
so every choice computes what a request of the same prompt and the same sampling computes alone:
greedy forks all equal the lone greedy answer, and a fork with seed s + i equals a lone request with
seed s + i, on each kind of cache (plain KV, sliding window, M-RoPE deltas, recurrent state).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from conftest import Result, chat, collect, running_engine, scene

from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.testing import build_model

PICTURE = scene("circle", (220, 30, 30))


async def _forked(engine: AsyncEngine, request_id: str, text: str, images: list, params: list[SamplingParams]
                  ) -> list[Result]:
    """One prompt, ``len(params)`` choices: the first request, then each fork, read together."""
    forks = [(f"{request_id}-{i}", p) for i, p in enumerate(params[1:], 1)]
    prompt = lambda p: p.build(chat(text, len(images)), images, None, request_id=request_id)  # noqa: E731
    first = engine.generate(request_id, prompt, params[0], forks)
    results = [Result() for _ in params]

    async def read(stream, result: Result) -> None:
        async for out in stream:
            result.token_ids += out.token_ids
            result.finish_reason, result.error = out.finish_reason, out.error
            result.num_prompt_tokens = out.num_prompt_tokens

    head = await first.__anext__()  # the prompt reached the engine: the forks' streams exist
    results[0].token_ids += head.token_ids
    await asyncio.gather(read(first, results[0]),
                         *(read(engine.follow(fid, p), r) for (fid, p), r in zip(forks, results[1:])))
    return results


@pytest.mark.parametrize("arch", ["gemma4", "gemma3", "qwen2_5_vl", "qwen3_5"])
def test_forks_compute_what_lone_requests_with_their_sampling_compute(arch):
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=40 + i) for i in range(4)]

    async def scenario():
        async with running_engine(build_model(arch, "micro"), max_batch_size=8) as engine:
            lone = await collect(engine, "lone", "describe it", [PICTURE], greedy)
            before = (await engine.stats()).prompt_tokens
            same = await _forked(engine, "g", "describe it", [PICTURE], [greedy] * 3)
            prefilled = (await engine.stats()).prompt_tokens - before
            alone = [await collect(engine, f"s{i}", "describe it", [PICTURE], p) for i, p in enumerate(sampled)]
            forked = await _forked(engine, "f", "describe it", [PICTURE], sampled)
            stats = await engine.stats()
            assert stats.running == stats.batch_size == stats.waiting == 0
            return lone, same, prefilled, alone, forked

    lone, same, prefilled, alone, forked = asyncio.run(scenario())
    assert [r.token_ids for r in same] == [lone.token_ids] * 3
    assert prefilled == lone.num_prompt_tokens  # one prefill for the three
    assert [r.token_ids for r in forked] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in alone}) > 1  # the seeds do give different answers


def test_aborting_the_prompt_before_it_forks_ends_every_choice_and_frees_every_slot(gemma4_micro):
    long = " ".join(f"word{i}" for i in range(200))
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def scenario():
        async with running_engine(gemma4_micro, max_batch_size=4, prefill_chunk=16) as engine:
            forks = [(f"a-{i}", params) for i in (1, 2)]
            first = engine.generate("a", lambda p: p.build(chat(long), [], None, request_id="a"), params, forks)
            task = asyncio.create_task(first.__anext__())
            while engine.metrics.running < 3:  # admitted together, the prompt still prefilling
                await asyncio.sleep(0.001)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await first.aclose()  # the client went away: the prompt is aborted, and with it its forks
            ends = [out for fid, _ in forks async for out in engine.follow(fid, params)]
            for _ in range(200):
                stats = await engine.stats()
                if stats.running == 0:
                    break
                await asyncio.sleep(0.01)
            after = await collect(engine, "next", "hello", [], dataclasses.replace(params, max_tokens=3))
            return ends, stats, after

    ends, stats, after = asyncio.run(scenario())
    assert [o.finish_reason for o in ends] == ["abort", "abort"]
    assert stats.running == stats.batch_size == stats.waiting == 0
    assert len(after.token_ids) == 3


def test_more_choices_than_the_batch_holds_are_refused(gemma4_micro):
    async def scenario():
        async with running_engine(gemma4_micro, max_batch_size=2) as engine:
            stream = engine.generate("x", lambda p: p.build(chat("hi"), [], None, request_id="x"),
                                     SamplingParams(max_tokens=2), [("x-1", SamplingParams()), ("x-2", SamplingParams())])
            with pytest.raises(ValueError, match="cannot fit a batch of 2"):
                await stream.__anext__()

    asyncio.run(scenario())
