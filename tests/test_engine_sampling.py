"""Per-request sampling through the real engine: seeds, top-k/p, penalties, logit bias, stops, logprobs, limits."""

from __future__ import annotations

import asyncio
import math

import pytest
from conftest import collect, running_engine

from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import EngineOverloadedError


def _run(path, *cases, **config):
    """Run ``(text, params)`` cases one after another on one engine; return their results."""

    async def scenario():
        async with running_engine(path, **config) as engine:
            return [await collect(engine, f"r{i}", text, [], params) for i, (text, params) in enumerate(cases)]

    return asyncio.run(scenario())


def test_seeded_sampling_is_reproducible_and_seeds_differ(gemma4_micro):
    hot = dict(max_tokens=24, temperature=1.5, ignore_eos=True)
    a, b, c = _run(gemma4_micro, *[("tell me", SamplingParams(**hot, seed=s)) for s in (7, 7, 8)])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(gemma4_micro):
    greedy, top_k, top_p = _run(
        gemma4_micro,
        ("tell me", SamplingParams(max_tokens=16, ignore_eos=True)),
        ("tell me", SamplingParams(max_tokens=16, ignore_eos=True, temperature=2.0, top_k=1, seed=1)),
        ("tell me", SamplingParams(max_tokens=16, ignore_eos=True, temperature=2.0, top_p=1e-6, seed=2)),
    )
    assert top_k.token_ids == greedy.token_ids == top_p.token_ids


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_presence_penalty_forbids_every_seen_token(gemma4_micro):
    prompt = "hello hello"
    plain, penalized = _run(
        gemma4_micro,
        (prompt, SamplingParams(max_tokens=24, ignore_eos=True)),
        (prompt, SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1000.0)),
    )
    assert _repeats(penalized.token_ids) == 0
    assert penalized.token_ids != plain.token_ids


def test_repetition_penalty_reduces_repeats(gemma4_micro):
    cases = [(t, SamplingParams(max_tokens=32, ignore_eos=True)) for t in ("two", "x", "hi", "abc abc", "tell me")]
    plain = _run(gemma4_micro, *cases)
    text, res = max(zip((t for t, _ in cases), plain), key=lambda tr: _repeats(tr[1].token_ids))
    assert _repeats(res.token_ids) > 0, "need a prompt whose greedy output repeats itself"
    (penalized,) = _run(gemma4_micro, (text, SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=3.0)))
    assert _repeats(penalized.token_ids) < _repeats(res.token_ids)


def test_max_tokens_stop_token_ids_and_stop_strings(gemma4_micro):
    base = SamplingParams(max_tokens=20, ignore_eos=True)
    (ref,) = _run(gemma4_micro, ("hello", base))
    assert ref.finish_reason == "length" and len(ref.token_ids) == 20
    stop_id = ref.token_ids[5]
    cut = ref.token_ids.index(stop_id)
    stop_text = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
    assert stop_text.strip(), f"need visible text to stop on: {ref.text!r}"
    by_id, by_text = _run(
        gemma4_micro,
        ("hello", SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,))),
        ("hello", SamplingParams(max_tokens=20, ignore_eos=True, stop=("@@never@@", stop_text))),
    )
    assert by_id.token_ids == ref.token_ids[:cut] and by_id.finish_reason == "stop"
    assert by_text.text == ref.text[: ref.text.find(stop_text)] and by_text.finish_reason == "stop"


@pytest.mark.parametrize("arch, end_of_turn", [("gemma4", "<turn|>"), ("gemma3", "<end_of_turn>")])
def test_eos_comes_from_the_config_the_tokenizer_and_the_template(arch, end_of_turn, request):
    path = request.getfixturevalue(f"{arch}_micro")

    async def scenario():
        async with running_engine(path) as engine:
            tokenizer = engine.loaded.tokenizer
            return engine.loaded.eos_token_ids, tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(end_of_turn)

    eos, tokenizer_eos, turn_end = asyncio.run(scenario())
    assert {tokenizer_eos, turn_end} <= eos


def test_a_stop_token_ends_the_request_and_is_not_output(gemma4_micro):
    (ref,) = _run(gemma4_micro, ("hello", SamplingParams(max_tokens=20, ignore_eos=True)))
    stop = ref.token_ids[3]
    (res,) = _run(gemma4_micro, ("hello", SamplingParams(max_tokens=20, stop_token_ids=(stop,))))
    assert res.finish_reason == "stop" and res.token_ids == ref.token_ids[: ref.token_ids.index(stop)]


def test_logprobs_and_top_logprobs(gemma4_micro):
    (res,) = _run(gemma4_micro, ("hello", SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)))
    assert len(res.logprobs) == len(res.token_ids) == 8
    for token, lp in zip(res.token_ids, res.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy picks the top-1
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
        assert [p for _, p in lp.top] == sorted((p for _, p in lp.top), reverse=True)


def test_logit_bias_bans_and_forces_tokens_in_one_row_of_a_batch(gemma4_micro):
    """-100 bans a token and +100 forces one, greedy or sampled, while the unbiased neighbour in the
    same batch decodes exactly as it does alone."""
    plain = SamplingParams(max_tokens=16, ignore_eos=True)

    async def scenario():
        async with running_engine(gemma4_micro, max_batch_size=4) as engine:
            alone = await collect(engine, "alone", "hello", [], plain)
            banned = SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=tuple((t, -100.0) for t in alone.token_ids))
            forced = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=3,
                                    logit_bias=((alone.token_ids[0], -100.0), (42, 100.0)))
            together = await asyncio.gather(*(collect(engine, f"r{i}", "hello", [], p)
                                              for i, p in enumerate((plain, banned, forced))))
            return alone, together

    alone, (neighbour, banned, forced) = asyncio.run(scenario())
    assert neighbour.token_ids == alone.token_ids
    assert len(banned.token_ids) == 16 and not set(banned.token_ids) & set(alone.token_ids)
    assert forced.token_ids == [42] * 16


def test_bounded_queue_fails_fast_when_full(gemma4_micro):
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def scenario():
        async with running_engine(gemma4_micro, max_batch_size=1, max_queue=1) as engine:
            busy = [asyncio.create_task(collect(engine, f"busy{i}", "hi", [], long)) for i in range(2)]
            await asyncio.sleep(0)
            with pytest.raises(EngineOverloadedError, match="overloaded"):
                await collect(engine, "third", "hi", [], long)
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return await collect(engine, "after", "hi", [], SamplingParams(max_tokens=3))

    assert asyncio.run(scenario()).finish_reason in ("length", "stop")


def test_min_tokens_holds_the_stop_tokens_and_strings_back_until_it_is_reached(gemma4_micro):
    """vLLM's ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, nor a stop string end the
    request, before that many tokens. An EOS forced by +100 comes at token 6 with ``min_tokens`` 5 (and at
    once without); a stop token the plain decode meets early is ruled out until then, the tokens before
    being what a -inf bias on it gives; a stop string ends only text after it. A neighbour in the same
    batch decodes as it does alone."""
    from vlmserve.engine.speculative import SpeculativeConfig

    async def scenario(**config):
        async with running_engine(gemma4_micro, max_batch_size=4, **config) as engine:
            eos = min(engine.loaded.eos_token_ids)
            (ref,) = [await collect(engine, "ref", "hello", [], SamplingParams(max_tokens=20, ignore_eos=True))]
            stop = ref.token_ids[2]
            forced = {"logit_bias": ((eos, 100.0),), "max_tokens": 20}
            cases = {
                "forced": SamplingParams(**forced), "forced_held": SamplingParams(**forced, min_tokens=5),
                "stopped": SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)),
                "stop_held": SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,), min_tokens=12),
                "banned": SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=((stop, -100.0),)),
                "string_held": SamplingParams(max_tokens=20, ignore_eos=True, stop=(ref.text[:2],), min_tokens=3),
                "neighbour": SamplingParams(max_tokens=20, ignore_eos=True),
            }
            got = dict(zip(cases, await asyncio.gather(*(collect(engine, name, "hello", [], p)
                                                         for name, p in cases.items()))))
            # Drafts (here the request's own prediction of its answer, past its end) come only once a row
            # is past min_tokens: a verify step samples several positions at one count of tokens made
            right = (*got["forced_held"].token_ids, *ref.token_ids)
            got["predicted"] = await collect(engine, "predicted", "hello", [],
                                             SamplingParams(**forced, min_tokens=5, prediction=right))
            return ref, stop, eos, got

    for config in ({}, {"speculative": SpeculativeConfig(prompt_lookup_min=1, adaptive=False)}):
        ref, stop, eos, out = asyncio.run(scenario(**config))
        assert out["forced"].token_ids == [] and out["forced"].finish_reason == "stop"
        assert len(out["forced_held"].token_ids) == 5 and out["forced_held"].finish_reason == "stop", config
        assert eos not in out["forced_held"].token_ids
        assert out["predicted"].token_ids == out["forced_held"].token_ids, config
        assert out["stopped"].token_ids == ref.token_ids[:ref.token_ids.index(stop)]
        held = out["stop_held"].token_ids
        assert len(held) >= 12 and held[:12] == out["banned"].token_ids, config
        assert stop not in held[:12]
        assert out["string_held"].text.startswith(ref.text[:2]) and len(out["string_held"].token_ids) >= 3
        assert out["neighbour"].token_ids == ref.token_ids


def test_min_tokens_over_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
