"""GLM-4.1V / GLM-4.5V's adapter: each request's M-RoPE positions are its own, whatever the model object keeps.

mlx-vlm's GLM keeps the last image prompt's positions and delta on the language model (issue 56: a
text request after an image one, and batched rows, read another prompt's). The adapter computes them
per prompt; here the model's kept state is set to nonsense and every answer is still mlx-vlm's own.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import scene
from test_families import Family, _start, _stop

from vlmserve.testing import build_model


@pytest.fixture(scope="module", params=["glm4v", "glm4v_moe"])
def family(request: pytest.FixtureRequest) -> Any:
    started = _start(build_model(request.param, "micro"))
    yield started
    _stop(started)


def _spoil(model: Any) -> None:
    """What a previous request could have left on the language model: a delta and positions of its own."""
    import mlx.core as mx

    model.language_model._rope_deltas = mx.array([[-999]], dtype=mx.int32)
    model.language_model._position_ids = mx.zeros((3, 1, 4096), dtype=mx.int32)


def test_answers_ignore_the_positions_the_model_kept(family: Family) -> None:
    red = scene("circle", (220, 30, 30))
    prompts = [family.prompt("describe it", [red]), family.prompt("hello there"), family.prompt("what now?", [red])]
    want = [family.reference(p) for p in prompts]
    got = []
    for i, prompt in enumerate(prompts):
        family.engine.worker.call(_spoil, family.engine.loaded.model)
        got.append(family.run(family.tokens(f"s{i}", prompt)))
    assert got == want


def test_an_image_prompts_delta_comes_from_its_own_grid(family: Family) -> None:
    """The delta decode adds is what mlx-vlm's get_rope_index gives for this prompt (negative: an image's
    tokens advance positions by its grid's side, not by their count); a text prompt's is 0."""
    red = scene("circle", (220, 30, 30))
    adapter = family.engine.loaded.adapter

    def delta(prompt: Any) -> int:
        import mlx.core as mx

        embedded = adapter.embed(mx.array(prompt.input_ids)[None], {k: mx.array(v) for k, v in prompt.arrays.items()})
        return int(embedded.row_state["rope_deltas"].item())

    assert family.engine.worker.call(delta, family.prompt("describe it", [red])) < 0
    assert family.engine.worker.call(delta, family.prompt("hello there")) == 0


def test_a_video_is_refused_rather_than_sent_as_smolvlm2s_frames(family: Family) -> None:
    """mlx-vlm's GLM processor has no video processor: a video is refused, never laid out as SmolVLM2's
    time-stamped frames (which a processor with a video token and no video processor otherwise gets)."""
    assert family.engine.prompter.video_sampling is None and not family.engine.prompter.video_frames
    assert "does not take video" in (family.engine.media_refusal(0, 1) or "")
