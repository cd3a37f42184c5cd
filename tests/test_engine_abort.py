"""Cancellation and abort through the real worker: every stage, twice, and what comes after."""

from __future__ import annotations

import asyncio
import threading

from conftest import collect, running_engine

from vlmserve.engine.params import SamplingParams
from vlmserve.inputs import PromptInputs

LONG = SamplingParams(max_tokens=500, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


async def _assert_idle_and_serving(engine) -> None:
    """A follow-up right after a cancel completes, and no slot or KV is left behind."""
    after = await collect(engine, "follow-up", "hello", [], SHORT)
    assert after.finish_reason == "length" and len(after.token_ids) == 4
    stats = await engine.stats()
    assert stats.running == stats.waiting == stats.batch_size == 0
    assert engine.num_in_flight == 0


async def _until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


def test_cancel_mid_decode(gemma4_micro):
    async def scenario():
        async with running_engine(gemma4_micro) as engine:
            seen = []

            async def consume():
                async for out in engine.generate_chat("victim", [{"role": "user", "content": "hi"}], [], None, LONG):
                    seen.append(out)

            task = asyncio.create_task(consume())
            await _until(lambda: len(seen) >= 3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await _assert_idle_and_serving(engine)
            return len(seen)

    assert asyncio.run(scenario()) < LONG.max_tokens


def test_cancel_mid_prefill(gemma4_micro):
    prompt = PromptInputs(list(range(5, 600)))  # 595 tokens in chunks of 16: ~38 prefill steps

    async def scenario():
        async with running_engine(gemma4_micro, prefill_chunk=16, prefix_cache=False) as engine:
            before = (await engine.stats()).prompt_tokens
            task = asyncio.create_task(_drain(engine.generate("victim", prompt, LONG)))
            core = engine.core

            def mid_prefill() -> bool:
                req = core._requests.get("victim")
                return req is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens

            await _until(mid_prefill)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            prefilled = (await engine.stats()).prompt_tokens - before
            await _assert_idle_and_serving(engine)
            return prefilled

    # The victim never finished its prefill: the chunks done before the abort landed (16 tokens a
    # step, as many steps as the abort took to arrive), never the whole prompt.
    assert 0 < asyncio.run(scenario()) < len(prompt)


def test_cancel_while_waiting_never_reaches_the_batch(gemma4_micro):
    waiting_prompt = PromptInputs(list(range(5, 205)))

    async def scenario():
        async with running_engine(gemma4_micro, max_batch_size=1) as engine:
            busy = asyncio.create_task(collect(engine, "busy", "hi", [], LONG))
            await _until(lambda: (engine.metrics.running or 0) >= 1)
            before = (await engine.stats()).prompt_tokens
            waiter = asyncio.create_task(_drain(engine.generate("waiter", waiting_prompt, SHORT)))
            await _until(lambda: engine.core.scheduler.num_waiting >= 1)
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            after = (await engine.stats()).prompt_tokens
            await _assert_idle_and_serving(engine)
            return after - before

    assert asyncio.run(scenario()) == 0  # the waiter's 200 prompt tokens were never computed


def test_cancel_during_phase1_never_reaches_the_engine(gemma4_micro):
    entered, release = threading.Event(), threading.Event()

    def stuck_tokenizer(processor):
        entered.set()
        release.wait(30)
        return PromptInputs(list(range(5, 50)))

    async def scenario():
        async with running_engine(gemma4_micro) as engine:
            before = (await engine.stats()).prompt_tokens
            task = asyncio.create_task(_drain(engine.generate("phase1", stuck_tokenizer, SHORT)))
            await _until(entered.is_set)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            release.set()
            await asyncio.sleep(0.1)
            stats = await engine.stats()
            seen = engine.core._requests.get("phase1")
            await _assert_idle_and_serving(engine)
            return stats.prompt_tokens - before, seen

    delta, seen = asyncio.run(scenario())
    assert delta == 0 and seen is None


def test_abort_twice_and_abort_unknown_ids_are_harmless(gemma4_micro):
    async def scenario():
        async with running_engine(gemma4_micro) as engine:
            agen = engine.generate_chat("twice", [{"role": "user", "content": "hi"}], [], None, LONG)
            first = await agen.__anext__()
            engine.abort("twice")
            engine.abort("twice")
            engine.abort("no-such-request")
            rest = [out async for out in agen]
            await agen.aclose()
            await _assert_idle_and_serving(engine)
            return first, rest

    first, rest = asyncio.run(scenario())
    assert first.finish_reason is None and rest[-1].finish_reason == "abort"


async def _drain(agen):
    return [out async for out in agen]
