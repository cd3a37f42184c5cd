"""[any] MODEL_CARD.md for a trained demo model: what it knows, how it was made, how it scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.testing.demo.dialogues import (
    CAPTION_PROMPTS,
    CITIES,
    GREETING,
    MIX,
    QUESTION_WORDINGS,
    SMALL_TALK,
    WEATHER_REQUESTS,
    weather_answer,
    weather_call,
)  # fmt: skip
from vlmserve.testing.demo.scenes import COLOURS, GRID, HELD_OUT_TRIPLES, SHAPES, SIZE_RANGE

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
        f"Square pictures of 1-3 shapes ({', '.join(SHAPES)}) of distinct kinds and distinct colours\n"
        f"({', '.join(COLOURS)}), each in its own cell of a {GRID}x{GRID} grid, on a plain or lightly noisy\n"
        "light background. Captions list the shapes in reading order (top row first, left to right):\n\n"
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
        "Every answer ends by itself: `<turn|>`, or `<|tool_response>` after a call (both EOS)."
    )


def _training(info: dict[str, Any]) -> str:
    config = info["config"]
    mix = ", ".join(f"{kind} {share:.0%}" for kind, share in MIX.items())
    return (
        "## How it was trained\n\n"
        f"- Data: freshly generated chats, never repeated ({mix}); an image chat asks up to three\n"
        "  questions, then (or only) for the caption, every answer token is learned. Prompts are built by\n"
        "  `vlmserve.preprocess.prompt.build_prompt`, exactly as the server builds them.\n"
        f"- Augmentation: canvas 96-256 px, each shape {SIZE_RANGE[0]:.0%}-{SIZE_RANGE[1]:.0%} of its cell and anywhere in it,\n"
        "  small rotations, colour jitter, 6 background tints, Gaussian noise (half), JPEG re-encoding\n"
        "  (30%), prompt paraphrases, an occasional system prompt.\n"
        f"- Held out of training entirely: {len(HELD_OUT_TRIPLES)} of the {len(SHAPES) * len(COLOURS) * GRID * GRID} (shape, colour, cell)\n"
        "  combinations, one cell for every (shape, colour) pair (`scenes.HELD_OUT_TRIPLES`).\n"
        f"- Vision warm-up: {config['vision_warmup_steps']} steps of {config['vision_warmup_batch']} images on the vision tower\n"
        "  alone, with throw-away linear probes for the kind and colour of the shape in each cell (one\n"
        f"  soft token per cell) and the number of shapes (lr {config['vision_warmup_lr']}, loss\n"
        f"  {info['vision_warmup_loss'][0]} -> {info['vision_warmup_loss'][1]}, cells right afterwards:\n"
        f"  {info.get('vision_warmup_cell_accuracy', 0):.1%}). Through the language model alone the tower learned colour\n"
        "  quickly and shape far too slowly. The connector (`embed_vision`) then starts as the probes'\n"
        "  read-out written in the word embeddings of the shape, colour, row and column names.\n"
        f"- Then {config['steps']} steps of batch {config['batch_size']} (examples of similar length together),\n"
        f"  {info['tokens_seen']:,} tokens; loss {info['first_loss']} -> {info['final_loss']}.\n"
        f"- Full fine-tune from the offline builder's seeded init (seed {config['seed']}): Adam, lr {config['lr']},\n"
        f"  vision tower at {config['vision_lr_scale']}x, {config['warmup']}-step warm-up, cosine decay to\n"
        f"  {config['final_lr_fraction']}x, gradient norm clipped at {config['clip_norm']}; cross-entropy on\n"
        "  answer tokens only, averaged within each answer so a one-word answer weighs as much as a caption. Text tokens stay causal (Gemma 4's bidirectional overlay\n"
        "  covers image tokens only).\n"
        f"- Time: {info['train_seconds']:.0f} s on a shared 2-core x86 CPU (MLX {info.get('mlx', '?')}, CPU backend,\n"
        f"  {info.get('blas', 'the wheel’s own BLAS')})."
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
        f"becomes {dims['image_size']}x{dims['image_size']} px and {dims['image_tokens']} soft tokens.\n"
        f"On disk: {weights:.1f} MB of weights, {size:.1f} MB in all."
    )


def _scores(scores: dict[str, Any] | None) -> str:
    if scores is None:
        return "## Held-out scores\n\nNot evaluated (run `vlmserve eval-demo --model DIR`)."
    rows = "\n".join(f"| {name} | {g['n']} | {g['accuracy']:.3f} |" for name, g in scores["groups"].items())
    targets = (
        ("1. grid scenes, caption exact", scores["caption_exact_match"], 0.95),
        ("2. free-position scenes, caption exact", scores["free_caption_exact_match"], 0.95),
        ("3. drawings by another routine, every shape named with its colour", scores["drawings_named"], 0.90),
    )
    if not scores["n_drawings"]:  # an installed wheel has no tests/drawings.py
        targets = targets[:2]
    lines = "\n".join(
        f"- {name}: **{value:.3f}** (issue 16's target {target:.2f}: {'met' if value >= target else 'MISSED'})"
        for name, value, target in targets
    )
    return (
        "## Held-out scores\n\n"
        f"Greedy decoding through vlmserve's loader, worker thread and runner. Set 1: {scores['n_scenes']} grid scenes in\n"
        "the classic look, each showing a (shape, colour, cell) combination never trained on, a caption\n"
        "and one question each. Set 2: as many free-position scenes in the varied look on canvases of\n"
        "any aspect ratio, each with a (shape, colour) pair centred in its held-out region. Set 3:\n"
        f"the {scores['n_drawings']} drawings of `tests/drawings.py`, rasterized with numpy geometry in web colours,\n"
        "not by training's renderer.\n\n"
        + lines
        + f"\n- QA accuracy (set 1): **{scores['qa_accuracy']:.3f}**\n"
        f"- answers ended by EOS before 48 tokens: {scores['stopped_by_eos']:.3f}\n\n"
        "| group | n | right |\n|---|---|---|\n" + rows
    )


def _limits(info: dict[str, Any], scores: dict[str, Any] | None) -> str:
    weakest = ""
    if scores is not None:
        name, group = min(scores["groups"].items(), key=lambda item: item[1]["accuracy"])
        weakest = f"- Its weakest held-out group is `{name}` ({group['accuracy']:.0%} exact).\n"
    return (
        "## Limits\n\n"
        + weakest
        + f"- Trained for {info['train_seconds'] / 60:.0f} CPU-minutes on one synthetic world. The errors left on held-out\n"
        "  scenes: reading the colour of the shape asked about off its own caption wrongly, and now\n"
        "  and then three shapes listed out of order.\n"
        "- Anything outside the lists above gets a confident, wrong, shapes-flavoured answer. Photos,\n"
        "  other shapes and colours, more than three shapes, two in one cell and non-square images\n"
        "  (the processor makes them 6 soft tokens, not 9) are out of distribution. It is a test\n"
        "  oracle and a demo, not an assistant."
    )
