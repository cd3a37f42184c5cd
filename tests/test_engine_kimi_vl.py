"""Kimi-VL: the prompt is the chat template's, not mlx-vlm's, and the answer on it is mlx-vlm's own decode;
``_grid_shapes`` (which mlx-vlm's processor returns and the prompt builder drops) changes nothing the tower
computes; routed experts stay each token's own in a batch."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import scene
from test_families import Family, _start, _stop

from vlmserve.testing import build_model


@pytest.fixture(scope="module")
def family() -> Any:
    started = _start(build_model("kimi_vl", "micro"))
    yield started
    _stop(started)


def test_the_template_puts_the_image_where_the_user_did_and_mlx_vlm_puts_it_after_the_text(family: Family) -> None:
    """Issue 56: mlx-vlm's prompt path writes the text, then ``<|media_start|>``; the checkpoint's template
    writes the parts in the user's order. Served on the template's ids, the answer is mlx-vlm's decode."""
    from vlmserve.engine.oracle import mlx_vlm_prompt

    red = scene("circle", (220, 30, 30))
    tokenizer = family.engine.loaded.processor.tokenizer
    ours = family.prompt("describe it", [red])
    theirs = family.engine.worker.call(mlx_vlm_prompt, family.engine.loaded, "describe it", [red])
    our_text, their_text = tokenizer.decode(ours.input_ids), tokenizer.decode(theirs)
    assert our_text.index("<|media_start|>") < our_text.index("describe it")  # the image first, then the words
    assert their_text.index("describe it") < their_text.index("<|media_start|>")  # mlx-vlm's: the words first
    assert family.run(family.tokens("t", ours)) == family.reference(ours)


def test_grid_shapes_change_nothing_the_tower_computes(family: Family) -> None:
    """mlx-vlm's processor also returns ``_grid_shapes`` (``image_grid_hws`` as Python tuples); the vision
    tower reads the same grid from ``image_grid_hws`` without it: the embeddings are the same, bitwise."""
    import mlx.core as mx

    from vlmserve.engine.runner import on_device

    prompt = family.prompt("two", [scene("circle", (220, 30, 30)), scene("square", (30, 60, 220), size=80)])

    def embeddings() -> bool:
        arrays = on_device(prompt.arrays)
        pixels = arrays.pop("pixel_values")
        ids = mx.array(prompt.input_ids)[None]
        shapes = [tuple(int(v) for v in row) for row in arrays["image_grid_hws"].tolist()]
        model = family.engine.loaded.model
        without = model.get_input_embeddings(ids, pixels, **arrays).inputs_embeds
        with_shapes = model.get_input_embeddings(ids, pixels, _grid_shapes=shapes, **arrays).inputs_embeds
        return bool(mx.array_equal(without, with_shapes).item())

    assert "_grid_shapes" not in prompt.arrays
    assert family.engine.worker.call(embeddings)


def test_routed_experts_differ_between_tokens(family: Family) -> None:
    """The micro model's router is random, not mlx-vlm's zero start: tokens take different experts, so the
    batch-invariance tests exercise per-token routing."""
    import mlx.core as mx

    def chosen() -> int:
        model = family.engine.loaded.model
        moe = model.language_model.model.layers[1].mlp
        x = model.language_model.model.embed_tokens(mx.arange(64)[None])
        inds, _ = moe.gate(x)
        return len({tuple(sorted(row)) for row in inds[0].tolist()})

    assert family.engine.worker.call(chosen) > 3
