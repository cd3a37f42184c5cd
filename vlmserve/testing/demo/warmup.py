"""[main] Vision warm-up: teach the vision tower shapes and colours before the language model reads it.

Through the language model alone the vision tower learned colour within a few hundred steps and
shape not at all in a CPU budget. So training starts on the vision tower alone, with throw-away
linear probes on its (normalized) soft tokens, in two stages:

1. **lone shapes** (``stage="lone"``): one shape anywhere, of any size, in the varied look, on a
   canvas of any aspect ratio. Issue 16 measured that a patch ViT learns kinds at free positions
   and sizes far sooner this way than from whole scenes: learning is flat, then jumps, at a step
   no one can predict, so the stage runs until a held-out check passes, with a step cap.
2. **scenes** (``stage="scenes"``): grid scenes in the classic look and free-position scenes in
   the varied look, per-token labels, with a decaying rate.

Labels, per soft token (row-major, as the pooler orders them; a square picture is 3 x 3 tokens,
a 4:3 one 3 x 4, a 2:1 one 2 x 4): the kind and colour of the shape whose centre falls in the token's
part of the picture (or none), and where that shape comes in the caption (its row's rank:
top/middle/bottom; its rank in the row: left/centre/right; ``token_places``); per picture, the number of shapes and which kinds and
colours it shows. On grid scenes every shape's centre is in its own cell, so every label is
exact. Pixels come from the model's own image processor, as at inference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from vlmserve.preprocess.prompt import tokenizer_of
from vlmserve.testing.demo.batches import prefetch
from vlmserve.testing.demo.dialogues import sample_picture as dialogue_picture
from vlmserve.testing.demo.scenes import COLOURS, COLUMN_NAMES, GRID, ROW_NAMES, SHAPES, Scene, Split
from vlmserve.testing.demo.scenes import rows as caption_rows

MAX_SHAPES = 3
TOKEN_PX = 32  # a soft token covers 2 x 2 patches of 16 px
Stage = Literal["lone", "scenes"]
STAGES: tuple[Stage, ...] = ("lone", "scenes")


def token_grid(pixel_values: np.ndarray) -> tuple[int, int]:
    """Rows and columns of soft tokens the picture becomes."""
    return pixel_values.shape[-2] // TOKEN_PX, pixel_values.shape[-1] // TOKEN_PX


def token_labels(scene: Scene, rows: int, columns: int, names: tuple[str, ...], attribute: str) -> np.ndarray:
    """Per token (row-major): 0 when no shape's centre falls in it, else 1 + the index in
    ``names`` of the ``attribute`` (kind or colour) of the shape centred there."""
    labels = np.zeros(rows * columns, dtype=np.int32)
    for shape in scene.shapes:
        row, column = min(int(shape.y * rows), rows - 1), min(int(shape.x * columns), columns - 1)
        labels[row * columns + column] = names.index(getattr(shape, attribute)) + 1
    return labels


def token_places(scene: Scene, rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token (row-major), where the shape centred there comes in the caption: the rank of its
    row among the picture's rows (the caption's rows, ``scenes.rows``: top, middle, bottom) and its
    rank within that row (left, centre, right); -1 where no shape's centre falls.

    Not the token's own row: two shapes of one caption row may sit in different rows of tokens
    (and two rows of shapes in one row of tokens), and a model fed the token's place said "above"
    for one shape beside another in a tenth of grid scenes."""
    row_rank, column_rank = np.full(rows * columns, -1, np.int32), np.full(rows * columns, -1, np.int32)
    for r, row in enumerate(caption_rows(scene.shapes)):
        for c, shape in enumerate(sorted(row, key=lambda s: s.x)):
            token = min(int(shape.y * rows), rows - 1) * columns + min(int(shape.x * columns), columns - 1)
            row_rank[token], column_rank[token] = r, c
    return row_rank, column_rank


def present(scene: Scene, names: tuple[str, ...], attribute: str) -> np.ndarray:
    out = np.zeros(len(names), dtype=np.float32)
    for shape in scene.shapes:
        out[names.index(getattr(shape, attribute))] = 1.0
    return out


class VisionProbe(nn.Module):
    """The model's vision tower plus linear probes; the tower is kept, the probes start the connector."""

    def __init__(self, tower: nn.Module, width: int) -> None:
        super().__init__()
        self.tower = tower
        self.kinds = nn.Linear(width, len(SHAPES) + 1)
        self.colours = nn.Linear(width, len(COLOURS) + 1)
        self.rows = nn.Linear(width, GRID)
        self.columns = nn.Linear(width, GRID)
        self.counts = nn.Linear(width, MAX_SHAPES)
        self.kinds_shown = nn.Linear(width, len(SHAPES))
        self.colours_shown = nn.Linear(width, len(COLOURS))

    def __call__(self, pixel_values: mx.array) -> dict[str, mx.array]:
        features = self.tower(pixel_values)[0]  # [images * tokens, width]
        features = mx.fast.rms_norm(features, None, 1e-6)  # as embed_vision normalizes them
        per_image = features.reshape(pixel_values.shape[0], -1, features.shape[-1]).mean(axis=1)
        return {
            "kinds": self.kinds(features), "colours": self.colours(features), "rows": self.rows(features),
            "columns": self.columns(features), "counts": self.counts(per_image),
            "kinds_shown": self.kinds_shown(per_image), "colours_shown": self.colours_shown(per_image),
        }  # fmt: skip


SHOWN = ("kinds_shown", "colours_shown")


PLACES = ("rows", "columns")  # labelled on a shape's token only (-1 elsewhere)


def probe_loss(probe: VisionProbe, batch: dict[str, mx.array]) -> mx.array:
    logits = probe(batch["pixel_values"])
    loss = sum(nn.losses.cross_entropy(logits[k], batch[k]).mean() for k in logits if k not in SHOWN + PLACES)
    for k in PLACES:
        labelled = batch[k] >= 0
        each = nn.losses.cross_entropy(logits[k], mx.maximum(batch[k], 0)) * labelled
        loss = loss + each.sum() / mx.maximum(labelled.sum(), 1)
    shown = sum(nn.losses.binary_cross_entropy(logits[k], batch[k]).mean() for k in SHOWN)
    return loss + shown  # type: ignore[return-value]


def sample_picture(rng: np.random.Generator, stage: Stage, split: Split = "train") -> tuple[Scene, Any]:
    """A scene and its image for ``stage``: a lone shape anywhere, or (scenes) a grid scene in
    the classic look 40% of the time, else a free-position one (``dialogues.sample_picture``)."""
    free = not (stage == "scenes" and rng.random() < 0.4)
    return dialogue_picture(rng, split, free=free, shapes=1 if stage == "lone" else None)


def host_batches(processor: Any, rng: np.random.Generator, size: int, stage: Stage,
                 split: Split = "train") -> Iterator[dict[str, np.ndarray]]:  # fmt: skip
    """Endless batches of fresh scenes with their labels, in numpy; one token grid per batch
    (pictures of other aspect ratios wait for a batch of their own)."""
    waiting: dict[tuple[int, ...], list[tuple[Scene, np.ndarray]]] = {}
    while True:
        scene, image = sample_picture(rng, stage, split)
        pixels, _ = processor.image_processor([image])  # the processor's own resize and rescale
        array = np.asarray(pixels["pixel_values"])
        group = waiting.setdefault(array.shape, [])
        group.append((scene, array))
        if len(group) == size:
            del waiting[array.shape]
            yield labelled_batch(group)


def labelled_batch(group: list[tuple[Scene, np.ndarray]]) -> dict[str, np.ndarray]:
    rows, columns = token_grid(group[0][1])
    scenes = [scene for scene, _ in group]
    places = [token_places(s, rows, columns) for s in scenes]
    return {
        "pixel_values": np.concatenate([array for _, array in group]),
        "kinds": np.concatenate([token_labels(s, rows, columns, SHAPES, "kind") for s in scenes]),
        "colours": np.concatenate([token_labels(s, rows, columns, COLOURS, "colour") for s in scenes]),
        "rows": np.concatenate([row for row, _ in places]),
        "columns": np.concatenate([column for _, column in places]),
        "counts": np.array([len(s.shapes) - 1 for s in scenes], dtype=np.int32),
        "kinds_shown": np.stack([present(s, SHAPES, "kind") for s in scenes]),
        "colours_shown": np.stack([present(s, COLOURS, "colour") for s in scenes]),
    }


def to_device(batch: dict[str, np.ndarray]) -> dict[str, mx.array]:
    return {k: mx.array(v) for k, v in batch.items()}


def check_batches(processor: Any, seed: int, stage: Stage, n: int = 128, size: int = 32) -> list[dict[str, mx.array]]:
    """Fixed held-out pictures for ``stage``'s check (placements training never draws)."""
    rng = np.random.default_rng([seed, 4, STAGES.index(stage)])
    batches, count = [], 0
    for batch in host_batches(processor, rng, size, stage, "held_out"):
        batches.append(to_device(batch))
        count += size
        if count >= n:
            return batches
    raise AssertionError("unreachable")


def probe_accuracy(probe: VisionProbe, batches: list[dict[str, mx.array]]) -> dict[str, float]:
    """Held-out scores of the probes: ``named``, the share of pictures whose tokens name exactly
    their shapes (kind and colour, wherever they are: what a caption needs first); ``tokens``,
    of the tokens that hold a shape's centre or that the probes say do, the share right in kind
    and colour; ``kinds``, of the shapes, the share whose centre token names their kind."""
    named = pictures = right = relevant_total = kinds_right = shapes = 0
    for batch in batches:
        logits = probe(batch["pixel_values"])
        kinds, colours = logits["kinds"].argmax(-1), logits["colours"].argmax(-1)
        ok = (kinds == batch["kinds"]) & (colours == batch["colours"])
        relevant = (batch["kinds"] > 0) | (kinds > 0)
        right += int((ok & relevant).sum().item())
        relevant_total += int(relevant.sum().item())
        kinds_right += int(((kinds == batch["kinds"]) & (batch["kinds"] > 0)).sum().item())
        shapes += int((batch["kinds"] > 0).sum().item())
        n = batch["pixel_values"].shape[0]
        said, truth = _pairs(np.array(kinds), np.array(colours), n), _pairs(np.array(batch["kinds"]), np.array(batch["colours"]), n)
        named += sum(a == b for a, b in zip(said, truth))
        pictures += n
    return {"named": named / pictures, "tokens": right / max(1, relevant_total), "kinds": kinds_right / max(1, shapes)}


def _pairs(kinds: np.ndarray, colours: np.ndarray, pictures: int) -> list[set[tuple[int, int]]]:
    """Per picture, the (kind, colour) pairs its tokens name."""
    kinds, colours = kinds.reshape(pictures, -1), colours.reshape(pictures, -1)
    return [{(int(k), int(c)) for k, c in zip(ks, cs) if k > 0} for ks, cs in zip(kinds, colours)]


@dataclass(frozen=True, slots=True)
class StageConfig:
    stage: Stage
    max_steps: int
    lr: float
    batch: int = 32
    target: float = 1.0  # held-out accuracy that ends the stage early
    check_every: int = 250
    decay: bool = True  # cosine to a tenth over ``max_steps``; else constant after the warm-up


def run_stage(
    probe: VisionProbe, processor: Any, seed: int, config: StageConfig,
    on_step: Callable[[float], None] = lambda loss: None, on_check: Callable[[int, dict[str, float]], None] = lambda s, a: None,
) -> dict[str, Any]:  # fmt: skip
    """Train ``probe`` (tower and probes) on ``config.stage``'s pictures until its held-out check
    reaches ``config.target`` or ``config.max_steps``; returns what the model card reports."""
    lr = config.lr
    warm = optim.linear_schedule(lr / 10, lr, 10)
    after = optim.cosine_decay(lr, max(1, config.max_steps - 10), lr / 10) if config.decay else (lambda _: lr)
    optimizer = optim.Adam(learning_rate=optim.join_schedules([warm, after], [10]), bias_correction=True)
    step_fn = nn.value_and_grad(probe, probe_loss)
    stream = prefetch(host_batches(processor, np.random.default_rng([seed, 3, STAGES.index(config.stage)]), config.batch, config.stage))
    checks = check_batches(processor, seed, config.stage)
    start, losses, history, accuracy, steps = time.perf_counter(), [], [], 0.0, 0
    for steps in range(1, config.max_steps + 1):
        loss, grads = step_fn(probe, to_device(next(stream)))
        optimizer.update(probe, grads)
        mx.eval(loss, probe.parameters(), optimizer.state)
        losses.append(float(loss.item()))
        on_step(losses[-1])
        if steps % config.check_every == 0 or steps == config.max_steps:
            scores = probe_accuracy(probe, checks)
            accuracy = scores["named"]
            history.append({"step": steps, **{k: round(v, 4) for k, v in scores.items()}})
            on_check(steps, scores)
            if accuracy >= config.target:
                break
    return {
        "stage": config.stage, "steps": steps, "max_steps": config.max_steps, "target": config.target,
        "held_out_accuracy": round(accuracy, 4), "checks": history, "seconds": round(time.perf_counter() - start, 1),
        "loss": [round(losses[0], 4), round(float(np.mean(losses[-20:])), 4)],
    }  # fmt: skip


def init_connector(model: nn.Module, probe: VisionProbe, processor: Any, pixel_values: mx.array) -> None:
    """Start ``embed_vision``'s projection as the probes' read-out, written in word embeddings.

    A soft token showing a red circle in the top left cell then enters the text model close to
    the embeddings of " red", " circle", " top" and " left" (the probes' centred logits weigh
    the words), each at the size of a text token's embedding. Reading the image becomes copying
    words, which a transformer learns fast. From a random projection, captions took ~600 steps
    to come right and shapes were the last thing learned; from this one, ~250.
    """
    tokenizer = tokenizer_of(processor)
    embed = model.language_model.model.embed_tokens.weight

    def words(names: tuple[str, ...], none: bool = True) -> mx.array:  # first row: no shape, no word
        rows = [embed[tokenizer(" " + name, add_special_tokens=False)["input_ids"]].mean(axis=0) for name in names]
        return mx.stack([mx.zeros_like(rows[0]), *rows] if none else rows)

    def centred(weight: mx.array) -> mx.array:
        return weight - weight.mean(axis=0, keepdims=True)

    features = mx.fast.rms_norm(probe.tower(pixel_values)[0], None, 1e-6)
    target = mx.linalg.norm(embed, axis=-1).mean() * model.language_model.model.embed_scale
    # each word at the size of a text token's embedding: unbalanced, the colour (the stronger
    # signal) drowned the shape, and the text model named colours right and shapes wrong
    readout = mx.zeros_like(model.embed_vision.embedding_projection.weight)
    parts = ((SHAPES, True, probe.kinds), (COLOURS, True, probe.colours),
             (ROW_NAMES, False, probe.rows), (COLUMN_NAMES, False, probe.columns))  # fmt: skip
    for names, none, head in parts:
        part = words(names, none).T @ centred(head.weight)
        readout = readout + part * (target / mx.linalg.norm(features @ part.T, axis=-1).mean())
    model.embed_vision.embedding_projection.weight = readout
    mx.eval(model.embed_vision.parameters())
