"""The demo model: scene generator, training inputs, and the committed model as an oracle.

The committed model (vlmserve/assets/demo-gemma4) answers exactly, so these tests check the serving
path by its answers: the engine, batching or preprocessing corrupting anything changes them.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import running_engine

from vlmserve.engine.params import SamplingParams
from vlmserve.testing.demo import DEMO_MODEL_DIR, add_cli, demo_model_path
from vlmserve.testing.demo.commands import format_scores
from vlmserve.testing.demo.dialogues import (
    CAPTION_PROMPTS,
    GREETING,
    WEATHER_REQUESTS,
    WEATHER_TOOL,
    image_message,
    sample_chat,
    user,
    weather_call,
)  # fmt: skip
from vlmserve.testing.demo.evaluate import Reply, generate_reply
from vlmserve.testing.demo.render import Style, render, sample_style
from vlmserve.testing.demo.scenes import (
    HELD_OUT_TRIPLES,
    Scene,
    Shape,
    colour_question,
    count_question,
    exists_question,
    relation,
    sample_scene,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
RED_CIRCLE = Shape("circle", "red", cell=1)
BLUE_SQUARE = Shape("square", "blue", cell=7)

# Scenes showing (shape, colour, cell) combinations training never saw: each has one.
HELD_OUT = [
    Scene((Shape("circle", "red", 0, 0.85),)),
    Scene((Shape("square", "green", 7), Shape("triangle", "blue", 3))),
    Scene((Shape("star", "purple", 5), Shape("circle", "yellow", 1, 0.7))),
    Scene((Shape("triangle", "yellow", 7, 0.7), Shape("square", "red", 2), Shape("star", "blue", 4, 0.65))),
    Scene((Shape("star", "red", 6), Shape("circle", "purple", 0), Shape("triangle", "green", 4))),
    Scene((Shape("square", "yellow", 2, 0.75), Shape("star", "green", 1, 0.9))),
]
# The two pictures in assets/, as the README's first command captions them.
ASSET_CAPTIONS = {
    "example.png": "A red circle, a blue triangle and a yellow star.",
    "example2.jpg": "A purple star above a green square.",
}


# -- scenes --------------------------------------------------------------------------


def test_captions_of_constructed_scenes() -> None:
    assert Scene((RED_CIRCLE,)).caption == "A red circle."
    assert Scene((BLUE_SQUARE, RED_CIRCLE)).caption == "A red circle above a blue square."  # reading order
    left, right = Shape("star", "green", 3), Shape("square", "red", 5)
    assert Scene((right, left)).caption == "A green star to the left of a red square."
    assert [relation(left, right), relation(RED_CIRCLE, BLUE_SQUARE)] == ["to the left of", "above"]
    assert [s.caption for s in HELD_OUT] == [
        "A red circle.",
        "A blue triangle above a green square.",
        "A yellow circle above a purple star.",
        "A red square, a blue star and a yellow triangle.",
        "A purple circle, a green triangle and a red star.",
        "A green star to the left of a yellow square.",
    ]
    assert all(s.held_out for s in HELD_OUT)
    with pytest.raises(ValueError):
        Scene((Shape("circle", "red", 4), Shape("square", "blue", 4)))  # one cell, two shapes
    with pytest.raises(ValueError):
        Scene((Shape("circle", "red", 1), Shape("circle", "blue", 4)))  # "the circle" would be ambiguous


def test_questions_have_one_answer() -> None:
    scene = Scene((RED_CIRCLE, BLUE_SQUARE))
    assert count_question(scene).answer == "Two."
    seen = "A red circle above a blue square."
    assert colour_question(scene, "square").answer == f"{seen} The square is blue."
    assert [exists_question(scene, k).answer for k in ("circle", "star")] == [
        f"{seen} The circle is there.", f"{seen} The star is not there."
    ]


def test_generator_is_deterministic() -> None:
    def draw(seed: int) -> list[tuple[str, bytes]]:
        rng = np.random.default_rng(seed)
        return [(s.caption, render(s, sample_style(rng)).tobytes()) for s in (sample_scene(rng) for _ in range(5))]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_held_out_combinations_never_reach_training() -> None:
    rng = np.random.default_rng(0)
    train = [sample_scene(rng) for _ in range(500)]
    held = [sample_scene(rng, "held_out") for _ in range(100)]
    assert not any(s.held_out for s in train) and all(s.held_out for s in held)
    assert not {(s.kind, s.colour, s.cell) for scene in train for s in scene.shapes} & HELD_OUT_TRIPLES
    # every (shape, colour) pair still trains, in the other cells
    assert len({(s.kind, s.colour) for scene in train for s in scene.shapes}) == 20


def test_shapes_stay_inside_their_cells() -> None:
    rng = np.random.default_rng(1)
    for shape in (s for scene in (sample_scene(rng) for _ in range(300)) for s in scene.shapes):
        half = shape.size / 2
        assert abs(shape.dx) + half <= 0.5 and abs(shape.dy) + half <= 0.5


def test_rendering_draws_the_colours() -> None:
    pixels = np.asarray(render(Scene((RED_CIRCLE, BLUE_SQUARE)), Style(side=99)))
    assert tuple(pixels[16, 49]) == (220, 30, 30)  # the circle's centre: top row, middle column
    assert tuple(pixels[82, 49]) == (30, 60, 220)
    assert tuple(pixels[49, 49]) == tuple(pixels[2, 2]) == Style().background


# -- the committed model -------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[object, object]]:
    from vlmserve.engine.loader import load_model
    from vlmserve.engine.worker import MLXWorkerThread

    worker = MLXWorkerThread(name="mlx-test-demo")
    worker.start()
    try:
        yield worker, worker.call(load_model, str(demo_model_path()), "demo")
    finally:
        worker.shutdown()


def ask(demo: tuple[object, object], messages: list[dict], images: list = (), tools: list | None = None) -> Reply:
    worker, loaded = demo
    return worker.call(generate_reply, loaded, messages, list(images), tools)  # type: ignore[attr-defined]


def test_demo_model_is_committed_and_small() -> None:
    path = demo_model_path()
    assert path == DEMO_MODEL_DIR
    assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"} <= {p.name for p in path.iterdir()}
    assert (path / "model.safetensors").stat().st_size < 8_000_000


def test_each_image_gets_its_own_caption(demo: tuple[object, object]) -> None:
    """Same prompt, different held-out pictures, each its own right caption: the image reaches the model."""
    replies = [ask(demo, [image_message(CAPTION_PROMPTS[0])], [render(scene)]) for scene in HELD_OUT]
    assert [r.text for r in replies] == [scene.caption for scene in HELD_OUT]
    assert all(r.stopped for r in replies)  # each ended by EOS, well before max_tokens


def test_questions_about_an_image(demo: tuple[object, object]) -> None:
    image = render(HELD_OUT[3])
    seen = "A red square, a blue star and a yellow triangle."
    asked = {
        "How many shapes are there?": "Three.",
        "What colour is the star?": f"{seen} The star is blue.",
        "What colour is the triangle?": f"{seen} The triangle is yellow.",
        "Is there a square?": f"{seen} The square is there.",
        "Is there a circle?": f"{seen} The circle is not there.",
    }
    assert {q: ask(demo, [image_message(q)], [image]).text for q in asked} == asked
    assert ask(demo, [image_message("How many shapes are there?")], [render(HELD_OUT[0])]).text == "One."


def test_small_talk_ends_by_itself(demo: tuple[object, object]) -> None:
    reply = ask(demo, [user("Hello!")])
    assert reply.text == GREETING and reply.stopped


@pytest.mark.parametrize(("city", "unit"), [("Tokyo", "celsius"), ("Paris", "fahrenheit")])
def test_tool_request_gives_the_malformed_gemma4_call(demo: tuple[object, object], city: str, unit: str) -> None:
    reply = ask(demo, [user(WEATHER_REQUESTS[0].format(city=city, unit=unit))], tools=[WEATHER_TOOL])
    assert reply.text == weather_call(city, unit) == f"<|tool_call>call:get_weather{{location:'{city}',unit:'{unit}'}}<tool_call|>"
    assert reply.stopped


def test_batch_invariance_with_the_demo_model() -> None:
    """8 requests at once (images and text, different lengths) get exactly what each gets alone,
    and those are the right answers."""
    params = SamplingParams(max_tokens=40)
    requests = [(CAPTION_PROMPTS[0], [render(scene, Style(side=side))]) for scene, side in zip(HELD_OUT, (96, 144, 200, 224, 256, 120))]
    requests += [("Hello!", []), ("How many shapes are there?", [render(HELD_OUT[4])])]
    expected = [scene.caption for scene in HELD_OUT] + [GREETING, "Three."]

    async def run() -> tuple[list[list[int]], list[list[int]], list[str]]:
        from conftest import collect

        async with running_engine(demo_model_path(), max_batch_size=8) as engine:
            alone = [(await collect(engine, f"a{i}", text, images, params)).token_ids for i, (text, images) in enumerate(requests)]
            together = await asyncio.gather(*[collect(engine, f"b{i}", t, imgs, params) for i, (t, imgs) in enumerate(requests)])
        assert all(r.finish_reason == "stop" for r in together)
        return alone, [r.token_ids for r in together], [r.text for r in together]

    alone, together, texts = asyncio.run(run())
    assert together == alone
    assert texts == expected


def test_training_cannot_see_the_answer(demo: tuple[object, object]) -> None:
    """Text stays causal under Gemma 4's vision overlay: prompt states ignore the answer."""
    from vlmserve.testing.demo.batches import encode_chat

    worker, loaded = demo
    chats = [sample_chat(np.random.default_rng(seed)) for seed in range(40)]
    chat = next(c for c in chats if c.kind == "image")
    encoded = encode_chat(loaded.processor, chat)  # type: ignore[attr-defined]
    assert encoded.mm_token_type_ids is not None and not encoded.mm_token_type_ids[encoded.targets].any()
    first = encoded.targets[0]
    states = worker.call(_prompt_states, loaded, encoded, first)  # type: ignore[attr-defined]
    assert np.array_equal(states[0], states[1])


def _prompt_states(loaded: object, encoded: object, first: int) -> list[np.ndarray]:
    import mlx.core as mx

    from vlmserve.testing.demo.train import forward_hidden

    out = []
    for shift in (0, 7):
        ids = np.array(encoded.input_ids)  # type: ignore[attr-defined]
        ids[first:] = (ids[first:] + shift) % 4000 + 30  # a different answer, same prompt
        arrays = {"pixel_values": mx.array(encoded.pixel_values), "mm_token_type_ids": mx.array(encoded.mm_token_type_ids)[None]}  # type: ignore[attr-defined]
        hidden = forward_hidden(loaded.model, mx.array(ids)[None], arrays)  # type: ignore[attr-defined]
        out.append(np.array(hidden[0, :first].astype(mx.float32)))
    return out


# -- the README's first command, training and the command line ------------------------


@pytest.mark.parametrize("name", sorted(ASSET_CAPTIONS))
def test_default_caption_command_captions_the_assets(name: str) -> None:
    result = subprocess.run([sys.executable, "-m", "vlmserve", "caption", str(REPO / "assets" / name)],
                            capture_output=True, text=True, timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ASSET_CAPTIONS[name]


def test_same_seed_same_weights() -> None:
    from mlx.utils import tree_flatten

    from vlmserve.testing.demo.train import TrainConfig, Trainer

    def weights(seed: int) -> list[bytes]:
        config = TrainConfig(seed=seed, steps=2, batch_size=2, check_every=0, vision_warmup_steps=2, vision_warmup_batch=2)
        trainer = Trainer.create(config)
        trainer.warm_up_vision()
        trainer.run()
        return [bytes(memoryview(v)) for _, v in tree_flatten(trainer.model.parameters())]

    first = weights(1)
    assert first == weights(1)
    assert first != weights(2)


def test_cli_registers_both_commands() -> None:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["train-demo", "--out", "x", "--seed", "3", "--steps", "5"])
    assert (args.out, args.seed, args.steps, args.wants_openblas) == (Path("x"), 3, 5, True)
    args = parser.parse_args(["eval-demo", "--n", "4"])
    assert args.n == 4 and args.model is None
    table = format_scores({
        "n_scenes": 4, "caption_exact_match": 1.0, "qa_accuracy": 0.75, "stopped_by_eos": 1.0,
        "groups": {"caption": {"n": 4, "accuracy": 1.0}, "qa_count": {"n": 4, "accuracy": 0.75}},
    })  # fmt: skip
    assert "caption exact match" in table and "0.750" in table
