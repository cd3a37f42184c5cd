"""[any] Seeded synthetic scenes for the demo model: shapes, colours, layouts, captions, Q&A.

A scene has 1-3 shapes of distinct kinds and distinct colours, so every question about one
shape has one answer. A shape sits anywhere (its centre as fractions of the width and height);
the grid scenes sampled here keep each in its own cell of a 3 x 3 grid, which is what the demo
model was trained on (a square image becomes 3 x 3 soft tokens, one per cell); placements.py
samples free-position scenes. Shapes are listed in reading order, rows top to bottom and left
to right within a row, and that is the order of the caption:

    one shape     "A red circle."
    two shapes    "A red circle above a blue square."          (different rows)
                  "A green star to the left of a red square."  (one row)
    three shapes  "A red circle, a blue square and a green triangle."

Held out: every (shape, colour) pair is kept out of training in one region (a cell of the 3 x 3
grid), 20 of the 180 (shape, colour, region) combinations. Evaluation uses only scenes that
show at least one of them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = ("red", "green", "blue", "yellow", "purple")
NUMBERS = ("Zero", "One", "Two", "Three")
GRID = 3  # cells per side
CELLS = GRID * GRID
ROW_NAMES = ("top", "middle", "bottom")
COLUMN_NAMES = ("left", "centre", "right")


def _held_out_cell(kind: int, colour: int) -> int:
    # Spreads the 20 pairs over all 9 cells, 2-3 each; every cell keeps every kind and colour.
    return (kind * 5 + colour * 2) % CELLS


# (kind, colour, cell): combinations training never shows.
HELD_OUT_TRIPLES = frozenset(
    (kind, colour, _held_out_cell(k, c)) for k, kind in enumerate(SHAPES) for c, colour in enumerate(COLOURS)
)

Split = Literal["train", "held_out"]


@dataclass(frozen=True, slots=True)
class Shape:
    """One shape: its centre ``x``, ``y`` as fractions of the canvas's width and height (y grows
    downwards), ``size`` its width as a fraction of the canvas's shorter side."""

    kind: str
    colour: str
    x: float
    y: float
    size: float = 0.8 / GRID
    angle: float = 0.0  # degrees; small, so a triangle still points up

    @property
    def region(self) -> int:
        """The cell of the 3 x 3 grid (row-major) the centre falls in: where held-out pairs live."""
        return min(int(self.y * GRID), GRID - 1) * GRID + min(int(self.x * GRID), GRID - 1)

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.kind}"


def grid_shape(
    kind: str, colour: str, cell: int, size: float = 0.8, dx: float = 0.0, dy: float = 0.0, angle: float = 0.0
) -> Shape:
    """A shape in cell ``cell`` of the 3 x 3 grid (row-major): ``size`` is its width as a fraction
    of the cell, ``dx``/``dy`` its centre's offset from the cell's centre, also in cells."""
    if not 0 <= cell < CELLS:
        raise ValueError(f"the grid has cells 0-{CELLS - 1}: {cell}")
    row, column = divmod(cell, GRID)
    return Shape(kind, colour, (column + 0.5 + dx) / GRID, (row + 0.5 + dy) / GRID, size / GRID, angle)


@dataclass(frozen=True, slots=True)
class Scene:
    """The content of one image; ``shapes`` in any order, ``ordered`` in caption order."""

    shapes: tuple[Shape, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.shapes) <= 3:
            raise ValueError(f"a scene has 1-3 shapes: {len(self.shapes)}")
        n = len(self.shapes)
        if len({s.kind for s in self.shapes}) != n or len({s.colour for s in self.shapes}) != n:
            raise ValueError("the shapes of a scene have distinct kinds and distinct colours")
        for a, b in itertools.combinations(self.shapes, 2):
            if ROW_SPREAD < abs(a.y - b.y) < ROW_GAP or (abs(a.y - b.y) <= ROW_SPREAD and a.x == b.x):
                raise ValueError(f"{a.phrase} and {b.phrase}: neither clearly in one row nor in two")

    @property
    def ordered(self) -> tuple[Shape, ...]:
        """Reading order: rows top to bottom, left to right within a row (see ``rows``)."""
        return tuple(shape for row in rows(self.shapes) for shape in sorted(row, key=lambda s: s.x))

    @property
    def caption(self) -> str:
        shapes = self.ordered
        phrases = [s.phrase for s in shapes]
        if len(phrases) == 2:
            text = f"{phrases[0]} {relation(*shapes)} {phrases[1]}"
        elif len(phrases) == 3:
            text = f"{phrases[0]}, {phrases[1]} and {phrases[2]}"
        else:
            text = phrases[0]
        return text[0].upper() + text[1:] + "."

    def colour_of(self, kind: str) -> str | None:
        return next((s.colour for s in self.shapes if s.kind == kind), None)

    @property
    def held_out(self) -> bool:
        """Whether the scene shows a (shape, colour, region) combination training never sees."""
        return any((s.kind, s.colour, s.region) in HELD_OUT_TRIPLES for s in self.shapes)


# Two shapes are in one row when their centres are at most ROW_SPREAD of the height apart, and
# in different rows from ROW_GAP on; scenes in between are refused, so every caption is clear.
# The grid's scenes fit: one row spreads at most 0.113, two rows are at least 0.22 apart.
ROW_SPREAD = 0.12
ROW_GAP = 0.2


def rows(shapes: tuple[Shape, ...]) -> list[list[Shape]]:
    """The shapes grouped into rows, top row first."""
    grouped: list[list[Shape]] = []
    for shape in sorted(shapes, key=lambda s: s.y):
        if grouped and shape.y - grouped[-1][0].y <= ROW_SPREAD:
            grouped[-1].append(shape)
        else:
            grouped.append([shape])
    return grouped


def relation(first: Shape, second: Shape) -> str:
    """How a caption relates ``first`` to ``second``, the next shape in reading order."""
    if abs(first.y - second.y) <= ROW_SPREAD:
        if first.x > second.x:
            raise ValueError("the first shape comes first in reading order")
        return "to the left of"
    if first.y > second.y:
        raise ValueError("the first shape comes first in reading order")
    return "above"


# -- questions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Question:
    """A question about a scene in canonical wording, with its one correct answer.

    Answers about one shape first say what the picture shows (its caption), then answer:
    "A red circle above a blue square. The square is blue." or "... The star is not there."
    A small model learns to find a
    shape by name in its own words (copying, which transformers learn fast) long before it
    learns to find it among the image's soft tokens: asked directly, it stayed at chance
    within the training budget while its captions were right.
    """

    kind: Literal["count", "colour", "exists"]
    shape: str | None
    answer: str


def count_question(scene: Scene) -> Question:
    return Question("count", None, NUMBERS[len(scene.shapes)] + ".")


def colour_question(scene: Scene, kind: str) -> Question:
    colour = scene.colour_of(kind)
    if colour is None:
        raise ValueError(f"no {kind} in the scene")
    return Question("colour", kind, f"{scene.caption} The {kind} is {colour}.")


def exists_question(scene: Scene, kind: str) -> Question:
    # "... The star is there." rather than "Yes.": the word asked about comes right before the
    # decision, as in a colour answer; a bare "Yes."/"No." after the caption stayed at chance
    return Question("exists", kind, f"{scene.caption} The {kind} is {'there' if scene.colour_of(kind) else 'not there'}.")


def sample_question(rng: np.random.Generator, scene: Scene) -> Question:
    """Count, colour of a present shape, or existence of a shape present or absent (even odds)."""
    pick = rng.integers(3)
    if pick == 0:
        return count_question(scene)
    present = [s.kind for s in scene.shapes]
    if pick == 1:
        return colour_question(scene, present[rng.integers(len(present))])
    absent = [k for k in SHAPES if k not in present]
    pool = present if rng.random() < 0.5 or not absent else absent
    return exists_question(scene, pool[rng.integers(len(pool))])


# -- sampling --------------------------------------------------------------------------

SIZE_RANGE = (0.6, 0.95)  # of a cell
CELL_MARGIN = 0.03  # a shape keeps this far (in cells) from its cell's border


def sample_scene(rng: np.random.Generator, split: Split = "train") -> Scene:
    """A random scene of the split: training scenes never show a held-out combination."""
    want_held_out = split == "held_out"
    while True:
        scene = _random_scene(rng)
        if scene.held_out == want_held_out:
            return scene


def _random_scene(rng: np.random.Generator) -> Scene:
    n = int(rng.choice([1, 2, 3], p=[0.25, 0.4, 0.35]))
    kinds = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:n]]
    colours = [COLOURS[i] for i in rng.permutation(len(COLOURS))[:n]]
    cells = [int(c) for c in rng.permutation(CELLS)[:n]]
    return Scene(tuple(_shape(rng, *spec) for spec in zip(kinds, colours, cells)))


TILT = {"circle": 0.0, "square": 6.0, "triangle": 10.0, "star": 12.0}  # largest rotation drawn, degrees


def _shape(rng: np.random.Generator, kind: str, colour: str, cell: int) -> Shape:
    size = float(rng.uniform(*SIZE_RANGE))
    slack = max(0.0, (1 - size) / 2 - CELL_MARGIN)
    dx, dy = (float(rng.uniform(-slack, slack)) for _ in range(2))
    return grid_shape(kind, colour, cell, size, dx, dy, float(rng.uniform(-TILT[kind], TILT[kind])))
