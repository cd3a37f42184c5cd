"""Draft models (engine/draft_model.py, ``{"method": "draft_model", "model": DIR}``): a small model of the target's
tokenizer drafting for it, in the continuous batch. Drafting on every step (``adaptive: false``), every request
gives the target's own greedy tokens (mlx-vlm's ``generate_step`` alone), beside rows that do not draft, with
images, logprobs, a grammar, seeded sampling, ``n`` and min_tokens.

The target is the Qwen2.5-VL micro build; the draft models are mlx-lm Qwen2 text models with its tokenizer, cut
from its own language model (vlmserve/testing/draft_model.py): all of its layers (it drafts the target's own
tokens for a text prompt, so every draft is accepted only where each row's draft KV holds exactly its tokens),
or its first layer alone (a smaller model of the same tokenizer).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import gather, scene
from test_engine_spec_batch import _recording, _turn_two
from test_engine_speculative import _outputs, sampling_kept
from test_families import Family, _start, _stop

from vlmserve.engine.loader import ModelLoadError
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.testing import build_model
from vlmserve.testing.draft_model import build_draft_model

GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
TEXT = "one two three four, one two three four, say it again: one two three four"
PLAIN = {"presence_penalty": 1e-9}  # a row with a penalty never drafts (and this one changes no token)
RED = scene("circle", (220, 30, 30))


def _draft(tmp: pytest.TempPathFactory, layers: int | None = None) -> tuple[Path, Path]:
    target = Path(build_model("qwen2_5_vl", "micro"))
    name = f"qwen2_5_vl-draft-{layers or 'all'}"
    return target, build_draft_model(target, tmp.getbasetemp() / name, layers)


def _serve(target: Path, draft: Path, **config: Any) -> Family:
    spec = SpeculativeConfig(method="draft_model", model=str(draft), adaptive=False)
    return _start(target, speculative=spec, **{"prefix_cache": False, **config})


@pytest.fixture(scope="module")
def same(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """Qwen2.5-VL with a draft model of its own language model, drafting on every step."""
    started = _serve(*_draft(tmp_path_factory))
    yield started
    _stop(started)



def _accepted(family: Family, run: Any) -> tuple[int, int]:
    """Draft tokens verified and accepted while ``run`` runs."""
    m0 = family.engine.metrics
    assert m0 is not None
    drafted, accepted = m0.spec_draft_tokens, m0.spec_accepted_tokens
    run()
    m = family.engine.metrics
    assert m is not None
    return m.spec_draft_tokens - drafted, m.spec_accepted_tokens - accepted


def test_a_draft_model_gives_the_targets_greedy_tokens_alone_and_batched(same: Family) -> None:
    prompts = [same.prompt(TEXT), same.prompt("describe it; " + TEXT, [RED]), same.prompt("hi")]
    want = [same.reference(p, GREEDY.max_tokens) for p in prompts]
    alone: list[list[int]] = []
    drafted, accepted = _accepted(same, lambda: alone.extend(
        same.run(same.tokens(f"a{i}", p, GREEDY)) for i, p in enumerate(prompts)))
    assert alone == want
    assert drafted >= 3 * 10 and accepted > 0, (drafted, accepted)  # the image row's drafts see its text only

    async def together() -> list[list[int]]:
        params = [dataclasses.replace(GREEDY, **PLAIN) if i % 2 else GREEDY for i in range(6)]
        return await asyncio.gather(*(same.tokens(f"b{i}", prompts[i % 3], params[i]) for i in range(6)))

    assert same.run(together()) == [want[i % 3] for i in range(6)]


def test_text_rows_accept_every_draft_of_a_draft_model_that_is_the_target(same: Family) -> None:
    """Its KV holds each row's tokens exactly (a prompt's, each kept token, nothing a rejected draft wrote):
    on text prompts, alone and four at once, its drafts are the target's own next tokens."""
    prompts = [same.prompt(TEXT), same.prompt("hi"), same.prompt("count: one two three"), same.prompt("say " + TEXT)]
    want = [same.reference(p, 24) for p in prompts]
    params = dataclasses.replace(GREEDY, max_tokens=24)

    async def together() -> list[list[int]]:
        return await asyncio.gather(*(same.tokens(f"t{i}", p, params) for i, p in enumerate(prompts)))

    got: list[list[int]] = []
    drafted, accepted = _accepted(same, lambda: got.extend(same.run(together())))
    assert got == want
    assert drafted > 0 and accepted >= 0.95 * drafted, (drafted, accepted)  # near-ties in float32 may differ


def test_draft_model_rows_keep_logprobs_grammar_seeded_samples_n_and_min_tokens(same: Family) -> None:
    sampling_kept(same, "")
    prompt = same.prompt(TEXT)

    async def forked() -> list[list[int]]:
        forks = [(f"n0-{i}", GREEDY) for i in (1, 2)]
        first = same.engine.generate("n0", prompt, GREEDY, forks)
        head = await first.__anext__()
        rows = await asyncio.gather(gather(first), *(gather(same.engine.follow(f, p)) for f, p in forks))
        return [[*head.token_ids, *rows[0].token_ids], *(list(r.token_ids) for r in rows[1:])]

    assert same.run(forked()) == [same.reference(prompt, GREEDY.max_tokens)] * 3


def test_a_smaller_draft_model_of_the_same_tokenizer_gives_the_targets_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """One layer of the target's two, with prefix caches on: a second turn reuses the first's KV, and its row's
    draft KV is its whole prompt's still."""
    family = _serve(*_draft(tmp_path_factory, layers=1), prefix_cache=True)
    try:
        prompts = [family.prompt(TEXT), family.prompt("what is it? " + TEXT, [RED]), family.prompt(TEXT)]
        got = [_outputs(family, f"o{i}", p, GREEDY) for i, p in enumerate(prompts)]
        assert [r.token_ids for r in got] == [family.reference(p, GREEDY.max_tokens) for p in prompts]
        assert got[2].num_cached_tokens >= len(prompts[2].input_ids) - 4
    finally:
        _stop(family)


def test_a_row_whose_draft_model_prefill_cannot_pay_skips_it_beside_one_that_drafts(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Adaptive: a long prompt asking for 2 tokens is admitted without the draft model (its prefill could not
    pay back, DraftPolicy.pays_prefill): nothing of the draft model's runs for its row, and every answer is
    the target's, beside a short prompt's row, forced or not to draft by the measured costs."""
    target, draft = _draft(tmp_path_factory, layers=1)
    family = _start(target, speculative=SpeculativeConfig(method="draft_model", model=str(draft)), prefix_cache=False)
    try:
        prompts = [family.prompt(" ".join([TEXT] * 24)), family.prompt(TEXT)]
        params = [dataclasses.replace(GREEDY, max_tokens=2), dataclasses.replace(GREEDY, max_tokens=24)]
        read = family.engine.loaded.drafter.prefilled

        async def together() -> list[list[int]]:
            return await asyncio.gather(*(family.tokens(f"p{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))))

        with _recording(family) as record:
            got = family.run(together())
        assert got == [family.reference(p, q.max_tokens) for p, q in zip(prompts, params)]
        drafts = {n.request_id: n.drafts for step in record.steps for n in step.plan.new}
        assert drafts["p0"] is False and len(prompts[0].input_ids) > 600
        assert family.engine.loaded.drafter.prefilled - read == (len(prompts[1].input_ids) if drafts["p1"] else 0)
    finally:
        _stop(family)


def test_a_restart_with_another_draft_model_drops_the_files_the_first_one_wrote(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Every file on the disk tier ends with its draft model's KV: a server restarted with the same draft model
    serves them; one started on the same directory with another (other shapes here) drops them (it failed its
    warm-up on them before)."""
    target, one = _draft(tmp_path_factory, layers=1)
    _, whole = _draft(tmp_path_factory)
    results = []
    for draft in (one, one, whole):
        family = _serve(target, draft, prefix_cache=True, prefix_cache_dir=str(tmp_path))
        try:
            first, second = _turn_two(family, "restart", TEXT, [])
            prompt = second if results else first  # the second turn extends the first's
            results.append(_outputs(family, f"r{len(results)}", prompt, GREEDY))
            assert results[-1].token_ids == family.reference(prompt, GREEDY.max_tokens)
        finally:
            _stop(family)
    assert [r.num_cached_tokens > 0 for r in results] == [False, True, False]


def test_a_draft_model_of_another_tokenizer_is_refused_at_load_in_one_line(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    small = Path(build_model("qwen2_5_vl", "small"))
    other = build_draft_model(small, tmp_path_factory.getbasetemp() / "qwen2_5_vl-small-draft", layers=1)
    target, _ = _draft(tmp_path_factory)
    with pytest.raises(ModelLoadError, match="does not share .* tokenizer: 768 tokens against its 4096") as caught:
        _serve(target, other)
    assert "\n" not in str(caught.value)


def test_a_draft_model_needs_its_model() -> None:
    with pytest.raises(ValueError, match='"draft_model" needs its drafter'):
        SpeculativeConfig(method="draft_model")


def test_a_draft_model_cut_from_a_smolvlm_llama_drafts_its_tokens_and_distills(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A SmolVLM's text model is a Llama whose tensors mlx-vlm does not nest under ``model.``: cut whole, the
    draft model loads in mlx-lm's layout and every draft of a text prompt is accepted. A one-layer cut goes
    through a step of distillation (vlmserve/testing/distill_draft.py, as benchmarks/spec_bench.py's
    SmolLM2 draft) and loads again."""
    import mlx_lm

    from vlmserve.testing.distill_draft import distill

    target = Path(build_model("smolvlm", "micro"))
    whole = build_draft_model(target, tmp_path_factory.getbasetemp() / "smolvlm-draft-all")
    family = _serve(target, whole)
    got: list[Any] = []
    try:
        prompt = family.prompt(TEXT)
        drafted, accepted = _accepted(family, lambda: got.append(_outputs(family, "s0", prompt, GREEDY)))
        assert got[0].token_ids == family.reference(prompt, GREEDY.max_tokens)
        assert drafted > 0 and accepted >= 0.95 * drafted, (drafted, accepted)
    finally:
        _stop(family)
    small = build_draft_model(target, tmp_path_factory.getbasetemp() / "smolvlm-draft-1", layers=1)
    info = distill(whole, small, minutes=0.0, batch_size=2, length=64)
    assert info["steps"] == 1 and 0.0 <= info["agreement_after"] <= 1.0
    assert len(mlx_lm.load(str(small))[0].model.layers) == 1
