"""Drawings made another way than the demo model's training pictures: the third held-out set.

Training draws with Pillow (``vlmserve/testing/demo/render.py``). These are rasterized here with
numpy instead: each pixel is inside or outside by geometry (distance to a centre, half-planes,
a point-in-polygon test), at 4x resolution, then averaged down, so edges are anti-aliased the way
a drawing program's are. The colours are named web colours, not training's palette; sizes are
50-110 px on mostly 224 x 224 canvases, as a newcomer would draw; outlines are 3-8 px wide.

``drawings()`` is a fixed list (seeded); ``eval-demo`` loads this file to score a model on it
(set 3 of the model card).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

SHAPES = ("circle", "square", "triangle", "star")
WEB_COLOURS = {
    "red": ((255, 0, 0), (200, 0, 0), (220, 20, 60), (178, 34, 34)),
    "green": ((0, 128, 0), (0, 200, 0), (34, 139, 34), (50, 205, 50)),
    "blue": ((0, 0, 255), (0, 0, 160), (65, 105, 225), (30, 144, 255)),
    "yellow": ((255, 255, 0), (255, 215, 0), (240, 230, 20), (250, 200, 0)),
    "purple": ((128, 0, 128), (148, 0, 211), (153, 50, 204), (128, 0, 255)),
}
PAPERS = ((255, 255, 255), (255, 255, 255), (250, 248, 240), (238, 238, 238))
SUPERSAMPLE = 4


@dataclass(frozen=True)
class Figure:
    kind: str
    colour: str
    cx: float  # centre, px
    cy: float
    size: float  # width, px
    line: int = 0  # outline width in px; 0 = filled


@dataclass(frozen=True)
class Drawing:
    """A picture and what it shows, in the order a caption names it (top first, else left first)."""

    name: str
    image: Image.Image
    figures: tuple[Figure, ...]

    @property
    def named(self) -> list[tuple[str, str]]:
        return [(f.colour, f.kind) for f in self.figures]


def drawings(seed: int = 2026) -> list[Drawing]:
    """120 drawings: every shape in every colour four times alone, then 40 pairs side by side or
    one above the other."""
    rng = np.random.default_rng(seed)
    out = []
    for repeat in range(4):
        for kind in SHAPES:
            for colour in WEB_COLOURS:
                width, height = (224, 224) if repeat < 3 else ((320, 240), (200, 300))[int(rng.integers(2))]
                size = float(rng.uniform(50, 110))
                cx = float(rng.uniform(size / 2 + 4, width - size / 2 - 4))
                cy = float(rng.uniform(size / 2 + 4, height - size / 2 - 4))
                figure = Figure(kind, colour, cx, cy, size, _line(rng))
                out.append(_draw(f"{colour}-{kind}-{repeat}", (width, height), (figure,), rng))
    for i in range(40):
        kinds = rng.permutation(len(SHAPES))[:2]
        colours = rng.permutation(len(WEB_COLOURS))[:2]
        names = list(WEB_COLOURS)
        size = float(rng.uniform(50, 80))
        level = float(rng.uniform(size / 2 + 10, 224 - size / 2 - 10))
        first, second = (float(rng.uniform(size / 2 + 6, 112 - size / 2 - 5)), float(rng.uniform(112 + size / 2 + 5, 218 - size / 2)))
        if i % 2:  # side by side, centres level
            spots = [(first, level), (second, level)]
        else:  # one above the other, a little askew
            shift = float(np.clip(level + rng.uniform(-20, 20), size / 2 + 4, 220 - size / 2))
            spots = [(level, first), (shift, second)]
        figures = tuple(Figure(SHAPES[k], names[c], x, y, size, _line(rng)) for k, c, (x, y) in zip(kinds, colours, spots))
        out.append(_draw(f"pair-{i}", (224, 224), figures, rng))
    return out


def _line(rng: np.random.Generator) -> int:
    return int(rng.integers(3, 9)) if rng.random() < 0.3 else 0


def _draw(name: str, canvas: tuple[int, int], figures: tuple[Figure, ...], rng: np.random.Generator) -> Drawing:
    width, height = canvas
    paper = np.array(PAPERS[int(rng.integers(len(PAPERS)))], dtype=np.float32)
    pixels = np.broadcast_to(paper, (height, width, 3)).copy()
    s = SUPERSAMPLE
    ys, xs = np.mgrid[0:height * s, 0:width * s].astype(np.float32)
    xs, ys = (xs + 0.5) / s, (ys + 0.5) / s
    for figure in figures:
        shades = WEB_COLOURS[figure.colour]
        colour = np.array(shades[int(rng.integers(len(shades)))], dtype=np.float32)
        inside = _inside(figure, xs, ys)
        if figure.line:
            inner = Figure(figure.kind, figure.colour, figure.cx, figure.cy, figure.size - 2 * figure.line)
            inside &= ~_inside(inner, xs, ys)
        coverage = inside.reshape(height, s, width, s).mean(axis=(1, 3))[..., None]
        pixels = pixels * (1 - coverage) + colour * coverage
    return Drawing(name, Image.fromarray(np.round(pixels).astype(np.uint8)), figures)


def _inside(figure: Figure, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    dx, dy, r = xs - figure.cx, ys - figure.cy, figure.size / 2
    if figure.kind == "circle":
        return dx * dx + dy * dy <= r * r
    if figure.kind == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if figure.kind == "triangle":  # equilateral, apex up, its base the full width
        h = r * math.sqrt(3)
        top = -h / 2
        return (dy <= h / 2) & (dy >= top + np.abs(dx) * math.sqrt(3))
    return _in_polygon(_star(figure.cx, figure.cy, r), xs, ys)


def _star(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    return [
        (cx + (r if i % 2 == 0 else 0.42 * r) * math.cos(math.pi * (i / 5 - 0.5)),
         cy + (r if i % 2 == 0 else 0.42 * r) * math.sin(math.pi * (i / 5 - 0.5)))
        for i in range(10)
    ]  # fmt: skip


def _in_polygon(points: list[tuple[float, float]], xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Even-odd rule, one edge at a time over the whole pixel grid."""
    inside = np.zeros(xs.shape, dtype=bool)
    for (x1, y1), (x2, y2) in zip(points, points[1:] + points[:1]):
        crosses = (y1 > ys) != (y2 > ys)
        at = (x2 - x1) * (ys - y1) / ((y2 - y1) or 1e-9) + x1
        inside ^= crosses & (xs < at)
    return inside


def hand_drawn(kind: str, rgb: tuple[int, int, int], canvas: tuple[int, int] = (320, 240), seed: int = 7,
               filled: bool = True) -> Image.Image:  # fmt: skip
    """A shape as a person draws it in a paint program: the outline traced with a round brush, by a
    hand that wobbles, corners a little rounded, then (``filled``) the bucket tool inside.
    ``assets/drawing.png`` is ``hand_drawn("triangle", (40, 90, 220))``."""
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    width, height = canvas
    cx, cy, r = width * 0.52, height * 0.5, min(width, height) * 0.36
    corners = {
        "triangle": [(0.0, -1.0), (0.95, 0.75), (-0.95, 0.75)],
        "square": [(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)],
        "star": [((1 if i % 2 == 0 else 0.45) * math.cos(math.pi * (i / 5 - 0.5)),
                  (1 if i % 2 == 0 else 0.45) * math.sin(math.pi * (i / 5 - 0.5))) for i in range(10)],
    }.get(kind)  # fmt: skip
    if corners is None:  # a circle: one loop, drawn a little oval
        path = [(math.cos(a) * 1.04, math.sin(a) * 0.96) for a in np.linspace(0, 2 * math.pi, 90)]
    else:
        path = []
        for (x1, y1), (x2, y2) in zip(corners, corners[1:] + corners[:1]):
            path += [(x1 + (x2 - x1) * t, y1 + (y2 - y1) * t) for t in np.linspace(0, 1, 30, endpoint=False)]
    wobble = np.cumsum(rng.normal(0, 0.006, (len(path), 2)), axis=0)
    wobble -= np.linspace(0, 1, len(path))[:, None] * wobble[-1]  # the stroke ends where it began
    points = [(cx + (x + dx) * r, cy + (y + dy) * r) for (x, y), (dx, dy) in zip(path, wobble)]
    image = Image.new("RGB", canvas, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    if filled:
        draw.polygon(points, fill=rgb)
    brush = 4
    for x, y in points + points[:1]:
        draw.ellipse((x - brush, y - brush, x + brush, y + brush), fill=rgb)
    return image
