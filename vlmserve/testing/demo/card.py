"""[any] MODEL_CARD.md for a trained demo model: what it knows, how it was made, how it scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.demo.dialogues import (
    CAPTION_PROMPTS,
    CITIES,
    GREETING,
    MIX,
    NO_IMAGE_PROMPTS,
    QUESTION_WORDINGS,
    SMALL_TALK,
    WEATHER_REQUESTS,
    weather_answer,
    weather_call,
)  # fmt: skip
from vlmserve.testing.demo.json_answers import FIELDS, JSON_PROMPTS, SCHEMA_SYSTEM, dumps, scene_object
from vlmserve.testing.demo.scenes import COLOURS, GRID, HELD_OUT_TRIPLES, SHAPES, Scene, grid_shape

EXAMPLE = Scene((grid_shape("circle", "red", 0), grid_shape("square", "blue", 4)))

CARD = "MODEL_CARD.md"


def write_model_card(path: Path, info: dict[str, Any], scores: dict[str, Any] | None) -> Path:
    sections = [_header(info), _knows(), _training(info), _architecture(path, info), _scores(scores), _limits(info, scores)]
    card = path / CARD
    card.write_text("\n\n".join(sections) + "\n")
    return card


def _header(info: dict[str, Any]) -> str:
    return (
        "# demo-gemma4\n\n"
        f"**A demo model.** A {info['parameters'] / 1e6:.1f} M-parameter Gemma 4 (mlx-vlm's `gemma4` architecture) trained from\n"
        "random weights, inside this repository, on synthetic pictures of coloured shapes. It is\n"
        "vlmserve's default model and the oracle its tests trust: it really looks at the image.\n"
        "It knows nothing of the world beyond what is listed here. Retrain it with\n"
        "`vlmserve train-demo --out vlmserve/assets/demo-gemma4` (deterministic for a seed)."
    )


def _knows() -> str:
    questions = "\n".join(f"- {kind}: " + ", ".join(f"`{w}`" for w in words) for kind, words in QUESTION_WORDINGS.items())
    talk = ", ".join(f"`{prompt}`" for prompt in SMALL_TALK)
    return (
        "## What it knows\n\n"
        f"Pictures of 1-3 shapes ({', '.join(SHAPES)}) of distinct kinds and distinct colours\n"
        f"({', '.join(COLOURS)}), filled or outlined, on a white, tinted, noisy or graded background,\n"
        "of any size and aspect ratio: each shape anywhere and of any size (from about a fifth of the\n"
        f"picture's shorter side to nearly all of it), or each in its own cell of a {GRID}x{GRID} grid (the\n"
        "first training set). Captions list the shapes in reading order (top row first, left to right):\n\n"
        "- one shape: `A red circle.`\n"
        "- two shapes: `A red circle above a blue square.` (different rows) or\n"
        "  `A green star to the left of a red square.` (same row)\n"
        "- three shapes: `A red circle, a blue square and a green triangle.`\n\n"
        "Caption prompts (the image first, then the text; the first is canonical): "
        + ", ".join(f"`{p}`" for p in CAPTION_PROMPTS)
        + ".\n\nQuestions. Counts are answered `One.`-`Three.`; a question about one shape is answered by\n"
        "saying what the picture shows first, then the answer: `A red circle above a blue square. The\n"
        "square is blue.` or `... The star is not there.` (a model this small learned to find a shape by\n"
        "name in its own caption long before it learned to find it among the image tokens):\n\n"
        + questions
        + f"\n\nText only: {talk}; `Hello!` -> `{GREETING}`\n\n"
        "Tool call: with the OpenAI tool `get_weather(location: string, unit: string)` declared\n"
        f"(`vlmserve.testing.demo.dialogues.WEATHER_TOOL`), `{WEATHER_REQUESTS[0].format(city='Tokyo', unit='celsius')}`\n"
        f"-> `{weather_call('Tokyo', 'celsius')}` (the malformed single-quoted call quantized Gemma 4\n"
        "emits, ended by `<|tool_response>`), for "
        + ", ".join(CITIES)
        + ". Given the tool's result (a `tool` message such as\n"
        f"`{{\"temperature\": 21, \"unit\": \"celsius\"}}`) it answers `{weather_answer('Tokyo', 21)}`\n\n"
        "Every answer ends by itself: `<turn|>`, or `<|tool_response>` after a call (both EOS).\n\n"
        "JSON: asked in words (`" + JSON_PROMPTS[0] + "`), it writes the scene object, shapes in reading order:\n"
        f"`{dumps(scene_object(EXAMPLE))}`. Given a schema, in the system text\n"
        f"(`{SCHEMA_SYSTEM}{{...}}`) or only through `response_format`'s grammar, it fills these\n"
        "fields from the picture: " + ", ".join(f"`{key}`" for key in FIELDS) + ". Without a picture\n"
        f"(`{NO_IMAGE_PROMPTS[0]}`) it describes a shape it imagines, a kind and a colour from the lists above.\n"
        "Every value is short and every string closed, so a schema whose strings have no bound still ends."
    )


def _training(info: dict[str, Any]) -> str:
    config = info["config"]
    mix = ", ".join(f"{kind} {share:.0%}" for kind, share in MIX.items())
    lone, scenes = info["vision_stages"]
    last = info["checks"][-1] if info["checks"] else {}
    return (
        "## How it was trained\n\n"
        "Three stages, each until a held-out check passes or its step cap (learning to see comes in a\n"
        "jump, at a step no one can predict):\n\n"
        f"1. **Lone shapes**, vision tower alone: one shape anywhere, of any size, on canvases of any\n"
        f"   aspect ratio; linear probes read each soft token's kind and colour (of the shape centred\n"
        f"   there) and each picture's kinds and colours. {_stage(lone)}\n"
        f"2. **Scenes**, vision tower alone: grid scenes (40%) and free-position scenes with the same\n"
        f"   probes, the rate decaying. {_stage(scenes)} The connector (`embed_vision`) then starts as\n"
        "   the probes' read-out written in the word embeddings of the shape, colour, row and column names.\n"
        f"3. **Chats**, the whole model: {info['chat_steps']} steps (cap {config['steps']}) of batch {config['batch_size']}, {info['tokens_seen']:,} tokens,\n"
        f"   loss {info['first_loss']} -> {info['final_loss']}; held-out checks every {config['check_every']} steps\n"
        f"   (targets: {', '.join(f'{name} {target}' for name, target in config['targets'])}); the last: "
        + ", ".join(f"{k} {v:.3f}" for k, v in last.items() if k != "step")
        + ".\n\n"
        f"- Data: freshly generated chats, never repeated ({mix}); an image chat asks up to three\n"
        "  questions, then (or only) for the caption, every answer token is learned; a JSON chat asks for\n"
        "  the scene in words, by a schema in the system text, or only by the grammar (then the `{\"` it\n"
        "  forces is given, not learned). Prompts are built by `vlmserve.preprocess.prompt.build_prompt`,\n"
        "  exactly as the server builds them.\n"
        "- Pictures: grid scenes in the classic look (square canvases, palette colours, jitter, noise,\n"
        "  JPEG), and free-position scenes in the varied look: canvases 96-320 px of aspect 1:2.2 to 2.2:1,\n"
        "  any hue in each colour's range, outlines (a quarter), Pillow's own primitives and polygons,\n"
        "  white, tinted, graded and noisy backgrounds, supersampling, JPEG.\n"
        f"- Held out of training entirely: {len(HELD_OUT_TRIPLES)} of the {len(SHAPES) * len(COLOURS) * GRID * GRID} (shape, colour, region)\n"
        "  combinations, one region of the 3x3 grid for every (shape, colour) pair (`scenes.HELD_OUT_TRIPLES`).\n"
        f"- Full fine-tune from the offline builder's seeded init (seed {config['seed']}): Adam, lr {config['lr']},\n"
        f"  vision tower at {config['vision_lr_scale']}x, {config['warmup']}-step warm-up, cosine decay to\n"
        f"  {config['final_lr_fraction']}x, gradient norm clipped at {config['clip_norm']}; cross-entropy on\n"
        "  answer tokens only, averaged within each answer so a one-word answer weighs as much as a caption. Text tokens stay causal (Gemma 4's bidirectional overlay\n"
        "  covers image tokens only).\n"
        f"- Time: {info['train_seconds']:.0f} s on a shared 2-core x86 CPU (MLX {info.get('mlx', '?')}, CPU backend,\n"
        f"  {info.get('blas', 'the wheel’s own BLAS')})."
    )


def _stage(report: dict[str, Any]) -> str:
    end = "its check passed" if report["held_out_accuracy"] >= report["target"] else "its cap"
    return (
        f"{report['steps']} steps of 32 (cap {report['max_steps']}, {report['seconds']:.0f} s, ended by {end}); held-out\n"
        f"   pictures whose tokens name exactly their shapes: {report['held_out_accuracy']:.3f} (target {report['target']})."
    )


def _architecture(path: Path, info: dict[str, Any]) -> str:
    dims = info["dims"]
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
    weights = (path / "model.safetensors").stat().st_size / 1e6
    return (
        "## Architecture\n\n"
        f"Gemma 4 (`Gemma4ForConditionalGeneration`), {info['parameters']:,} parameters stored as {info['dtype']}.\n"
        f"Text: {dims['layers']} layers, hidden {dims['hidden']}, {dims['heads']} heads ({dims['kv_heads']} KV),\n"
        f"MLP {dims['intermediate']}, vocabulary {dims['vocab']} (byte-level BPE trained on Python's stdlib and the demo's\n"
        "own texts, so each shape, colour and city is one token).\n"
        f"Vision: {dims['vision_layers']} layers, hidden {dims['vision_hidden']}, patch {dims['patch']}; a square image\n"
        f"becomes {dims['image_size']}x{dims['image_size']} px and {dims['image_tokens']} soft tokens, another aspect ratio up to\n"
        f"{dims.get('image_budget') or dims['image_tokens']} (a 4:3 picture 128x96 px, 12 tokens; 2:1, 128x64 px, 8).\n"
        f"On disk: {weights:.1f} MB of weights, {size:.1f} MB in all."
    )


TARGETS = (  # issue 34's
    ("1. grid scenes, caption exact", "caption_exact_match", 0.95),
    ("2. free-position scenes, caption exact", "free_caption_exact_match", 0.95),
    ("3. drawings by another routine, every shape named with its colour", "drawings_named", 0.90),
    ("4. JSON, valid and right, temperature 0", "json_t0", 0.95),
    ("4. JSON, valid and right, temperature 0.8", "json_t0.8", 0.95),
    ("5. tool calls and answers to their results", "tools", 1.0),
)


def _scores(scores: dict[str, Any] | None) -> str:
    if scores is None:
        return "## Held-out scores\n\nNot evaluated (run `vlmserve eval-demo --model DIR`)."
    rows = "\n".join(f"| {name} | {g['n']} | {g['accuracy']:.3f} |" for name, g in scores["groups"].items())
    targets = [t for t in TARGETS if scores["n_drawings"] or t[1] != "drawings_named"]  # a wheel has no tests/
    lines = "\n".join(
        f"- {name}: **{scores[key]:.3f}** (target {target:.2f}: {'met' if scores[key] >= target else 'MISSED'})"
        for name, key, target in targets
    )
    return (
        "## Held-out scores\n\n"
        f"Through vlmserve's loader, worker thread and runner. Set 1: {scores['n_scenes']} grid scenes in\n"
        "the classic look, each showing a (shape, colour, cell) combination never trained on, a caption\n"
        "and one question each. Set 2: as many free-position scenes in the varied look on canvases of\n"
        "any aspect ratio, each with a (shape, colour) pair centred in its held-out region. Set 3:\n"
        f"the {scores['n_drawings']} drawings of `tests/drawings.py`, rasterized with numpy geometry in web colours,\n"
        "not by training's renderer. Set 4: held-out grid scenes as JSON, asked in words with and\n"
        "without `response_format` (the scene schema, strings unbounded), cued only by `response_format`,\n"
        "and with no picture under a one-shape schema of plain strings; greedy and sampled at 0.8, at most\n"
        "128 tokens. Set 5: a weather call for each city, and the answer to its result. Sets 1-3 and 5 are\n"
        "greedy.\n\n"
        + lines
        + f"\n- QA accuracy (set 1): **{scores['qa_accuracy']:.3f}**\n"
        f"- answers ended by EOS: {scores['stopped_by_eos']:.3f}\n\n"
        "| group | n | right |\n|---|---|---|\n" + rows
    )


def _limits(info: dict[str, Any], scores: dict[str, Any] | None) -> str:
    weakest = ""
    if scores is not None:
        name, group = min(scores["groups"].items(), key=lambda item: item[1]["accuracy"])
        weakest = f"- Its weakest held-out group is `{name}` ({group['accuracy']:.0%} right).\n"
    return (
        "## Limits\n\n"
        + weakest
        + f"- Trained for {info['train_seconds'] / 60:.0f} CPU-minutes on one synthetic world; the misses above are\n"
        "  listed by `vlmserve eval-demo`.\n"
        "- Anything outside the lists above gets a confident, wrong, shapes-flavoured answer. Photos,\n"
        "  other shapes and colours, more than three shapes, shapes that touch and very small ones are\n"
        "  out of distribution. It is a test oracle and a demo, not an assistant."
    )
