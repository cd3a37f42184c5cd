"""Speculative decoding (engine/speculative.py, engine/verify.py): drafts never change the output.

The oracle is mlx-vlm's own single-request greedy decode (``reference_greedy``): on every family a
request with drafts (ngram lookups, a prediction with an error and a deletion in it) gives its tokens,
alone and in a batch with requests whose drafts miss or that have none. Sampled requests repeat
exactly with drafts and without (each token's draw is its own, whichever forward computed it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import gather, scene
from test_families import Family, _start, _stop

from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import RunnerOutput, Sample
from vlmserve.engine.request import Request
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig
from vlmserve.engine.speculative import (
    Acceptance,
    DraftPolicy,
    SpeculativeConfig,
    expected_tokens,
    follow_prediction,
    lookup,
)
from vlmserve.inputs import PromptInputs
from vlmserve.testing import FAMILY_BUILDS, build_family, build_model

NGRAM = SpeculativeConfig(prompt_lookup_min=1, adaptive=False)  # a draft wherever any token repeats
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
TEXT = "one two three four, one two three four, say it again: one two three four"


# -- drafts, without a model ------------------------------------------------------------

@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 9, 1, 2], 3, [3, 9, 1]),  # the tail [1, 2] came before: what followed it
    ([1, 2, 5, 4, 2, 7, 1, 2], 2, [5, 4]),  # the longest tail that occurs ([1, 2], not [2])
    ([3, 2, 8, 2, 9, 2], 1, [9]),  # [2] alone: its most recent earlier occurrence
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([5, 5], 4, [5]),  # the continuation ends where the tokens do
])
def test_prompt_lookup(tokens: list[int], k: int, expected: list[int]) -> None:
    assert lookup(tokens, k, 1, 4) == expected


def test_prompt_lookup_needs_prompt_lookup_min_tokens() -> None:
    assert lookup([1, 2, 3, 9, 4, 2], 2, 2, 4) == []  # [4, 2] never came before; [2] alone is too short
    assert lookup([1, 2, 3, 9, 4, 2], 2, 1, 4) == [3, 9]


@pytest.mark.parametrize(("prediction", "output", "expected"), [
    ([1, 2, 3, 4, 5], [1, 2], [3, 4]),  # the output is the prediction's prefix so far
    ([1, 2, 3, 4, 5, 6], [1, 2, 9, 3], [4, 5]),  # an insertion: realigned on the tail [3]
    ([1, 2, 3, 4, 5, 6], [1, 2, 4], [5, 6]),  # a deletion
    ([7, 1, 7, 2, 7, 3], [7, 1, 7, 2, 8, 7], [3]),  # [7] three times: the one nearest where the output stands
    ([1, 2, 3], [1, 2, 3], []),  # the prediction is used up
    ([1, 2, 3], [8, 9], []),  # nothing in common
])
def test_following_a_prediction(prediction: list[int], output: list[int], expected: list[int]) -> None:
    assert follow_prediction(prediction, output, 2, 8) == expected


def test_the_policy_drafts_only_where_it_pays() -> None:
    policy = DraftPolicy(SpeculativeConfig(num_speculative_tokens=6), prompt_token_s=0.002, decode_step_s=0.01)
    # A draft token costs a fifth of a step here: a row whose drafts are right 9 times in 10 goes wide,
    assert policy.width([0.9], [6], rows=1) >= 4
    # one whose drafts are right 1 time in 10 does not go at all,
    assert policy.width([0.1], [6], rows=1) == 0
    # and a batch of 8, of which one row has a draft, pays 8 rows' width for it: none.
    assert policy.width([0.9], [6], rows=8) == 0
    # A step read at once costs more than a pipelined one: a middling draft no longer pays for it
    assert policy.width([0.5], [6], rows=1) == 1

    policy.sync_step_s = 0.015
    assert policy.width([0.5], [6], rows=1) == 0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert DraftPolicy(SpeculativeConfig(adaptive=False), 1.0, 0.01).width([0.0], [3], rows=8) == 3


def test_the_policy_counts_what_a_drafter_model_costs() -> None:
    policy = DraftPolicy(SpeculativeConfig(num_speculative_tokens=4), prompt_token_s=0.001, decode_step_s=0.01,
                         sync_step_s=0.01)
    assert policy.width([0.7], [4], rows=1, modelled=1) == 4  # unmeasured, a drafter costs nothing yet
    policy.draft_token_s = 0.002
    cheap = policy.width([0.7], [4], rows=1, modelled=1)
    policy.draft_token_s = 0.02  # each drafted token costs two steps: no draft pays that
    assert cheap >= 2 and policy.width([0.7], [4], rows=1, modelled=1) == 0


def test_a_draft_models_prefill_must_pay_back_over_the_tokens_a_row_may_make() -> None:
    """A draft model reads each prompt first. A new row drafts at the prior acceptance, 0.5: the best verify here,
    1 token wide, yields 1.5 tokens for 0.01 + 0.003 s, 8.7 ms a token against a decode step's 10: 1.3 ms saved."""
    config = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4)
    policy = DraftPolicy(config, prompt_token_s=0.001, decode_step_s=0.01, sync_step_s=0.01, draft_token_s=0.002)
    assert policy.pays_prefill(3000, 128)  # unmeasured: every row drafts
    policy.draft_prefill_token_s = 0.0005
    assert policy.pays_prefill(100, 128) and policy.pays_prefill(3000, 4096)  # 0.05 s < 0.17 s; 1.5 s < 5.5 s
    assert not policy.pays_prefill(3000, 128) and not policy.pays_prefill(100, 8)  # 1.5 s > 0.17 s; 0.05 > 0.011
    policy.draft_token_s = 0.02  # no draft pays: no prefill does either
    assert not policy.pays_prefill(1, 4096)
    assert DraftPolicy(dataclasses.replace(config, adaptive=False), 1.0, 0.01, 0.01, 1.0, 1.0).pays_prefill(9999, 1)


def test_acceptance_forgets_and_counts_the_prediction() -> None:
    a = Acceptance()
    for _ in range(20):
        a.record(4, 0, from_prediction=True)
    assert a.rate < 0.1 and a.prediction_accepted == 0
    for _ in range(20):
        a.record(4, 4, from_prediction=False)
    assert a.rate > 0.8 and a.prediction_accepted == 0  # these drafts were not the prediction's


@pytest.mark.parametrize("text", ['{"method": "ngram", "model": "x"}', '{"method": "eagle3"}',
                                  '{"method": "ngram", "num_speculative_tokens": 0}', '{"method": "ngram", "bogus": 1}',
                                  "[1]", "nope"])
def test_configs_that_cannot_run_are_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError) as refused:
        SpeculativeConfig.parse(text)
    assert "\n" not in str(refused.value)


# -- the scheduler plans drafts (fakes, no MLX) -----------------------------------------

def _decoding(scheduler: Scheduler, params: SamplingParams, output: list[int]) -> Request:
    req = Request("r", PromptInputs([1, 2, 3]), params)
    scheduler.add(req)
    scheduler.schedule()
    req.encoded, req.num_computed_tokens, req.output_token_ids = True, 3, list(output)
    return req


def test_the_plan_carries_each_rows_draft_cut_to_what_it_may_still_generate() -> None:
    config = SchedulerConfig(max_batch_size=4, prefill_chunk=64, speculative=NGRAM)
    scheduler = Scheduler(config)
    req = _decoding(scheduler, SamplingParams(max_tokens=8, prediction=(7, 8, 9, 10, 11, 12, 13)), [7, 8])
    plan = scheduler.schedule()
    assert plan.drafts == {"r": (9, 10, 11, 12)} and plan.num_scheduled_tokens == {"r": 5}
    req.output_token_ids = [7, 8, 9, 10, 11, 12]  # two tokens left: one drafted, the target's after it
    assert scheduler.schedule().drafts == {"r": (13,)}
    req.unread = True  # its newest token is still computing: the draft starts with a guess at it
    req.output_token_ids = [7, 8, 9, 10, 11]
    assert scheduler.schedule().drafts == {"r": (12, 13)}


def test_penalised_rows_get_no_draft() -> None:
    scheduler = Scheduler(SchedulerConfig(max_batch_size=4, prefill_chunk=64, speculative=NGRAM))
    _decoding(scheduler, SamplingParams(max_tokens=8, repetition_penalty=1.2, prediction=(7, 8, 9)), [7])
    assert scheduler.schedule().drafts == {}


def test_a_verified_draft_gives_its_tokens_in_order_up_to_the_end() -> None:
    scheduler = Scheduler(SchedulerConfig(max_batch_size=4, prefill_chunk=64))
    req = _decoding(scheduler, SamplingParams(max_tokens=4, prediction=(5, 6, 7, 8, 9)), [5])
    plan = scheduler.schedule()
    assert plan.drafts == {"r": (6, 7)}
    out = RunnerOutput(samples={"r": Sample(5)}, more={"r": [Sample(6), Sample(7), Sample(8)]}, verified={"r": (2, 2)})
    updates = scheduler.update_from_output(plan, out)
    assert [u.token_id for u in updates] == [5, 6, 7]  # max_tokens 4: the target's 8 is past the end
    assert req.output_token_ids == [5, 5, 6, 7] and updates[-1].finish is not None
    assert req.prediction_usage == (2, 3)  # of its 5 tokens, 2 were drafted and kept


def test_no_drafts_where_the_runner_cannot_verify() -> None:
    scheduler = Scheduler(SchedulerConfig(max_batch_size=4, prefill_chunk=64, verifies=False))
    _decoding(scheduler, SamplingParams(max_tokens=8, prediction=(7, 8, 9)), [7])
    assert scheduler.schedule().drafts == {}


# -- every family, on the real worker ------------------------------------------------------

@pytest.fixture(scope="module", params=FAMILY_BUILDS)
def family(request: pytest.FixtureRequest) -> Iterator[Family]:
    started = _start(build_family(request.param), speculative=NGRAM, prefix_cache=False)
    yield started
    _stop(started)


def _edited(tokens: list[int]) -> tuple[int, ...]:
    """A prediction close to ``tokens``: one wrong, one left out."""
    return (*tokens[:3], (tokens[3] + 1) % 100, *tokens[4:7], *tokens[8:])


def test_drafts_give_mlx_vlm_greedy_tokens_alone_and_batched(family: Family) -> None:
    if not family.engine.loaded.adapter.verifies_drafts:
        assert family.engine.core.scheduler.drafts is None  # off, and said where it is (README)
        pytest.skip(f"{family.arch}: drafts are not verified")
    red = scene("circle", (220, 30, 30))
    prompts = [family.prompt(TEXT), family.prompt("describe it; " + TEXT, [red]), family.prompt("hi")]
    want = [family.reference(p, GREEDY.max_tokens) for p in prompts]
    m0 = family.engine.metrics
    alone = [family.run(family.tokens(f"a{i}", p, GREEDY)) for i, p in enumerate(prompts)]
    predicted = [family.run(family.tokens(f"p{i}", p, dataclasses.replace(GREEDY, prediction=_edited(w))))
                 for i, (p, w) in enumerate(zip(prompts, want))]

    async def together() -> list[list[int]]:
        params = [dataclasses.replace(GREEDY, prediction=_edited(want[i % 3])) if i % 2 else GREEDY for i in range(6)]
        return await asyncio.gather(*(family.tokens(f"b{i}", prompts[i % 3], params[i]) for i in range(6)))

    batched = family.run(together())
    assert alone == want and predicted == want
    assert batched == [want[i % 3] for i in range(6)]
    m = family.engine.metrics
    assert m is not None and m0 is not None and m.spec_draft_tokens > m0.spec_draft_tokens
    assert 0 < m.spec_accepted_tokens - m0.spec_accepted_tokens < m.spec_draft_tokens - m0.spec_draft_tokens


# -- Gemma 4 in depth: grammars, logprobs, sampling, the image prefix cache ------------------

@pytest.fixture(scope="module")
def gemma4(gemma4_micro: Any) -> Iterator[Family]:
    started = _start(gemma4_micro, speculative=NGRAM, mm_prefix_cache=True)
    yield started
    _stop(started)


def _outputs(family: Family, request_id: str, prompt: PromptInputs, params: SamplingParams) -> Any:
    return family.run(gather(family.engine.generate(request_id, prompt, params)))


def test_logprobs_are_the_targets_with_drafts(gemma4: Family) -> None:
    prompt = gemma4.prompt(TEXT)
    params = dataclasses.replace(GREEDY, logprobs=True, top_logprobs=3)
    want = gemma4.reference(prompt, GREEDY.max_tokens)
    plain = _outputs(gemma4, "lp0", prompt, dataclasses.replace(params))
    drafted = _outputs(gemma4, "lp1", prompt, dataclasses.replace(params, prediction=_edited(want)))
    assert drafted.token_ids == plain.token_ids == want
    for a, b in zip(plain.logprobs, drafted.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_json_schema_row_drafts_within_its_grammar(gemma4: Family) -> None:
    engine = gemma4.engine
    guide = gemma4.run(engine.guide(_schema_spec()))
    prompt = gemma4.prompt("Give me a shape as JSON.")
    params = SamplingParams(max_tokens=40, guide=guide)
    plain = _outputs(gemma4, "j0", prompt, params)
    # A prediction that leaves the grammar after a few tokens: those tokens are drafted, the rest never
    wrong = engine.prompter.tokenize('{"shape": "circle", "colour": "red"} and then some prose', False)
    drafted = _outputs(gemma4, "j1", prompt, dataclasses.replace(params, prediction=tuple(wrong)))
    assert plain.error is None and drafted.error is None and drafted.token_ids == plain.token_ids
    assert drafted.text.startswith("{")  # the micro model writes JSON it may not finish in 40 tokens


def _schema_spec() -> Any:
    from vlmserve.preprocess.guided import GuideSpec
    return GuideSpec("json_schema", {"type": "object", "properties": {"shape": {"type": "string"},
                                                                     "colour": {"type": "string"}},
                                     "required": ["shape", "colour"], "additionalProperties": False})


def test_seeded_sampling_repeats_exactly_with_drafts(gemma4: Family) -> None:
    prompt = gemma4.prompt(TEXT)
    for seed in range(12):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=seed, ignore_eos=True)
        plain = _outputs(gemma4, f"s{seed}", prompt, params).token_ids
        again = _outputs(gemma4, f"t{seed}", prompt, dataclasses.replace(params, prediction=_edited(plain)))
        assert again.token_ids == plain, f"seed {seed}"


def _two_turns(family: Family) -> tuple[PromptInputs, list[int], PromptInputs]:
    """A chat about a picture: turn 1's prompt, its greedy reply (8 tokens), and turn 2's prompt."""
    red = scene("circle", (220, 30, 30))
    engine = family.engine
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe it"}]}]
    turn1 = engine.prompter.build(first, [red])
    reply1 = family.reference(turn1, 8)
    second = [*first, {"role": "assistant", "content": engine.prompter.detokenize(reply1)},
              {"role": "user", "content": [{"type": "text", "text": "again, " + TEXT}]}]
    return turn1, reply1, engine.prompter.build(second, [red])


def test_a_two_turn_chat_about_a_picture_under_the_image_prefix_cache(gemma4: Family) -> None:
    turn1, reply1, turn2 = _two_turns(gemma4)
    want = gemma4.reference(turn2, GREEDY.max_tokens)
    got1 = gemma4.run(gemma4.tokens("c1", turn1, dataclasses.replace(GREEDY, max_tokens=8, prediction=_edited(reply1))))
    got2 = _outputs(gemma4, "c2", turn2, dataclasses.replace(GREEDY, prediction=_edited(want)))
    assert got1 == reply1 and got2.token_ids == want
    assert got2.num_cached_tokens > 0  # turn 2 reused turn 1's KV, picture included


def test_drafts_across_the_sliding_window(family: Family) -> None:
    """Gemma's sliding-window layers keep only their window: a verify that writes past it is rolled
    back and its accepted KV replayed (mlx-vlm's rotating-cache transaction), alone and batched with a
    row that crosses the window at another step."""
    window = getattr(getattr(family.engine.loaded.model.config, "text_config", None), "sliding_window", None)
    if family.arch not in ("gemma3", "gemma4") or not isinstance(window, int):
        pytest.skip("no sliding-window layers")
    params = dataclasses.replace(GREEDY, max_tokens=40)
    prompts = [_prompt_of_length(family, window - 6), _prompt_of_length(family, window - 20)]  # the outputs cross it
    want = [family.reference(p, params.max_tokens) for p in prompts]

    async def together() -> list[list[int]]:
        return await asyncio.gather(*(family.tokens(f"w{i}", p, dataclasses.replace(params, prediction=_edited(w)))
                                      for i, (p, w) in enumerate(zip(prompts, want))))

    assert family.run(family.tokens("w", prompts[0], dataclasses.replace(params, prediction=_edited(want[0])))) == want[0]
    assert family.run(together()) == want


def _prompt_of_length(family: Family, tokens: int) -> PromptInputs:
    """A text prompt of about ``tokens`` tokens (within 6)."""
    words = [f"word{i % 50}" for i in range(tokens)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(family.prompt(" ".join(words[:mid]))) <= tokens else (lo, mid - 1)
    prompt = family.prompt(" ".join(words[:lo]))
    assert tokens - 6 <= len(prompt) <= tokens, len(prompt)
    return prompt


def test_sampled_tokens_at_drafted_positions_follow_the_target_distribution(gemma4: Family) -> None:
    """top_k 4 at temperature 1 leaves four tokens to sample from. The second token is sampled where a
    draft (the target's second most likely token) is verified: over 320 seeds, given the first token
    was the likeliest, its frequencies match the target's distribution there (chi-square, 3 degrees of
    freedom, below the 0.1% critical value 16.27)."""
    prompt = gemma4.prompt(TEXT)
    scored = _outputs(gemma4, "dist", prompt, SamplingParams(max_tokens=2, logprobs=True, top_logprobs=4,
                                                             ignore_eos=True))
    first, second = scored.token_ids[0], scored.logprobs[1].top  # greedy: the likeliest first token
    target = {token: math.exp(lp) for token, lp in second}
    total = sum(target.values())
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True,
                            prediction=(first, second[1][0], second[0][0]))

    async def sampled() -> list[list[int]]:
        runs = []
        for start in range(0, 320, 8):  # a batch at a time: every row verifies its draft in the same forward
            runs += await asyncio.gather(*(gemma4.tokens(f"d{seed}", prompt, dataclasses.replace(params, seed=seed))
                                           for seed in range(start, start + 8)))
        return runs

    runs = [r for r in gemma4.run(sampled()) if r[0] == first]
    counts = Counter(r[1] for r in runs)
    assert set(counts) <= set(target) and len(runs) > 60, (counts, len(runs))
    chi2 = sum((counts[t] - len(runs) * p / total) ** 2 / (len(runs) * p / total) for t, p in target.items())
    assert chi2 < 16.27, (chi2, counts, {t: p / total for t, p in target.items()})
    m = gemma4.engine.metrics
    assert m is not None and m.spec_drafts > 0


# -- drafter models: Gemma 4's assistant and Qwen3.5's MTP (mtp) ------------------------------

def _assistant(tmp_path_factory: pytest.TempPathFactory, target: Any) -> Any:
    from vlmserve.testing.gemma4 import build_assistant
    return build_assistant(target, tmp_path_factory.getbasetemp() / "gemma4-assistant")


def _qwen_mtp(tmp_path_factory: pytest.TempPathFactory, target: Any) -> Any:
    from vlmserve.testing.qwen3_5 import build_mtp
    return build_mtp(target, tmp_path_factory.getbasetemp() / "qwen3_5-mtp")


DRAFTERS = {"gemma4": _assistant, "qwen3_5": _qwen_mtp}


@pytest.fixture(scope="module", params=list(DRAFTERS))
def drafted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """A target with its drafter (Gemma 4's random assistant; Qwen3.5's MTP, with a KV of its own) that
    drafts on every step, whatever it costs."""
    target = build_model(request.param, "micro")
    config = SpeculativeConfig(method="mtp", model=str(DRAFTERS[request.param](tmp_path_factory, target)),
                               adaptive=False)
    started = _start(target, speculative=config, mm_prefix_cache=True)
    yield started
    _stop(started)


# A presence penalty this small changes no token, and a row with a penalty never drafts: the same
# request, decoded one token at a time, to compare a drafted row with.
PLAIN = {"presence_penalty": 1e-9}


def greedy_alone_and_batched(family: Family, tag: str) -> None:
    """A drafter forced on gives the target's greedy tokens for a text, an image and a short prompt, alone and
    six at once beside rows that never draft (``PLAIN``); every drafted row drafts on each step but its first."""
    red = scene("circle", (220, 30, 30))
    prompts = [family.prompt(TEXT), family.prompt("describe it; " + TEXT, [red]), family.prompt("hi")]
    want = [family.reference(p, GREEDY.max_tokens) for p in prompts]
    m0 = family.engine.metrics
    alone = [family.run(family.tokens(f"{tag}a{i}", p, GREEDY)) for i, p in enumerate(prompts)]

    async def together() -> list[list[int]]:
        params = [dataclasses.replace(GREEDY, **PLAIN) if i % 2 else GREEDY for i in range(6)]
        return await asyncio.gather(*(family.tokens(f"{tag}b{i}", prompts[i % 3], params[i]) for i in range(6)))

    assert alone == want
    assert family.run(together()) == [want[i % 3] for i in range(6)]
    m = family.engine.metrics
    assert m is not None and m0 is not None
    # every drafted row drafted on each step but its first: 13 verifies of 4 tokens, less the last ones' room
    assert m.spec_drafts - m0.spec_drafts >= 6 * 10


def sampling_kept(family: Family, tag: str, seeds: int = 4) -> None:
    """A drafted row's logprobs (within a verify's float32 rounding), JSON grammar, seeded samples and
    ``min_tokens`` are those of the same request that never drafts."""
    prompt = family.prompt(TEXT)
    params = dataclasses.replace(GREEDY, logprobs=True, top_logprobs=3)
    plain = _outputs(family, f"{tag}l0", prompt, dataclasses.replace(params, **PLAIN))
    mine = _outputs(family, f"{tag}l1", prompt, params)
    assert mine.token_ids == plain.token_ids == family.reference(prompt, GREEDY.max_tokens)
    # A verify runs several positions in one forward: float32 rounding (Qwen3.5's gated delta rule over
    # the block moved a logprob by 2.3e-5; Gemma 4's by < 1e-5)
    for a, b in zip(plain.logprobs, mine.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [t for t, _ in a.top] == [t for t, _ in b.top]

    guide = family.run(family.engine.guide(_schema_spec()))
    schema = SamplingParams(max_tokens=40, guide=guide)
    shape = family.prompt("Give me a shape as JSON.")
    plain, mine = (_outputs(family, f"{tag}j{i}", shape, p)
                   for i, p in enumerate([dataclasses.replace(schema, **PLAIN), schema]))
    answer = mine.text.split("</think>")[-1].lstrip()  # Qwen3.5 closes the thought its prompt opens first
    assert mine.error is None and mine.token_ids == plain.token_ids and answer.startswith("{")

    for seed in range(seeds):
        sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=seed, ignore_eos=True)
        plain = _outputs(family, f"{tag}s{seed}", prompt, dataclasses.replace(sampled, **PLAIN)).token_ids
        assert _outputs(family, f"{tag}t{seed}", prompt, sampled).token_ids == plain, f"seed {seed}"
    late = SamplingParams(max_tokens=12, min_tokens=8)
    assert _outputs(family, f"{tag}m1", prompt, late).token_ids == _outputs(
        family, f"{tag}m0", prompt, dataclasses.replace(late, **PLAIN)).token_ids


def test_a_drafter_gives_mlx_vlm_greedy_tokens_alone_and_batched_with_rows_that_do_not_draft(drafted: Family) -> None:
    greedy_alone_and_batched(drafted, "m")


def test_a_drafters_rows_keep_the_targets_logprobs_grammar_and_seeded_samples(drafted: Family) -> None:
    sampling_kept(drafted, "m", seeds=6)


def test_n_forks_each_speculate_on_their_own(drafted: Family) -> None:
    """n > 1: the forks share the prompt (and, with an MTP drafter, its drafter state, copied), then each
    drafts and is verified as its own row. Each fork's tokens are those of a lone request with its
    sampling that never drafts."""
    from test_engine_forks import _forked

    sampled = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=20, seed=70 + i) for i in range(3)]
    m0 = drafted.engine.metrics
    forked = drafted.run(_forked(drafted.engine, "mf", TEXT, [], sampled))
    m = drafted.engine.metrics
    lone = [drafted.run(_forked(drafted.engine, f"mg{i}", TEXT, [], [dataclasses.replace(p, **PLAIN)]))[0]
            for i, p in enumerate(sampled)]
    assert [r.error for r in forked] == [None] * 3
    assert [r.token_ids for r in forked] == [r.token_ids for r in lone]
    assert m is not None and m0 is not None and m.spec_drafts - m0.spec_drafts >= 3 * 5  # every fork drafted


def test_a_drafter_in_a_two_turn_chat_about_a_picture_under_the_image_prefix_cache(drafted: Family) -> None:
    turn1, reply1, turn2 = _two_turns(drafted)
    assert drafted.run(drafted.tokens("mc1", turn1, dataclasses.replace(GREEDY, max_tokens=8))) == reply1
    got2 = _outputs(drafted, "mc2", turn2, GREEDY)
    assert got2.token_ids == drafted.reference(turn2, GREEDY.max_tokens) and got2.num_cached_tokens > 0


@pytest.mark.parametrize("drafted", ["gemma4"], indirect=True)
def test_the_drafter_proposes_what_mlx_vlms_own_round_loop_does(drafted: Family) -> None:
    """The wiring: wherever both loops draft from the same context and input token, our drafter's
    tokens are mlx-vlm's (its MTP round loop for the prompt alone, on the same drafter weights). Ours
    runs two prompts in one batch, one of them past the sliding window (its keys a rotated ring)."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    engine = drafted.engine
    window = engine.loaded.model.config.text_config.sliding_window
    params = dataclasses.replace(GREEDY, max_tokens=24)
    prompts = [drafted.prompt(TEXT), _prompt_of_length(drafted, window - 8)]
    theirs: dict[tuple[int, int], list[int]] = {}
    ours: dict[tuple[int, int], list[int]] = {}

    def reference(prompt: PromptInputs) -> None:
        import mlx.core as mx
        assert engine.config.speculative is not None
        model, _ = load_drafter(engine.config.speculative.model, "mtp")
        model.set_dtype(engine.loaded.model.language_model.model.embed_tokens.weight.dtype)
        block = model.draft_block

        def draft_block(bonus: Any, *args: Any, **kwargs: Any) -> Any:
            out = block(bonus, *args, **kwargs)
            theirs[(int(model._position), int(bonus if isinstance(bonus, int) else bonus.item()))] = out[0].tolist()
            return out

        model.draft_block = draft_block
        ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
        for _ in generate_step(ids, engine.loaded.model, None, mx.ones(ids.shape, dtype=mx.int32),
                               max_tokens=params.max_tokens, temperature=0.0, draft_model=model, draft_kind="mtp",
                               draft_block_size=5):
            pass

    for prompt in prompts:
        engine.worker.call(reference, prompt)
    drafter = engine.loaded.drafter
    assert drafter is not None
    propose = drafter.propose

    def recorded(cache: list[Any], rows: list[int], inputs: list[int], *args: Any) -> Any:
        out = propose(cache, rows, inputs, *args)
        lengths = cache[next(iter(drafter.sources.values()))].offset.tolist()
        ours.update({(lengths[r] - 1, token): list(d) for r, token, d in zip(rows, inputs, out)})
        return out

    async def together() -> list[list[int]]:
        return await asyncio.gather(*(drafted.tokens(f"mw{i}", p, params) for i, p in enumerate(prompts)))

    drafter.propose = recorded  # type: ignore[method-assign]
    try:
        drafted.run(together())
    finally:
        del drafter.propose
    both = theirs.keys() & ours.keys()
    agreed = 0
    for key in both:  # the loops draft as many tokens as each has room for: the first ones agree
        n = min(len(ours[key]), len(theirs[key]))
        assert ours[key][:n] == theirs[key][:n], (key, ours[key], theirs[key])
        agreed += n >= 3
    past = [p for p, _ in both if p >= window]
    assert agreed >= 20 and len(past) >= 5, (sorted(theirs), sorted(ours))


# (prompt, position, input) -> the tokens drafted there
Drafts = dict[tuple[int, int, int], list[int]]


def batched_drafts(family: Family, prompts: list[Any], params: SamplingParams, tag: str) -> Drafts:
    """Three prompts in one batch, the third with a right prediction of 7 tokens (its first verifies keep
    several tokens each, which go through the drafter together): each gives the greedy reference, and each
    step's drafts are returned by (prompt, position, input)."""
    drafter = family.engine.loaded.drafter
    assert drafter is not None
    draft, ours = drafter.draft, {}

    def recorded(batch: Any, rows: list[int], inputs: list[int], k: int) -> Any:
        out = draft(batch, rows, inputs, k)
        positions = batch.draft.position.tolist()
        for i, d in out.items():
            ours[(int(batch.request_ids[i][len(tag):]), positions[i], inputs[i])] = list(d)
        return out

    want = [family.reference(p, params.max_tokens) for p in prompts]
    asked = [params, params, dataclasses.replace(params, prediction=tuple(want[2][:7]))]

    async def together() -> list[list[int]]:
        return await asyncio.gather(*(family.tokens(f"{tag}{i}", p, q) for i, (p, q) in enumerate(zip(prompts, asked))))

    drafter.draft = recorded  # type: ignore[method-assign]
    try:
        assert family.run(together()) == want
    finally:
        del drafter.draft
    return ours


def agree(ours: Drafts, theirs: Drafts, prompts: list[Any]) -> None:
    """Where both drafted at the same (prompt, position, input), the same tokens (as many as both have), at 25
    points at least, on every prompt, the third's after its prediction's tokens."""
    both = theirs.keys() & ours.keys()
    for key in both:
        n = min(len(ours[key]), len(theirs[key]))
        assert ours[key][:n] == theirs[key][:n], (key, ours[key], theirs[key])
    assert len(both) >= 25 and {w for w, _, _ in both} == {0, 1, 2}, (sorted(theirs), sorted(ours))
    assert min(p for w, p, _ in both if w == 2) > len(prompts[2].input_ids) + 5


@pytest.fixture(scope="module")
def mtp_drafted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """Qwen3.5 with its MTP drafter, without the prefix cache: a prompt that reuses a cached prefix gives
    the drafter its own positions only."""
    target = build_model("qwen3_5", "micro")
    config = SpeculativeConfig(method="mtp", model=str(_qwen_mtp(tmp_path_factory, target)), adaptive=False)
    started = _start(target, speculative=config, prefix_cache=False)
    yield started
    _stop(started)


def test_the_mtp_drafter_proposes_what_mlx_vlms_drafter_does_over_the_whole_context(mtp_drafted: Family) -> None:
    """Qwen3.5's MTP keeps a KV of its own: every prompt position, then each kept token, paired with the
    target's hidden state there. Ours fills it in the prefill and moves it with the batch; two prompts in
    one batch draft, at every step, what mlx-vlm's drafter class drafts for each alone when it is given
    the whole prompt (``prefill_from_target_hidden``) and then each token the target decodes
    (``accept_verified_tokens``). A third row first drafts from a prediction that is right (its verifies
    keep several tokens each, which go through the drafter together), then from the drafter.
    mlx-vlm 0.7.10's own generate loop gives the drafter the prompt's last position only (it keeps the
    last prefill chunk's hidden states): its drafts cannot be the reference."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.speculative.drafters import load_drafter

    engine = mtp_drafted.engine
    params = dataclasses.replace(GREEDY, max_tokens=16)
    prompts = [mtp_drafted.prompt(TEXT), mtp_drafted.prompt("hi"), mtp_drafted.prompt("say it: " + TEXT)]
    theirs: Drafts = {}

    def reference(which: int) -> None:
        assert engine.config.speculative is not None
        model, _ = load_drafter(engine.config.speculative.model, "mtp")
        target = engine.loaded.model
        lm = target.language_model
        model.reset(target)
        cache = make_prompt_cache(lm)
        ids = mx.array(prompts[which].input_ids, dtype=mx.int32)[None]
        out = lm(ids, cache=cache, return_hidden=True)
        token = int(mx.argmax(out.logits[0, -1]).item())
        model.prefill_from_target_hidden(ids, out.hidden_states[-1], token, None, greedy=True)
        for _ in range(params.max_tokens - 1):
            position = int(model._next_position)
            drafts = model.draft_block(token, None, None, 5, None, greedy=True)
            theirs[(which, position, token)] = drafts[0].tolist()
            out = lm(mx.array([[token]]), cache=cache, return_hidden=True)
            token = int(mx.argmax(out.logits[0, -1]).item())
            model.accept_verified_tokens(out.hidden_states[-1], drafts, 0, [token], None, greedy=True)

    for which in range(len(prompts)):
        engine.worker.call(reference, which)
    m0 = mtp_drafted.engine.metrics
    ours = batched_drafts(mtp_drafted, prompts, params, "mq")
    m = mtp_drafted.engine.metrics
    assert m is not None and m0 is not None and m.spec_accepted_tokens - m0.spec_accepted_tokens >= 5
    agree(ours, theirs, prompts)


def test_a_drafter_serves_a_4_bit_target(gemma4_micro: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Most served models are 4-bit: the drafter takes the target's serving dtype from a float tensor
    (a quantized embedding's weight is packed integers)."""
    config = SpeculativeConfig(method="mtp", model=str(_assistant(tmp_path_factory, gemma4_micro)), adaptive=False)
    family = _start(build_model("gemma4", "micro", quant_bits=4), speculative=config, prefix_cache=False)
    try:
        prompt = family.prompt(TEXT)
        assert family.run(family.tokens("q4", prompt, GREEDY)) == family.reference(prompt, GREEDY.max_tokens)
        m = family.engine.metrics
        assert m is not None and m.spec_drafts > 0
        drafter = family.engine.loaded.drafter
        assert drafter is not None

        def dtypes() -> set[str]:
            from mlx.utils import tree_flatten
            return {str(v.dtype) for _, v in tree_flatten(drafter.model.parameters())}

        assert family.engine.worker.call(dtypes) == {"mlx.core.float32"}  # as the target serves, not packed ints
    finally:
        _stop(family)


def test_a_qwen3_5_checkpoints_own_mtp_layers_draft_without_a_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``{"method": "mtp"}`` without a model, as vLLM reads it: the MTP layers the checkpoint carries."""
    from vlmserve.testing.qwen3_5 import carry_mtp

    target = build_model("qwen3_5", "micro")
    carried = carry_mtp(target, _qwen_mtp(tmp_path_factory, target), tmp_path_factory.getbasetemp() / "qwen3_5-own-mtp")
    family = _start(carried, speculative=SpeculativeConfig(method="mtp", adaptive=False), prefix_cache=False)
    try:
        prompt = family.prompt(TEXT)
        assert family.run(family.tokens("own", prompt, GREEDY)) == family.reference(prompt, GREEDY.max_tokens)
        m = family.engine.metrics
        assert m is not None and m.spec_drafts >= GREEDY.max_tokens // 4
        # The KV budget counts the drafter's own KV: an entry per position, as a full-attention layer's
        text = family.engine.loaded.model.config.text_config
        layer = 2 * text.num_key_value_heads * text.head_dim * 4  # float32 keys and values, per position
        full = sum(not x.is_linear for x in family.engine.loaded.model.language_model.model.layers)
        assert family.engine.core.kv.footprint.per_position == (full + 1) * layer
    finally:
        _stop(family)


def test_a_drafter_that_cannot_serve_its_target_is_refused_at_load_in_one_line(
        gemma4_micro: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    from vlmserve.engine.loader import ModelLoadError

    assistant = str(_assistant(tmp_path_factory, gemma4_micro))
    cases = [(build_model("qwen2_vl", "micro"), assistant, "drafts for gemma4, not qwen2_vl"),
             (gemma4_micro, str(gemma4_micro), "is a 'gemma4'"),
             (gemma4_micro, "/no/such/drafter", "could not be loaded"),
             (gemma4_micro, None, "carries no MTP layers of its own"),  # no model: the checkpoint's own
             (build_model("qwen3_5", "micro"), None, "carries no MTP layers mlx-vlm can read")]
    for target, drafter, says in cases:
        config = SpeculativeConfig(method="mtp", model=drafter)
        with pytest.raises(ModelLoadError) as caught:
            _start(target, speculative=config)
        assert says in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
