"""The demo model's trained drafters (vlmserve/testing/demo/drafter.py: mtp, drafter_dflash.py, drafter_eagle3.py):
briefly trained, each is saved in mlx-vlm's layout, loads through vlmserve's loader and serves exactly (greedy
equal to the target alone, alone and batched) with drafting forced on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import scene
from test_families import Family, _start, _stop

from vlmserve.config import DEMO_MODEL_DIR
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig

STEPS = 2  # a few steps: the weights move off their start, and a test stays short


def _train(kind: str, out: Path) -> dict[str, Any]:
    from vlmserve.testing.demo.drafter import train_drafter
    from vlmserve.testing.demo.drafter_dflash import train_dflash_drafter
    from vlmserve.testing.demo.drafter_eagle3 import train_eagle3_drafter

    trainer = {"mtp": train_drafter, "dflash": train_dflash_drafter, "eagle3": train_eagle3_drafter}[kind]
    return trainer(DEMO_MODEL_DIR, out, steps=STEPS, batch_size=4, scored=1)


@pytest.fixture(scope="module", params=["mtp", "dflash", "eagle3"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Family]]:
    """A briefly trained drafter of ``request.param``'s kind, and the demo model serving with it, forced on."""
    out = tmp_path_factory.mktemp("drafters") / request.param
    info = _train(request.param, out)
    assert info["kind"] == request.param and info["steps"] == STEPS
    assert len(info["held_out_accuracy_per_depth"]) == 4
    config = SpeculativeConfig(method=request.param, model=str(out), adaptive=False)
    started = _start(DEMO_MODEL_DIR, speculative=config)
    yield out, started
    _stop(started)


def test_a_trained_drafter_is_saved_in_mlx_vlms_layout(trained: tuple[Path, Family]) -> None:
    import mlx.core as mx
    from mlx_vlm.speculative.drafters import load_drafter

    out, _ = trained
    kind = out.name
    model, loaded_kind = load_drafter(str(out), kind)
    assert loaded_kind == kind
    weights = mx.load(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if kind == "mtp":  # a Gemma 4 assistant: its own copy of the target's embedding, its head tied to it
        assert type(model).__name__ == "Gemma4AssistantDraftModel" and "model.embed_tokens.weight" in weights
    elif kind == "dflash":  # DFlash reads the target's embedding and head: not stored
        assert type(model).__name__ == "Gemma4DFlashDraftModel" and config["block_size"] == 8
        assert not any(k.startswith("embed_tokens") for k in weights)
    else:  # the speculators' hot vocabulary: d2t maps each hot id to the target's
        assert type(model).__name__ == "Eagle3DraftModel"
        hot = config["draft_vocab_size"]
        assert weights["d2t"].shape == (hot,) and weights["lm_head.weight"].shape[0] == hot
        target = (mx.arange(hot) + weights["d2t"]).tolist()
        assert target == sorted(set(target)) and max(target) < config["transformer_layer_config"]["vocab_size"]


def test_a_trained_drafter_serves_the_targets_greedy_tokens_alone_and_batched(trained: tuple[Path, Family]) -> None:
    """Greedy equal to the target alone for a caption, JSON and a short text, alone and six at once; it drafted.
    (test_engine_speculative's helper counts drafts for an untrained drafter: a trained one needs fewer steps.)"""
    _, family = trained
    red = scene("circle", (220, 30, 30))
    prompts = [family.prompt("Describe this image.", [red]), family.prompt("Return the shapes as JSON.", [red]),
               family.prompt("hi")]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [family.reference(p, params.max_tokens) for p in prompts]
    before = family.engine.metrics

    async def together() -> list[list[int]]:
        return await asyncio.gather(*(family.tokens(f"b{i}", prompts[i % 3], params) for i in range(6)))

    assert [family.run(family.tokens(f"a{i}", p, params)) for i, p in enumerate(prompts)] == want
    assert family.run(together()) == [want[i % 3] for i in range(6)]
    after = family.engine.metrics
    assert before is not None and after is not None and after.spec_drafts > before.spec_drafts
