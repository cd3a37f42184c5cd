"""DFlash drafters (engine/dflash.py, ``{"method": "dflash", "model": DIR}``): a block of drafts in one forward
from several target layers' hidden states, in the continuous batch. Drafting on every step (``adaptive:
false``), every request gives the target's own greedy tokens (mlx-vlm's ``generate_step`` alone), beside rows
that do not draft, with logprobs, a grammar and seeded sampling; and the drafter drafts what mlx-vlm's own
DFlash class drafts for each prompt alone, given the same context. The test drafter is mlx-vlm's class with
random weights (vlmserve/testing/qwen3_5.py ``build_dflash``): few drafts are accepted, so a prediction
that is right stands in for accepted ones where a test needs verifies that keep several tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_engine_speculative import Drafts, agree, batched_drafts, greedy_alone_and_batched, sampling_kept
from test_families import Family, _start, _stop

from vlmserve.engine.loader import ModelLoadError
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.testing import build_model

GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
TEXT = "one two three four, one two three four, say it again: one two three four"
PLAIN = {"presence_penalty": 1e-9}  # a row with a penalty never drafts (and this one changes no token)


def _drafter(tmp_path_factory: pytest.TempPathFactory, target: Path) -> Path:
    from vlmserve.testing.qwen3_5 import build_dflash
    return build_dflash(target, tmp_path_factory.getbasetemp() / "qwen3_5-dflash")


@pytest.fixture(scope="module")
def dflash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """Qwen3.5 with a DFlash drafter that drafts on every step, whatever it costs."""
    target = build_model("qwen3_5", "micro")
    config = SpeculativeConfig(method="dflash", model=str(_drafter(tmp_path_factory, target)), adaptive=False)
    started = _start(target, speculative=config, prefix_cache=False)
    yield started
    _stop(started)



def test_dflash_gives_the_targets_greedy_tokens_alone_and_batched_beside_rows_that_do_not_draft(
        dflash: Family) -> None:
    greedy_alone_and_batched(dflash, "d")


def test_dflash_rows_keep_the_targets_logprobs_grammar_seeded_samples_and_min_tokens(dflash: Family) -> None:
    sampling_kept(dflash, "d")


def test_the_dflash_drafter_drafts_what_mlx_vlms_class_drafts_over_the_whole_context(dflash: Family) -> None:
    """Two prompts in one batch, and a third whose first verifies keep several tokens (a right prediction),
    draft at every step what mlx-vlm's ``DFlashDraftModel.draft_block`` drafts for each prompt alone: given
    every prompt position's states (``capture_layer_ids``), then each token the target decodes, a block of the
    drafter's ``block_size`` each time (mlx-vlm's own loop narrows it as acceptance falls)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.speculative.drafters import load_drafter

    engine = dflash.engine
    params = dataclasses.replace(GREEDY, max_tokens=16)
    prompts = [dflash.prompt(TEXT), dflash.prompt("hi"), dflash.prompt("say it: " + TEXT)]
    theirs: Drafts = {}

    def reference(which: int) -> None:
        assert engine.config.speculative is not None
        model, _ = load_drafter(engine.config.speculative.model, "dflash")
        target = engine.loaded.model
        lm, layers = target.language_model, list(model.config.target_layer_ids)
        cache, context, block = make_prompt_cache(lm), model.reset(target), int(model.config.block_size)
        ids = mx.array(prompts[which].input_ids, dtype=mx.int32)[None]
        position = ids.shape[1]
        out = lm(ids, cache=cache, capture_layer_ids=layers)
        for _ in range(params.max_tokens - 1):
            token = int(mx.argmax(out.logits[0, -1]).item())
            hidden = mx.concatenate(out.hidden_states, axis=-1)
            drafts = model.draft_block(token, hidden, context, block, lambda x: mx.argmax(x, axis=-1))
            theirs[(which, position, token)] = drafts[0].tolist()
            out = lm(mx.array([[token]]), cache=cache, capture_layer_ids=layers)
            position += 1

    for which in range(len(prompts)):
        engine.worker.call(reference, which)
    # a block as wide as the drafter's trained one, both ways: ours keeps its first k
    agree(batched_drafts(dflash, prompts, params, "dq"), theirs, prompts)


def test_mlx_vlms_own_dflash_loop_gives_the_same_tokens(dflash: Family) -> None:
    """mlx-vlm's DFlash round loop (``generate_step`` with the drafter), on our prompt ids, gives the target's
    greedy tokens too: where both loops are right, they agree."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    engine = dflash.engine
    prompts = [dflash.prompt(TEXT), dflash.prompt("hi")]

    def theirs(ids: list[int]) -> list[int]:
        assert engine.config.speculative is not None
        model, _ = load_drafter(engine.config.speculative.model, "dflash")
        target = engine.loaded.model
        target.language_model._position_ids = target.language_model._rope_deltas = None
        prompt = mx.array(ids, dtype=mx.int32)[None]
        steps = generate_step(prompt, target, None, mx.ones(prompt.shape, dtype=mx.int32),
                              max_tokens=GREEDY.max_tokens, temperature=0.0, draft_model=model, draft_kind="dflash")
        return [int(token) for token, _ in steps][:GREEDY.max_tokens]

    for i, prompt in enumerate(prompts):
        ours = dflash.run(dflash.tokens(f"dr{i}", prompt, GREEDY))
        assert engine.worker.call(theirs, list(prompt.input_ids)) == ours == dflash.reference(prompt, GREEDY.max_tokens)


@pytest.mark.parametrize(("which", "says"), [("gemma4", "drafts for qwen3_5, not gemma4"),
                                             ("mtp", "this server runs gemma4_assistant, qwen3_5_mtp drafters")])
def test_a_dflash_drafter_that_cannot_serve_is_refused_at_load_in_one_line(
        which: str, says: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    qwen = build_model("qwen3_5", "micro")
    drafter = str(_drafter(tmp_path_factory, qwen))
    target, config = ((build_model("gemma4", "micro"), SpeculativeConfig(method="dflash", model=drafter))
                      if which == "gemma4" else (qwen, SpeculativeConfig(method="mtp", model=drafter)))
    with pytest.raises(ModelLoadError, match=says) as caught:
        _start(target, speculative=config)
    assert "\n" not in str(caught.value)


def test_dflash_needs_its_drafter() -> None:
    with pytest.raises(ValueError, match='"dflash" needs its drafter'):
        SpeculativeConfig(method="dflash")


def test_a_dflash_drafter_reading_gemma4s_kv_sharing_layers_is_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 4 E2B/E4B's last layers read earlier layers' KV and compute a prompt's last position only: a
    drafter that reads them would get one position of a prompt's states (it failed warm-up)."""
    from vlmserve.testing.qwen3_5 import build_dflash

    target = build_model("gemma4", "micro", variant="e2b")
    drafter = build_dflash(target, tmp_path_factory.getbasetemp() / "gemma4-e2b-dflash")
    with pytest.raises(ModelLoadError, match="share earlier layers' KV") as caught:
        _start(target, speculative=SpeculativeConfig(method="dflash", model=str(drafter), adaptive=False))
    assert "\n" not in str(caught.value)
