"""[any] Free-position scenes: 1-3 shapes anywhere on a canvas of any aspect ratio, any size.

Where the grid scenes (scenes.py) keep each shape in its own cell of a 3 x 3 grid, these place
shapes anywhere: one shape may be small or fill the canvas, several sit in one, two or three
rows. Captions still say the shapes in reading order, and every scene is clear about it: shapes
in one row have centres at most ``SAME_ROW`` of the height apart, shapes in different rows at
least ``NEXT_ROW`` (well inside the caption's own thresholds, ``scenes.ROW_SPREAD`` and
``ROW_GAP``). Shapes in one row stand at least ``SAME_ROW_DX`` of the width apart. Overlaps are
allowed, rarely (``OVERLAP``), and never hide more than a sliver of a shape.

Held out, as for the grid: each (shape, colour) pair never has its centre in one region of the
canvas (the same 3 x 3 regions, ``scenes.HELD_OUT_TRIPLES``).
"""

from __future__ import annotations

import math

import numpy as np

from vlmserve.testing.demo.scenes import COLOURS, SHAPES, TILT, Scene, Shape, Split

SAME_ROW = 0.06  # most a row's centres spread, as a fraction of the height
NEXT_ROW = 0.3  # least distance between rows' centres (less the spread: 0.24 between shapes)
SAME_ROW_DX = 0.16  # least distance between two shapes of one row, as a fraction of the width
MIN_SIZE = 0.18  # of the canvas's shorter side
MAX_SIZE = {1: 0.9, 2: 0.55, 3: 0.42}  # by number of shapes
OVERLAP = 0.05  # share of scenes whose shapes may overlap a little
MARGIN = 0.01  # shapes keep inside the canvas by this much (of the shorter side)
ROW_PATTERNS = {1: ([1],), 2: ([2], [1, 1]), 3: ([3], [2, 1], [1, 2], [1, 1, 1])}
PATTERN_ODDS = {1: [1.0], 2: [0.45, 0.55], 3: [0.2, 0.25, 0.25, 0.3]}
ASPECTS = (0.45, 2.2)  # widest range of width / height drawn


def sample_aspect(rng: np.random.Generator) -> float:
    """Half the canvases square, the rest log-uniform between 1:2.2 and 2.2:1."""
    if rng.random() < 0.5:
        return 1.0
    return float(math.exp(rng.uniform(math.log(ASPECTS[0]), math.log(ASPECTS[1]))))


def sample_free_scene(
    rng: np.random.Generator, split: Split = "train", aspect: float = 1.0, shapes: int | None = None
) -> Scene:
    """A random free-position scene of the split for a canvas of ``aspect`` (width / height), of
    ``shapes`` shapes (None: 1-3 at random)."""
    want_held_out = split == "held_out"
    while True:
        scene = _free_scene(rng, aspect, shapes)
        if scene is not None and scene.held_out == want_held_out:
            return scene


def _free_scene(rng: np.random.Generator, aspect: float, shapes: int | None = None) -> Scene | None:
    n = shapes or int(rng.choice([1, 2, 3], p=[0.3, 0.35, 0.35]))
    pattern = ROW_PATTERNS[n][int(rng.choice(len(ROW_PATTERNS[n]), p=PATTERN_ODDS[n]))]
    kinds = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:n]]
    colours = [COLOURS[i] for i in rng.permutation(len(COLOURS))[:n]]
    overlap = rng.random() < OVERLAP
    width, height = (aspect, 1.0) if aspect >= 1 else (1.0, 1 / aspect)  # in shorter sides
    for _ in range(50):
        sizes = np.exp(rng.uniform(math.log(MIN_SIZE), math.log(MAX_SIZE[n]), n))
        # centres drawn where the shape fits, so large shapes are not lost to rejections
        x_room = np.minimum((sizes / 2 + MARGIN) / width, 0.5)
        y_room = float(min(0.5, (sizes.max() / 2 + MARGIN) / height))
        row_ys = np.sort(rng.uniform(y_room, 1 - y_room, len(pattern)))
        if len(pattern) > 1 and np.diff(row_ys).min() < NEXT_ROW:
            continue
        ys = np.concatenate([y + rng.uniform(-SAME_ROW / 2, SAME_ROW / 2, k) for y, k in zip(row_ys, pattern)])
        row_of = np.repeat(np.arange(len(pattern)), pattern)
        xs = rng.uniform(x_room, 1 - x_room)
        if _fits(xs, ys, sizes, row_of, width, height, overlap):
            return Scene(tuple(
                Shape(kind, colour, float(x), float(y), float(size), float(rng.uniform(-TILT[kind], TILT[kind])))
                for kind, colour, x, y, size in zip(kinds, colours, xs, ys, sizes)
            ))  # fmt: skip
    return None


def _fits(
    xs: np.ndarray, ys: np.ndarray, sizes: np.ndarray, row_of: np.ndarray, width: float, height: float, overlap: bool
) -> bool:
    """Inside the canvas, rows clear, and apart (or, for an overlap scene, only a little over)."""
    radii = sizes / 2
    px, py = xs * width, ys * height
    if ((px - radii < MARGIN) | (px + radii > width - MARGIN) | (py - radii < MARGIN) | (py + radii > height - MARGIN)).any():
        return False
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            if row_of[i] == row_of[j] and abs(xs[i] - xs[j]) < SAME_ROW_DX:
                return False
            apart = math.hypot(px[i] - px[j], py[i] - py[j]) / (radii[i] + radii[j])
            if apart < (0.75 if overlap else 1.05):
                return False
    return True
