"""[any] Seeded synthetic scenes for the demo model: shapes, colours, layouts, captions, Q&A.

A scene is a 3 x 3 grid of cells with 1-3 shapes of distinct kinds and distinct colours in
distinct cells, so every question about one shape has one answer. The grid matches what the
model sees: a square image becomes 3 x 3 soft tokens, one per cell. Each shape has its own
size and its own offset inside its cell. Shapes are listed in reading order (top row first,
left to right), and that is the order of the caption:

    one shape     "A red circle."
    two shapes    "A red circle above a blue square."          (different rows)
                  "A green star to the left of a red square."  (same row)
    three shapes  "A red circle, a blue square and a green triangle."

Held out: every (shape, colour) pair is kept out of training in one cell, 20 of the 180
(shape, colour, cell) combinations. Evaluation uses only scenes that show at least one of them.
"""

from __future__ import annotations

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
    """One shape in grid cell ``cell`` (row-major); ``size`` is its width as a fraction of the
    cell, ``dx``/``dy`` its centre's offset from the cell's centre, also in cells."""

    kind: str
    colour: str
    cell: int
    size: float = 0.8
    dx: float = 0.0
    dy: float = 0.0
    angle: float = 0.0  # degrees; small, so a triangle still points up

    @property
    def row(self) -> int:
        return self.cell // GRID

    @property
    def column(self) -> int:
        return self.cell % GRID

    @property
    def x(self) -> float:
        """Centre, as a fraction of the image side (y grows downwards)."""
        return (self.column + 0.5 + self.dx) / GRID

    @property
    def y(self) -> float:
        return (self.row + 0.5 + self.dy) / GRID

    @property
    def phrase(self) -> str:
        return f"a {self.colour} {self.kind}"


@dataclass(frozen=True, slots=True)
class Scene:
    """The content of one image; ``shapes`` in any order, ``ordered`` in caption order."""

    shapes: tuple[Shape, ...]

    def __post_init__(self) -> None:
        cells = [s.cell for s in self.shapes]
        if not 1 <= len(cells) <= 3 or len(set(cells)) != len(cells) or not all(0 <= c < CELLS for c in cells):
            raise ValueError(f"a scene has 1-3 shapes in distinct cells of the {GRID}x{GRID} grid: {cells}")
        if len({s.kind for s in self.shapes}) != len(cells) or len({s.colour for s in self.shapes}) != len(cells):
            raise ValueError("the shapes of a scene have distinct kinds and distinct colours")

    @property
    def ordered(self) -> tuple[Shape, ...]:
        return tuple(sorted(self.shapes, key=lambda s: s.cell))

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
        """Whether the scene shows a (shape, colour, cell) combination training never sees."""
        return any((s.kind, s.colour, s.cell) in HELD_OUT_TRIPLES for s in self.shapes)


def relation(first: Shape, second: Shape) -> str:
    """How a caption relates ``first`` to ``second``, the next shape in reading order."""
    if first.cell > second.cell:
        raise ValueError("the first shape comes first in reading order")
    return "to the left of" if first.row == second.row else "above"


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


def _shape(rng: np.random.Generator, kind: str, colour: str, cell: int) -> Shape:
    size = float(rng.uniform(*SIZE_RANGE))
    slack = max(0.0, (1 - size) / 2 - CELL_MARGIN)
    dx, dy = (float(rng.uniform(-slack, slack)) for _ in range(2))
    tilt = {"circle": 0.0, "square": 6.0, "triangle": 10.0, "star": 12.0}[kind]
    return Shape(kind, colour, cell, size, dx, dy, float(rng.uniform(-tilt, tilt)))
