"""[main] Vision warm-up: teach the vision tower shapes and colours before the language model reads it.

Through the language model alone the vision tower learned colour within a few hundred steps and
shape not at all in a CPU budget. So training starts with a cheap phase on the vision tower
alone, with throw-away linear probes on its (normalized) soft tokens: the kind and colour of the
shape in each cell of the scene grid (or none), the cell's row and column, and the number of
shapes from their mean. The
grid and the soft tokens line up (3 x 3 each), so every label is exact. Pixels come from the
model's own image processor, as at inference. A vision-only step costs a fraction of a full one,
so this phase sees many more images per second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from vlmserve.preprocess.prompt import tokenizer_of
from vlmserve.testing.demo.batches import prefetch
from vlmserve.testing.demo.render import render, sample_style
from vlmserve.testing.demo.scenes import CELLS, COLOURS, COLUMN_NAMES, GRID, ROW_NAMES, SHAPES, Scene, sample_scene

MAX_SHAPES = 3


def cell_labels(scene: Scene, names: tuple[str, ...], attribute: str) -> np.ndarray:
    """Per cell (row-major, as the pooler orders soft tokens): 0 when empty, else 1 + the index
    in ``names`` of the ``attribute`` (kind or colour) of the shape there."""
    labels = np.zeros(CELLS, dtype=np.int32)
    for shape in scene.shapes:
        labels[shape.region] = names.index(getattr(shape, attribute)) + 1  # a grid shape's cell
    return labels


class VisionProbe(nn.Module):
    """The model's vision tower plus linear probes (each cell's kind, colour, row and column, and
    the number of shapes); the tower is kept, the probes start the connector."""

    def __init__(self, tower: nn.Module, width: int) -> None:
        super().__init__()
        self.tower = tower
        self.kinds = nn.Linear(width, len(SHAPES) + 1)
        self.colours = nn.Linear(width, len(COLOURS) + 1)
        self.rows = nn.Linear(width, GRID)
        self.columns = nn.Linear(width, GRID)
        self.counts = nn.Linear(width, MAX_SHAPES)

    def __call__(self, pixel_values: mx.array) -> dict[str, mx.array]:
        features = self.tower(pixel_values)[0]  # [images * cells, width]
        features = mx.fast.rms_norm(features, None, 1e-6)  # as embed_vision normalizes them
        per_image = features.reshape(pixel_values.shape[0], -1, features.shape[-1]).mean(axis=1)
        return {
            "kinds": self.kinds(features), "colours": self.colours(features), "rows": self.rows(features),
            "columns": self.columns(features), "counts": self.counts(per_image),
        }  # fmt: skip


def probe_loss(probe: VisionProbe, batch: dict[str, mx.array]) -> mx.array:
    logits = probe(batch["pixel_values"])
    return sum(nn.losses.cross_entropy(logits[k], batch[k]).mean() for k in logits)  # type: ignore[return-value]


def host_batches(processor: Any, rng: np.random.Generator, size: int) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of fresh training scenes with their cell labels, in numpy."""
    while True:
        scenes = [sample_scene(rng) for _ in range(size)]
        images = [render(scene, sample_style(rng)) for scene in scenes]
        pixels, tokens = processor.image_processor(images)  # the processor's own resize and rescale
        if set(tokens) != {CELLS}:
            raise ValueError(f"the processor makes {set(tokens)} soft tokens per scene; the grid has {CELLS} cells")
        yield {
            "pixel_values": np.asarray(pixels["pixel_values"]),
            "kinds": np.concatenate([cell_labels(s, SHAPES, "kind") for s in scenes]),
            "colours": np.concatenate([cell_labels(s, COLOURS, "colour") for s in scenes]),
            "rows": np.tile(np.arange(CELLS, dtype=np.int32) // GRID, size),
            "columns": np.tile(np.arange(CELLS, dtype=np.int32) % GRID, size),
            "counts": np.array([len(scene.shapes) - 1 for scene in scenes], dtype=np.int32),
        }


def sample_batch(processor: Any, rng: np.random.Generator, size: int) -> dict[str, mx.array]:
    return to_device(next(host_batches(processor, rng, size)))


def to_device(batch: dict[str, np.ndarray]) -> dict[str, mx.array]:
    return {k: mx.array(v) for k, v in batch.items()}


def probe_accuracy(probe: VisionProbe, batch: dict[str, mx.array]) -> float:
    """Share of cells whose kind and colour both come out right."""
    logits = probe(batch["pixel_values"])
    right = (logits["kinds"].argmax(-1) == batch["kinds"]) & (logits["colours"].argmax(-1) == batch["colours"])
    return float(right.astype(mx.float32).mean().item())


def warm_up_vision(
    model: nn.Module, processor: Any, dims: Any, seed: int, steps: int, batch_size: int, lr: float,
    on_step: Callable[[float], None] = lambda loss: None,
) -> tuple[list[float], float]:
    """Train ``model.vision_tower`` in place on the cells' labels, then start the connector from
    the probes (``init_connector``).

    Returns the losses and the probes' cell accuracy on fresh training scenes afterwards."""
    mx.random.seed(seed)  # the probes' init
    probe = VisionProbe(model.vision_tower, dims.vision_hidden)
    warm = optim.linear_schedule(lr / 10, lr, 10)
    schedule = optim.join_schedules([warm, optim.cosine_decay(lr, max(1, steps - 10), lr / 10)], [10])
    optimizer = optim.Adam(learning_rate=schedule, bias_correction=True)
    step_fn = nn.value_and_grad(probe, probe_loss)
    batches = prefetch(host_batches(processor, np.random.default_rng([seed, 3]), batch_size))
    losses = []
    for _ in range(steps):
        loss, grads = step_fn(probe, to_device(next(batches)))
        optimizer.update(probe, grads)
        mx.eval(loss, probe.parameters(), optimizer.state)
        losses.append(float(loss.item()))
        on_step(losses[-1])
    check = sample_batch(processor, np.random.default_rng([seed, 4]), 64)
    init_connector(model, probe, processor, check["pixel_values"])
    return losses, probe_accuracy(probe, check)


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
