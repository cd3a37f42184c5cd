"""EAGLE-3 drafters (engine/eagle3.py, ``{"method": "eagle3", "model": DIR}``): a decoder layer of their own fed
with three target layers' hidden states, a hot vocabulary smaller than the target's, in the continuous batch.
Drafting on every step (``adaptive: false``), every request gives the target's own greedy tokens (mlx-vlm's
``generate_step`` alone), beside rows that do not draft, with logprobs, a grammar and seeded sampling; the
drafter drafts what mlx-vlm's own ``Eagle3DraftModel`` drafts for each prompt alone, given the same context;
and its state stored with a cached prefix drafts as a cold prefill does. The target is the micro Gemma 4's e2b
variant (six layers; the plain micro build has two, and the drafter reads three different ones). The test
drafter is mlx-vlm's class with random weights (vlmserve/testing/eagle3.py): few drafts are accepted, so a
prediction that is right stands in for accepted ones where a test needs verifies that keep several tokens.

mlx-vlm's own EAGLE-3 loop is not the reference for the tokens: its verify scores only the drafter's hot
vocabulary (and EOS) where a draft is checked, so it accepts a draft the target would not have made wherever
the target's own best token is outside that vocabulary (``test_mlx_vlms_hot_verify_...`` shows one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_engine_speculative import _outputs, agree, batched_drafts, greedy_alone_and_batched, sampling_kept
from test_families import Family, _start, _stop

from vlmserve.engine.loader import ModelLoadError
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.testing import build_model

GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
TEXT = "one two three four, one two three four, say it again: one two three four"
PLAIN = {"presence_penalty": 1e-9}  # a row with a penalty never drafts (and this one changes no token)


def target() -> Path:
    return Path(build_model("gemma4", "micro", variant="e2b"))


def drafter(tmp_path_factory: pytest.TempPathFactory, path: Path) -> Path:
    from vlmserve.testing.eagle3 import build_eagle3
    return build_eagle3(path, tmp_path_factory.getbasetemp() / f"{path.name}-eagle3")


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """Gemma 4 with an EAGLE-3 drafter that drafts on every step, whatever it costs."""
    config = SpeculativeConfig(method="eagle3", model=str(drafter(tmp_path_factory, target())), adaptive=False)
    started = _start(target(), speculative=config, prefix_cache=False)
    yield started
    _stop(started)



def test_eagle3_gives_the_targets_greedy_tokens_alone_and_batched_beside_rows_that_do_not_draft(
        eagle3: Family) -> None:
    greedy_alone_and_batched(eagle3, "e")


def test_eagle3_rows_keep_the_targets_logprobs_grammar_seeded_samples_and_min_tokens(eagle3: Family) -> None:
    sampling_kept(eagle3, "e")


def _their_drafts(family: Family, prompt: Any, which: int, steps: int, k: int) -> dict[tuple[int, int, int], list[int]]:
    """mlx-vlm's ``Eagle3DraftModel`` over one prompt alone, on the worker: its prompt prefill from the chosen
    layers' states, then at each token the target decodes its ``k`` drafts (``draft_block``), keyed by (prompt,
    position, input token), and the token with the target's states into its KV (``accept_verified_tokens``)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.speculative.drafters import load_drafter

    def greedy(x: mx.array) -> mx.array:
        return mx.argmax(x, axis=-1)

    def run() -> dict[tuple[int, int, int], list[int]]:
        assert family.engine.config.speculative is not None
        model, _ = load_drafter(family.engine.config.speculative.model, "eagle3")
        full = family.engine.loaded.model
        lm, layers = full.language_model, list(model.config.capture_layer_ids)
        cache, theirs = make_prompt_cache(lm), {}
        model.reset(full)
        ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
        position, out = ids.shape[1], lm(ids, cache=cache, capture_layer_ids=layers)
        token = int(mx.argmax(out.logits[0, -1]).item())
        model.prefill_from_target_hidden(ids, mx.concatenate(out.hidden_states, axis=-1), token, greedy, greedy=True)
        for _ in range(steps - 1):
            drafts = model.draft_block(token, None, None, k + 1, greedy, greedy=True)
            theirs[(which, position, token)] = drafts[0].tolist()
            out = lm(mx.array([[token]]), cache=cache, capture_layer_ids=layers)
            token, position = int(mx.argmax(out.logits[0, -1]).item()), position + 1
            model.accept_verified_tokens(mx.concatenate(out.hidden_states, axis=-1), drafts, 0, [token], greedy,
                                         greedy=True)
        return theirs

    return family.engine.worker.call(run)


def test_the_eagle3_drafter_drafts_what_mlx_vlms_class_drafts_over_the_whole_context(eagle3: Family) -> None:
    """Two prompts in one batch, and a third whose first verifies keep several tokens (a right prediction),
    draft at every step what mlx-vlm's ``Eagle3DraftModel`` drafts for each prompt alone (its ``draft_block``
    chains the drafter's own outputs, and the hot vocabulary maps to the target's ids through ``d2t``)."""
    params = dataclasses.replace(GREEDY, max_tokens=16)
    spec = eagle3.engine.config.speculative
    assert spec is not None
    prompts = [eagle3.prompt(TEXT), eagle3.prompt("hi"), eagle3.prompt("say it: " + TEXT)]
    theirs: dict[tuple[int, int, int], list[int]] = {}
    for which, prompt in enumerate(prompts):
        theirs.update(_their_drafts(eagle3, prompt, which, params.max_tokens, spec.num_speculative_tokens))
    ours = batched_drafts(eagle3, prompts, params, "eq")
    agree(ours, theirs, prompts)  # a batch drafts as many as its widest row may keep: the first ones agree
    hot = {t for d in ours.values() for t in d}
    assert len(hot) > 5  # drafts of many tokens, each a target id the hot vocabulary maps to


def test_mlx_vlms_hot_verify_accepts_a_draft_the_target_would_not_make(eagle3: Family) -> None:
    """Where the target's greedy token is outside the drafter's hot vocabulary, mlx-vlm's EAGLE-3 verify
    (``_eagle3_verify_target_hot``: the target's head over the hot ids and EOS only) takes the best hot token
    for the target's: a draft of it is accepted, and its loop's output leaves the target's. Ours verifies over
    the whole vocabulary: the same draft, as a prediction, is refused, and the output is the target's."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.speculative.eagle3 import _eagle3_hot_token_ids, _eagle3_verify_target_hot

    prompt = eagle3.prompt(TEXT)
    want = eagle3.reference(prompt, 30)

    def theirs() -> tuple[int, int, int] | None:
        """The first position whose greedy token is not hot, the best hot token there, and what mlx-vlm's
        verify of a draft of that token says the target makes there."""
        import copy

        from mlx_vlm.speculative.drafters import load_drafter

        assert eagle3.engine.config.speculative is not None
        model, _ = load_drafter(eagle3.engine.config.speculative.model, "eagle3")
        lm = eagle3.engine.loaded.model.language_model
        hot = mx.array(sorted(set(_eagle3_hot_token_ids(lm, model, []).tolist())))
        at = next((i for i in range(1, len(want)) if want[i] not in set(hot.tolist())), None)
        if at is None:
            return None
        cache = make_prompt_cache(lm)
        lm(mx.array([[*prompt.input_ids, *want[:at - 1]]], dtype=mx.int32), cache=cache)
        logits = lm(mx.array([[want[at - 1]]]), cache=copy.deepcopy(cache)).logits[0, -1]
        guess = int(hot[mx.argmax(logits[hot])].item())
        _, verified, _ = _eagle3_verify_target_hot(lm, model, mx.array([[want[at - 1], guess]]), cache,
                                                   lambda x: mx.argmax(x, axis=-1),
                                                   list(model.config.capture_layer_ids), [])
        return at, guess, int(verified[0, 0].item())

    found = eagle3.engine.worker.call(theirs)
    assert found is not None, "every greedy token is in the hot vocabulary: pick another prompt"
    at, guess, verified = found
    assert guess != want[at] and verified == guess  # mlx-vlm's verify says the target makes the draft
    params = SamplingParams(max_tokens=30, ignore_eos=True, prediction=(*want[:at], guess))
    assert _outputs(eagle3, "eh0", prompt, params).token_ids == want  # ours refuses it


@pytest.mark.parametrize(("arch", "says"), [("qwen3_5", "drafts for gemma4, not qwen3_5"),
                                            ("gemma4", "the target's first 2 are needed")])
def test_an_eagle3_drafter_that_cannot_serve_is_refused_at_load_in_one_line(
        arch: str, says: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    config = SpeculativeConfig(method="eagle3", model=str(drafter(tmp_path_factory, target())))
    with pytest.raises(ModelLoadError, match=says) as caught:
        _start(build_model(arch, "micro"), speculative=config)
    assert "\n" not in str(caught.value)


def test_eagle3_needs_its_drafter() -> None:
    with pytest.raises(ValueError, match='"eagle3" needs its drafter'):
        SpeculativeConfig(method="eagle3")


def test_a_reused_prefix_brings_the_drafters_state_from_memory_and_from_disk(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A second turn reuses its first turn's KV with the drafter's state (engine/mtp_prefix.py), from memory and
    from disk after a restart: the target's tokens, and it drafts from the first step. Gemma 4 reuses the stored
    first prompt cut back before its generation prompt, so the prefix's last position has no entry (its target
    state waited for the next token, and is the old last one's): the drafts after the hit may differ from a
    cold prefill's there, never the output."""
    from test_engine_mtp_prefix import ASKED, _turn
    from test_engine_spec_batch import WHOLE, _check, _result, _turn_two

    config = SpeculativeConfig(method="eagle3", model=str(drafter(tmp_path_factory, target())), adaptive=False)
    settings = {"prefix_cache_dir": str(tmp_path), **WHOLE}
    for restart in (False, True):
        family = _start(target(), speculative=config, **settings)
        try:
            if not restart:
                first, second = _turn_two(family, "remember", TEXT, [])
                family.run(_result(family, "first", first, GREEDY))
            result, record, _, _ = _turn(family, "warm", second)
            _check(family, [second], [ASKED], [result])
            disk = family.run(family.engine.stats()).disk
        finally:
            _stop(family)
        assert disk is not None and (disk.hits >= 1) == restart
        assert result.num_cached_tokens >= len(first) - 4
        assert len(record.drafts["warm"]) >= ASKED.max_tokens - 2
        # the drafter's entries for the row as it joined: every prompt position but the gap (the first token's
        # pair too), not only those after the reused prefix
        assert record.kv["warm"].shape[2] >= result.num_prompt_tokens - 1, record.kv["warm"].shape
