"""The demo model: scene generator, training inputs, and the committed model as an oracle.

The committed model (vlmserve/assets/demo-gemma4) answers exactly, so these tests check the serving
path by its answers: the engine, batching or preprocessing corrupting anything changes them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import running_engine

from vlmserve.engine.params import SamplingParams
from vlmserve.testing.demo import DEMO_MODEL_DIR, demo_model_path
from vlmserve.testing.demo.commands import add_cli, format_scores
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
from vlmserve.testing.demo.evaluate import Reply, generate_reply, named_pairs
from vlmserve.testing.demo.placements import NEXT_ROW, SAME_ROW, sample_free_scene
from vlmserve.testing.demo.render import Style, render, sample_style, sample_varied_style
from vlmserve.testing.demo.scenes import (
    HELD_OUT_TRIPLES,
    Scene,
    Shape,
    colour_question,
    count_question,
    exists_question,
    grid_shape,
    relation,
    sample_scene,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
RED_CIRCLE = grid_shape("circle", "red", 1)
BLUE_SQUARE = grid_shape("square", "blue", 7)

# Grid scenes showing (shape, colour, cell) combinations training never saw: each has one.
HELD_OUT = [
    Scene((grid_shape("circle", "red", 0, 0.85),)),
    Scene((grid_shape("square", "green", 7), grid_shape("triangle", "blue", 3))),
    Scene((grid_shape("star", "purple", 5), grid_shape("circle", "yellow", 1, 0.7))),
    Scene((grid_shape("triangle", "yellow", 7, 0.7), grid_shape("square", "red", 2), grid_shape("star", "blue", 4, 0.65))),
    Scene((grid_shape("star", "red", 6), grid_shape("circle", "purple", 0), grid_shape("triangle", "green", 4))),
    Scene((grid_shape("square", "yellow", 2, 0.75), grid_shape("star", "green", 1, 0.9))),
]
# The two pictures in assets/, as the README's first command captions them.
ASSET_CAPTIONS = {
    "example.png": "A red circle, a blue triangle and a yellow star.",
    "example2.jpg": "A purple star above a green square.",
    "drawing.png": "A blue triangle.",  # drawn by hand, as in a paint program (drawings.hand_drawn)
}


# -- scenes --------------------------------------------------------------------------


def test_captions_of_constructed_scenes() -> None:
    assert Scene((RED_CIRCLE,)).caption == "A red circle."
    assert Scene((BLUE_SQUARE, RED_CIRCLE)).caption == "A red circle above a blue square."  # reading order
    left, right = grid_shape("star", "green", 3), grid_shape("square", "red", 5)
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
        Scene((grid_shape("circle", "red", 4), grid_shape("square", "blue", 4)))  # one place, two shapes
    with pytest.raises(ValueError):
        Scene((grid_shape("circle", "red", 1), grid_shape("circle", "blue", 4)))  # "the circle" would be ambiguous


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
    assert not {(s.kind, s.colour, s.region) for scene in train for s in scene.shapes} & HELD_OUT_TRIPLES
    # every (shape, colour) pair still trains, in the other cells
    assert len({(s.kind, s.colour) for scene in train for s in scene.shapes}) == 20


def test_shapes_stay_inside_their_cells() -> None:
    rng = np.random.default_rng(1)
    for shape in (s for scene in (sample_scene(rng) for _ in range(300)) for s in scene.shapes):
        row, column = divmod(shape.region, 3)
        half = shape.size / 2  # of the side; a cell is a third of it
        assert abs(shape.x - (column + 0.5) / 3) + half <= 1 / 6 and abs(shape.y - (row + 0.5) / 3) + half <= 1 / 6


def test_free_scene_captions_say_rows_then_left_to_right() -> None:
    top_right, low_left = Shape("star", "green", 0.8, 0.3, 0.2), Shape("circle", "red", 0.2, 0.75, 0.3)
    assert Scene((low_left, top_right)).caption == "A green star above a red circle."
    level = Shape("square", "blue", 0.5, 0.33, 0.15)  # 0.03 below the star: the same row
    assert Scene((top_right, level)).caption == "A blue square to the left of a green star."
    assert Scene((low_left, top_right, level)).caption == "A blue square, a green star and a red circle."
    with pytest.raises(ValueError):  # 0.15 apart: neither one row nor two
        Scene((top_right, Shape("square", "blue", 0.3, 0.45, 0.15)))


@pytest.mark.parametrize("aspect", [1.0, 0.5, 2.0])
def test_free_scenes_are_clear_inside_and_keep_the_held_out_regions(aspect: float) -> None:
    rng = np.random.default_rng(5)
    train = [sample_free_scene(rng, "train", aspect) for _ in range(300)]
    held = [sample_free_scene(rng, "held_out", aspect) for _ in range(50)]
    assert not any(s.held_out for s in train) and all(s.held_out for s in held)
    width, height = (aspect, 1.0) if aspect >= 1 else (1.0, 1 / aspect)
    sizes = []
    for scene in train:
        for a, b in itertools.combinations(scene.shapes, 2):
            assert abs(a.y - b.y) <= SAME_ROW or abs(a.y - b.y) >= NEXT_ROW - SAME_ROW
        for shape in scene.shapes:
            half = shape.size / 2
            assert half <= shape.x * width <= width - half and half <= shape.y * height <= height - half
            sizes.append(shape.size)
    assert min(sizes) < 0.2 and max(sizes) > 0.8  # small to filling the canvas
    assert len({len(scene.shapes) for scene in train}) == 3
    captions = " ".join(scene.caption for scene in train)
    assert "above" in captions and "to the left of" in captions


def test_varied_pictures_have_the_canvas_asked_for() -> None:
    rng = np.random.default_rng(2)
    for aspect in (0.5, 1.0, 2.2):
        scene = sample_free_scene(rng, "train", aspect)
        image = render(scene, sample_varied_style(rng, aspect))
        assert abs(image.width / image.height - aspect) < 0.02


def test_drawings_are_fixed_and_made_another_way() -> None:
    """The third evaluation set: the same 120 pictures every time, every shape in every colour."""
    from drawings import WEB_COLOURS, drawings

    first, again = drawings(), drawings()
    assert len(first) == 120
    assert [d.image.tobytes() for d in first[:5]] == [d.image.tobytes() for d in again[:5]]
    singles = [d for d in first if len(d.figures) == 1]
    assert len(singles) == 80 and len({d.named[0] for d in singles}) == 20
    for drawing in first:
        pixels = np.asarray(drawing.image, dtype=np.int32)
        for figure in drawing.figures:  # the figure is there, in one of its colour's shades, anti-aliased at its edge
            x, y, half = round(figure.cx), round(figure.cy), figure.size / 2
            assert half <= figure.cx <= drawing.image.width - half and half <= figure.cy <= drawing.image.height - half
            if not figure.line and figure.kind != "star":
                assert tuple(pixels[y, x]) in WEB_COLOURS[figure.colour]
    assert len({tuple(p) for p in np.asarray(first[0].image).reshape(-1, 3)}) > 2  # edges blend


def test_captions_are_scored_by_the_pairs_they_name() -> None:
    assert named_pairs("A red circle to the left of a blue square.") == [("blue", "square"), ("red", "circle")]
    assert named_pairs("A Red circle, a green star and a yellow triangle.") == [("green", "star"), ("red", "circle"), ("yellow", "triangle")]
    assert named_pairs("Hello! Show me a picture.") == []


def test_model_card_reports_each_set_against_its_target(tmp_path: Path) -> None:
    import json
    import shutil

    from vlmserve.testing.demo.card import write_model_card

    for name in ("model.safetensors", "training.json"):
        shutil.copy(demo_model_path() / name, tmp_path / name)
    info = json.loads((tmp_path / "training.json").read_text())
    groups = {"caption": {"n": 4, "accuracy": 1.0}, "free_caption": {"n": 4, "accuracy": 0.5}, "drawing": {"n": 120, "accuracy": 0.925}}
    scores = {"n_scenes": 4, "caption_exact_match": 1.0, "free_caption_exact_match": 0.5, "drawings_named": 0.925,
              "n_drawings": 120, "qa_accuracy": 1.0, "stopped_by_eos": 1.0, "groups": groups,
              "json_t0": 1.0, "json_t0.8": 0.9, "tools": 1.0}  # fmt: skip
    card = write_model_card(tmp_path, info, scores).read_text()
    assert "caption exact: **1.000** (target 0.95: met)" in card
    assert "caption exact: **0.500** (target 0.95: MISSED)" in card
    assert "named with its colour: **0.925** (target 0.90: met)" in card
    assert "JSON, valid and right, temperature 0.8: **0.900** (target 0.95: MISSED)" in card
    assert "tool calls and answers to their results: **1.000** (target 1.00: met)" in card
    card = write_model_card(tmp_path, info, {**scores, "n_drawings": 0, "drawings_named": 0.0}).read_text()
    assert "named with its colour" not in card  # not run: no tests/drawings.py in an installed wheel


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


def assert_captions(texts: list[str], scenes: list[Scene]) -> None:
    """Every caption names exactly its picture's shapes, and all but one are exact: the model card
    measures 0.90 exact on set 1, and this one misses a relation ("above" for "to the left of")."""
    assert [named_pairs(text) for text in texts] == [named_pairs(scene.caption) for scene in scenes], texts
    assert sum(text == scene.caption for text, scene in zip(texts, scenes)) >= len(scenes) - 1, texts


def test_each_image_gets_its_own_caption(demo: tuple[object, object]) -> None:
    """Same prompt, different held-out pictures, each its own right caption: the image reaches the model."""
    replies = [ask(demo, [image_message(CAPTION_PROMPTS[0])], [render(scene)]) for scene in HELD_OUT]
    assert_captions([r.text for r in replies], HELD_OUT)
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
    said = {q: ask(demo, [image_message(q)], [image]).text for q in asked}
    # the caption every answer about one shape starts with is right; the model card's QA score
    # (0.865: colour questions are its weakest group) allows one answer in five wrong
    assert all(text.startswith(seen) for q, text in said.items() if q != "How many shapes are there?"), said
    assert sum(said[q] == a for q, a in asked.items()) >= len(asked) - 1, said
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

    async def run() -> tuple[list[list[int]], list[list[int]], list[str]]:
        from conftest import collect

        async with running_engine(demo_model_path(), max_batch_size=8) as engine:
            alone = [(await collect(engine, f"a{i}", text, images, params)).token_ids for i, (text, images) in enumerate(requests)]
            together = await asyncio.gather(*[collect(engine, f"b{i}", t, imgs, params) for i, (t, imgs) in enumerate(requests)])
        assert all(r.finish_reason == "stop" for r in together)
        return alone, [r.token_ids for r in together], [r.text for r in together]

    alone, together, texts = asyncio.run(run())
    assert together == alone
    assert_captions(texts[: len(HELD_OUT)], HELD_OUT)
    assert texts[len(HELD_OUT) :] == [GREETING, "Three."]


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


def test_shapes_drawn_by_hand_are_named(demo: tuple[object, object]) -> None:
    """A shape traced with a round brush by a wobbly hand, filled or not, in each colour: what a
    newcomer draws in a paint program. Neither training's renderer nor set 3's routine."""
    from drawings import hand_drawn

    colours = {"red": (220, 30, 40), "green": (40, 160, 60), "blue": (40, 90, 220), "yellow": (240, 210, 30), "purple": (140, 50, 170)}
    cases = [(kind, colour, filled) for kind in ("circle", "square", "triangle", "star") for colour in colours for filled in (True, False)]
    said = [ask(demo, [image_message(CAPTION_PROMPTS[0])], [hand_drawn(kind, colours[colour], filled=filled, seed=1)]).text
            for kind, colour, filled in cases]  # fmt: skip
    right = [text == f"A {colour} {kind}." for text, (kind, colour, _) in zip(said, cases)]
    assert sum(right) >= 36, [(case, text) for case, text, ok in zip(cases, said, right) if not ok]  # 39 of 40 when trained


def test_same_seed_same_weights() -> None:
    from mlx.utils import tree_flatten

    from vlmserve.testing.demo.train import TrainConfig, Trainer

    def weights(seed: int) -> list[bytes]:
        config = TrainConfig(seed=seed, steps=2, batch_size=2, check_every=0, lone_steps=2, scene_steps=2, vision_batch=2)
        trainer = Trainer.create(config)
        trainer.warm_up_vision()
        trainer.run()
        return [bytes(memoryview(v)) for _, v in tree_flatten(trainer.model.parameters())]

    first = weights(1)
    assert first == weights(1)
    assert first != weights(2)


def test_eval_demo_reports_the_five_sets() -> None:
    result = subprocess.run([sys.executable, "-m", "vlmserve", "eval-demo", "--n", "4"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    for line in ("1 grid: caption exact", "2 free: caption exact", "3 drawings: named", "4 json_asked_schema_t0.8",
                 "4 json_no_image_t0 ", "5 tool_call", "5 tool_result"):  # fmt: skip
        assert line in result.stdout
    assert "   120 " in result.stdout.split("3 drawings: named")[1].splitlines()[0]


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
    assert "1 grid: caption exact" in table and "0.750" in table and "2 free" not in table
