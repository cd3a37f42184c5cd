"""[main] Held-out evaluation of the demo model through the serving path.

The model is loaded by ``vlmserve.engine.loader.load_model`` on an ``MLXWorkerThread`` and every
answer is decoded greedily by ``generate_tokens`` on a ``ModelRunner``, as ``vlmserve caption``
does. Three held-out sets:

1. grid scenes in the classic look, each showing a (shape, colour, cell) combination training
   never saw: a caption and a question each;
2. free-position scenes in the varied look on canvases of any aspect ratio, each showing a
   (shape, colour) pair with its centre in the one region training never put it: a caption each;
3. drawings made by another routine than training's (``tests/drawings.py``, numpy geometry
   instead of Pillow, web colours): is every shape named with its colour, and nothing else?
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.testing.demo.dialogues import (
    CAPTION_PROMPTS,
    CITIES,
    END_OF_TURN,
    GREETING,
    NO_IMAGE_PROMPTS,
    UNITS,
    WEATHER_REQUESTS,
    WEATHER_TOOL,
    image_message,
    question_text,
    user,
    weather_answer,
    weather_call,
    weather_exchange,
)  # fmt: skip
from vlmserve.testing.demo.json_answers import (
    JSON_PROMPTS,
    SCENE_SCHEMA,
    SHAPE_SCHEMA,
    dumps,
    parse_object,
    scene_object,
    sensible,
)
from vlmserve.testing.demo.placements import sample_aspect, sample_free_scene
from vlmserve.testing.demo.render import render, sample_style, sample_varied_style
from vlmserve.testing.demo.scenes import COLOURS, SHAPES, Scene, sample_question, sample_scene

DEFAULT_EVAL_N = 200
MAX_TOKENS = 48  # longer than any answer the model was taught
JSON_MAX_TOKENS = 128  # set 4's bound
DRAWINGS = Path(__file__).resolve().parents[3] / "tests" / "drawings.py"  # in a checkout of the repository
PHRASE = re.compile(rf"\b({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Reply:
    """One greedy answer; ``stopped`` means it ended by EOS before ``max_tokens``."""

    text: str
    token_ids: list[int]
    stopped: bool


def generate_reply(
    loaded: Any,
    messages: Sequence[dict[str, Any]],
    images: Sequence[Image.Image] = (),
    tools: Sequence[dict[str, Any]] | None = None,
    max_tokens: int = MAX_TOKENS,
    params: Any = None,
) -> Reply:
    """Greedy answer (or as ``params`` sample) on the calling thread, which must be the one that
    owns ``loaded``."""
    from vlmserve.engine.generate import generate_tokens
    from vlmserve.engine.params import SamplingParams
    from vlmserve.engine.runner import ModelRunner
    from vlmserve.preprocess.prompt import build_prompt

    params = params or SamplingParams(max_tokens=max_tokens)
    prompt = build_prompt(loaded.processor, messages, images, tools)
    ids = list(generate_tokens(ModelRunner(loaded), prompt, params))
    return Reply(loaded.tokenizer.decode(ids, skip_special_tokens=False), ids, len(ids) < params.max_tokens)


@dataclass(frozen=True, slots=True)
class Case:
    """One evaluation prompt and what a right answer is.

    ``check``: ``exact`` (the text, stripped), ``named`` (drawings: every (colour, shape) pair in
    ``named`` and no other), ``json`` (an object equal to ``expected`` parsed) or ``sensible`` (an
    object that fits ``schema`` with words the model knows: no picture to be right about).
    ``schema`` with ``constrained`` is also sent as ``response_format``; ``temperature`` > 0
    samples with the case's own seed.
    """

    group: str
    messages: tuple[dict[str, Any], ...]
    expected: str
    images: tuple[Image.Image, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    named: tuple[tuple[str, str], ...] = ()
    check: str = "exact"
    schema: dict[str, Any] | None = None
    constrained: bool = False
    temperature: float = 0.0
    seed: int = 0

    def right(self, text: str) -> bool:
        if self.check == "named":
            return named_pairs(text) == sorted(self.named)
        if self.check == "json":
            return parse_object(text.removesuffix(END_OF_TURN)) == json.loads(self.expected)
        if self.check == "sensible":
            value = parse_object(text.removesuffix(END_OF_TURN))
            return value is not None and self.schema is not None and sensible(value, self.schema)
        return text.strip() == self.expected


def named_pairs(caption: str) -> list[tuple[str, str]]:
    """The (colour, shape) pairs a caption names, sorted."""
    return sorted((colour.lower(), shape.lower()) for colour, shape in PHRASE.findall(caption))


def held_out_scenes(n: int, seed: int = 0) -> list[tuple[Scene, Image.Image]]:
    """``n`` held-out scenes and their images, reproducible; no training seed draws this stream."""
    rng = np.random.default_rng([seed, 7919])
    scenes = [sample_scene(rng, "held_out") for _ in range(n)]
    return [(scene, render(scene, sample_style(rng))) for scene in scenes]


def free_scenes(n: int, seed: int = 0) -> list[tuple[Scene, Image.Image]]:
    """``n`` held-out free-position scenes in the varied look, on canvases of any aspect ratio."""
    rng = np.random.default_rng([seed, 6007])
    out = []
    for _ in range(n):
        aspect = sample_aspect(rng)
        scene = sample_free_scene(rng, "held_out", aspect)
        out.append((scene, render(scene, sample_varied_style(rng, aspect))))
    return out


def eval_cases(n: int, seed: int = 0, drawings: Path | None = DRAWINGS) -> list[Case]:
    """Per held-out grid scene a caption and one question (canonical wording), per free scene a
    caption, the drawings (when ``drawings`` is there), plus tools and talk."""
    rng = np.random.default_rng([seed, 104729])
    caption = (image_message(CAPTION_PROMPTS[0]),)
    cases = []
    for scene, image in held_out_scenes(n, seed):
        question = sample_question(rng, scene)
        cases.append(Case("caption", caption, scene.caption, (image,)))
        cases.append(Case(f"qa_{question.kind}", (image_message(question_text(question)),), question.answer, (image,)))
    cases += [Case("free_caption", caption, scene.caption, (image,)) for scene, image in free_scenes(n, seed)]
    for drawing in load_drawings(drawings):
        expected = ", ".join(f"{colour} {kind}" for colour, kind in drawing.named)
        cases.append(Case("drawing", caption, expected, (drawing.image,), named=tuple(drawing.named), check="named"))
    return cases + json_cases(max(1, n // 4), seed) + tool_cases(rng) + [Case("small_talk", (user("Hello!"),), GREETING)]


def check_cases(seed: int, n: int = 24) -> list[Case]:
    """The small held-out sets training checks itself on (a seed eval-demo does not use)."""
    caption = (image_message(CAPTION_PROMPTS[0]),)
    cases = [Case("caption", caption, scene.caption, (image,)) for scene, image in held_out_scenes(n, seed)]
    cases += [Case("free_caption", caption, scene.caption, (image,)) for scene, image in free_scenes(n, seed)]
    return cases + json_cases(max(1, n // 8), seed) + tool_cases(np.random.default_rng([seed, 104729]))


def json_cases(n: int, seed: int = 0) -> list[Case]:
    """Set 4: held-out grid scenes as JSON, ``n`` per way of asking, each at temperature 0 and 0.8.

    With a picture: asked in words ("Describe the picture as JSON.") with and without
    ``response_format`` (the scene schema, strings unbounded), and cued only by
    ``response_format`` ("Describe this image."): right when the object equals the scene's.
    Without one: "Describe one shape." under the docs' one-shape schema (plain strings):
    right when it parses and names a shape and a colour the model knows."""
    rng = np.random.default_rng([seed, 3571])
    cases = []
    for i, (scene, image) in enumerate(held_out_scenes(n, seed + 1)):
        expected = dumps(scene_object(scene))
        for temperature in (0.0, 0.8):
            t = f"t{temperature:g}"
            ask = (image_message(JSON_PROMPTS[0]),)
            cases.append(Case(f"json_asked_{t}", ask, expected, (image,), check="json", temperature=temperature, seed=i))
            cases.append(Case(f"json_asked_schema_{t}", ask, expected, (image,), check="json", schema=SCENE_SCHEMA,
                              constrained=True, temperature=temperature, seed=i))  # fmt: skip
            cases.append(Case(f"json_schema_only_{t}", (image_message(CAPTION_PROMPTS[0]),), expected, (image,),
                              check="json", schema=SCENE_SCHEMA, constrained=True, temperature=temperature, seed=i))  # fmt: skip
            cases.append(Case(f"json_no_image_{t}", (user(NO_IMAGE_PROMPTS[0]),), "", check="sensible",
                              schema=SHAPE_SCHEMA, constrained=True, temperature=temperature, seed=int(rng.integers(2**31))))  # fmt: skip
    return cases


def load_drawings(path: Path | None) -> list[Any]:
    """The fixed drawings of ``tests/drawings.py``; none when the file is not there (an installed wheel)."""
    if path is None or not path.is_file():
        return []
    spec = importlib.util.spec_from_file_location("vlmserve_eval_drawings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return list(module.drawings())


def tool_cases(rng: np.random.Generator) -> list[Case]:
    cases = []
    for city in CITIES:
        unit = UNITS[int(rng.integers(len(UNITS)))]
        request = user(WEATHER_REQUESTS[0].format(city=city, unit=unit))
        cases.append(Case("tool_call", (request,), weather_call(city, unit), tools=(WEATHER_TOOL,)))
        degrees = int(rng.integers(-5, 36))
        call, result = weather_exchange(city, unit, degrees)
        cases.append(Case("tool_result", (request, call, result), weather_answer(city, degrees), tools=(WEATHER_TOOL,)))
    return cases


def run_cases(loaded: Any, cases: Sequence[Case]) -> list[tuple[Case, Reply]]:
    """Worker side: answer every case (greedy unless the case samples)."""
    from vlmserve.engine.params import SamplingParams
    from vlmserve.preprocess.guided import GuideCompiler, GuideSpec

    guides = GuideCompiler(loaded.tokenizer, loaded.eos_token_ids)
    out = []
    for case in cases:
        guide = guides.compile(GuideSpec("json_schema", case.schema)) if case.constrained else None
        tokens = JSON_MAX_TOKENS if case.check in ("json", "sensible") else MAX_TOKENS
        params = SamplingParams(max_tokens=tokens, temperature=case.temperature, seed=case.seed, guide=guide)
        out.append((case, generate_reply(loaded, case.messages, case.images, case.tools or None, params=params)))
    return out


def score(results: Sequence[tuple[Case, Reply]]) -> dict[str, Any]:
    """Exact-match accuracy per group, QA overall, EOS rate and a few examples."""
    groups: dict[str, list[bool]] = {}
    for case, reply in results:
        groups.setdefault(case.group, []).append(case.right(reply.text))
    qa = [ok for group, oks in groups.items() if group.startswith("qa_") for ok in oks]
    return {
        "n_scenes": len(groups.get("caption", [])),
        "caption_exact_match": _mean(groups.get("caption", [])),
        "free_caption_exact_match": _mean(groups.get("free_caption", [])),
        "drawings_named": _mean(groups.get("drawing", [])),
        "n_drawings": len(groups.get("drawing", [])),
        "qa_accuracy": _mean(qa),
        "json_t0": _mean([ok for g, oks in groups.items() if g.startswith("json_") and g.endswith("_t0") for ok in oks]),
        "json_t0.8": _mean([ok for g, oks in groups.items() if g.startswith("json_") and g.endswith("_t0.8") for ok in oks]),
        "tools": _mean(groups.get("tool_call", []) + groups.get("tool_result", [])),
        "groups": {group: {"n": len(oks), "accuracy": _mean(oks)} for group, oks in sorted(groups.items())},
        "stopped_by_eos": _mean([reply.stopped for _, reply in results]),
        "examples": [{"expected": c.expected, "got": r.text} for c, r in results[:6]],
        "failures": [{"group": c.group, "expected": c.expected, "got": r.text} for c, r in results if not c.right(r.text)][:30],
    }


def evaluate_demo(path: Path, n: int = DEFAULT_EVAL_N, seed: int = 0, drawings: Path | None = DRAWINGS) -> dict[str, Any]:
    """Load the model at ``path`` on a worker thread and score it on ``n`` held-out scenes of
    each kind and on the drawings."""
    from vlmserve.engine.loader import load_model
    from vlmserve.engine.worker import MLXWorkerThread

    start = time.perf_counter()
    cases = eval_cases(n, seed, drawings)
    worker = MLXWorkerThread(name="mlx-demo-eval")
    worker.start()
    try:
        loaded = worker.submit(load_model, str(path), "demo-gemma4").result()
        results = worker.submit(run_cases, loaded, cases).result()
    finally:
        worker.shutdown()
    return {**score(results), "seconds": round(time.perf_counter() - start, 1)}


def _mean(values: Sequence[bool]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0
