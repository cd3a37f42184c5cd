"""[any] Drawing scenes with Pillow, plus the appearance augmentations training uses.

Two looks. The classic one (the grid scenes' first renderer, kept for their evaluation): square
canvas, palette colours with a little jitter, filled polygons. The varied one: any canvas size
and aspect ratio, colours anywhere in their hue range, filled or outlined, drawn with Pillow's
own primitives (``ellipse``, ``rectangle``, ``regular_polygon``) or our polygons, now and then
drawn at twice the size and scaled down (anti-aliased), on white, tinted, gradient or noisy
backgrounds, sometimes through JPEG. The processor's bicubic resize then smooths every shape,
as it does any picture a user sends.
"""

from __future__ import annotations

import colorsys
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from vlmserve.testing.demo.scenes import Scene, Shape

RGB = tuple[int, int, int]

PALETTE: dict[str, RGB] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 180),
}
# hue ranges in degrees that each colour name covers in the varied look
HUES: dict[str, tuple[float, float]] = {
    "red": (-12, 8), "yellow": (44, 62), "green": (90, 150), "blue": (200, 245), "purple": (265, 305),
}  # fmt: skip
BACKGROUNDS: tuple[RGB, ...] = (
    (255, 255, 255), (245, 245, 240), (228, 228, 228), (225, 235, 245), (250, 240, 220), (232, 242, 232),
)  # fmt: skip
CANVAS_SIDES = (96, 120, 144, 192, 224, 256)


@dataclass(frozen=True, slots=True)
class Style:
    """How a scene looks: canvas, background, colours, noise, JPEG; ``varied`` picks the look."""

    side: int = 224  # the canvas's shorter side
    background: RGB = (245, 245, 240)
    jitter: int = 0  # seed of the per-shape variation; 0 = exact palette colours
    jitter_amount: int = 0
    noise: float = 0.0  # std of Gaussian pixel noise, in 0-255 units
    jpeg_quality: int = 0  # 0 = no JPEG round trip
    aspect: float = 1.0  # width / height
    varied: bool = False
    gradient: RGB | None = None  # the background fades to this colour (top to bottom or left to right)
    supersample: bool = False

    @property
    def size(self) -> tuple[int, int]:
        if self.aspect >= 1:
            return round(self.side * self.aspect), self.side
        return self.side, round(self.side / self.aspect)


def sample_style(rng: np.random.Generator) -> Style:
    """The classic look: square canvas, palette colours."""
    base = np.array(BACKGROUNDS[rng.integers(len(BACKGROUNDS))])
    background = np.clip(base + rng.integers(-8, 9, 3), 0, 255)
    return Style(
        side=int(CANVAS_SIDES[rng.integers(len(CANVAS_SIDES))]),
        background=_rgb(background),
        jitter=int(rng.integers(1, 2**31)),
        jitter_amount=int(rng.integers(0, 26)),
        noise=float(rng.uniform(2, 10)) if rng.random() < 0.5 else 0.0,
        jpeg_quality=int(rng.integers(35, 91)) if rng.random() < 0.3 else 0,
    )


def sample_varied_style(rng: np.random.Generator, aspect: float = 1.0) -> Style:
    """The varied look on a canvas of ``aspect``: its shorter side 96-320 px."""
    pick = rng.random()
    if pick < 0.35:
        background = np.full(3, 255)
    elif pick < 0.8:
        background = _light(rng)
    else:
        background = np.full(3, int(rng.integers(215, 256))) + rng.integers(-6, 7, 3)
    return Style(
        side=int(rng.integers(96, 321)),
        background=_rgb(background),
        jitter=int(rng.integers(1, 2**31)),
        noise=float(rng.uniform(2, 14)) if rng.random() < 0.3 else 0.0,
        jpeg_quality=int(rng.integers(30, 91)) if rng.random() < 0.3 else 0,
        aspect=aspect,
        varied=True,
        gradient=_rgb(_light(rng)) if rng.random() < 0.2 else None,
        supersample=rng.random() < 0.25,
    )


@dataclass(frozen=True, slots=True)
class Look:
    """How one shape is drawn: its colour, its outline's width in canvas px (0: filled), which
    primitive for a square or triangle (a draw in [0, 1): see ``_draw_look``) and how deep a
    star's notches go."""

    colour: RGB
    line: int = 0
    primitive: float = 1.0
    star_inner: float = 0.45


def looks(scene: Scene, style: Style) -> list[Look]:
    """Each shape's look, drawn from the style's seed: the same style always gives the same."""
    rng = np.random.default_rng(style.jitter)
    out = []
    for shape in scene.shapes:
        if not style.varied:
            amount = style.jitter_amount
            delta = rng.integers(-amount, amount + 1, 3) if amount else 0
            out.append(Look(_rgb(np.array(PALETTE[shape.colour]) + delta)))
            continue
        colour = varied_colour(rng, shape.colour) if rng.random() < 0.7 else PALETTE[shape.colour]
        diameter = shape.size * min(style.size)
        outline = rng.random() < 0.25 and diameter >= 24
        line = max(2, round(rng.uniform(0.06, 0.16) * diameter)) if outline else 0
        out.append(Look(colour, line, float(rng.random()), float(rng.uniform(0.38, 0.55))))
    return out


def render(scene: Scene, style: Style = Style()) -> Image.Image:
    """The scene as an RGB image; the same scene and style always give the same pixels."""
    scale = 2 if style.supersample else 1
    width, height = style.size
    image = _background(style, width * scale, height * scale)
    draw = ImageDraw.Draw(image)
    for shape, look in zip(scene.shapes, looks(scene, style)):
        _draw_look(draw, shape, look, width * scale, height * scale, scale)
    if scale > 1:
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    if style.noise:
        image = _add_noise(image, style.noise, style.jitter)
    if style.jpeg_quality:
        image = _jpeg(image, style.jpeg_quality)
    return image


def varied_colour(rng: np.random.Generator, colour: str) -> RGB:
    """Any shade a person would still call ``colour``."""
    low, high = HUES[colour]
    hue = (rng.uniform(low, high) % 360) / 360
    saturation = rng.uniform(0.55, 1.0)
    value = rng.uniform(0.75, 1.0) if colour == "yellow" else rng.uniform(0.45, 1.0)
    return _rgb(np.array(colorsys.hsv_to_rgb(hue, saturation, value)) * 255)


def _draw_look(draw: ImageDraw.ImageDraw, shape: Shape, look: Look, width: int, height: int, scale: float) -> None:
    """One shape on a ``width`` x ``height`` drawing, ``scale`` drawn px per canvas px."""
    line = max(1, round(look.line * scale)) if look.line else 0
    fill, outline = (None, look.colour) if line else (look.colour, None)
    cx, cy, r = shape.x * width, shape.y * height, shape.size * min(width, height) / 2
    if shape.kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=outline, width=line)
    elif shape.kind == "square" and look.primitive < 0.4:
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=outline, width=line)
    elif shape.kind in ("square", "triangle") and look.primitive < 0.7:
        # the polygon's circumscribed circle: a square's corners, a triangle's apex on it
        radius = r * math.sqrt(2) if shape.kind == "square" else r * 1.1
        draw.regular_polygon((cx, cy, radius), 4 if shape.kind == "square" else 3, shape.angle, fill, outline, line)
    else:
        _draw_polygon(draw, shape, cx, cy, r, fill, outline, line, look.star_inner)


def _draw_polygon(
    draw: ImageDraw.ImageDraw, shape: Shape, cx: float, cy: float, r: float, fill: RGB | int | None,
    outline: RGB | int | None, line: int, star_inner: float,
) -> None:  # fmt: skip
    if shape.kind == "square":
        corners = [(-r, -r), (r, -r), (r, r), (-r, r)]
    elif shape.kind == "triangle":
        corners = [(0.0, -r), (r, r), (-r, r)]  # fills its box and points up, like a drawn one
    else:
        corners = _star_corners(r, star_inner)
    draw.polygon(_turn(corners, shape.angle, cx, cy), fill=fill, outline=outline, width=line)


def _star_corners(r: float, inner: float) -> list[tuple[float, float]]:
    points = []
    for i in range(10):
        radius = r if i % 2 == 0 else inner * r
        a = math.pi * (i / 5 - 0.5)  # first point straight up
        points.append((radius * math.cos(a), radius * math.sin(a)))
    return points


def _turn(points: list[tuple[float, float]], degrees: float, cx: float, cy: float) -> list[tuple[float, float]]:
    a = math.radians(degrees)
    cos, sin = math.cos(a), math.sin(a)
    return [(cx + x * cos - y * sin, cy + x * sin + y * cos) for x, y in points]


def _background(style: Style, width: int, height: int) -> Image.Image:
    if style.gradient is None:
        return Image.new("RGB", (width, height), style.background)
    along = np.linspace(0, 1, height)[:, None, None] if style.jitter % 2 else np.linspace(0, 1, width)[None, :, None]
    start, end = np.array(style.background), np.array(style.gradient)
    pixels = np.broadcast_to(start + (end - start) * along, (height, width, 3))
    return Image.fromarray(np.round(pixels).astype(np.uint8))


def _light(rng: np.random.Generator) -> np.ndarray:
    """A pale tint of any hue."""
    return np.array(colorsys.hsv_to_rgb(rng.uniform(0, 1), rng.uniform(0.03, 0.18), rng.uniform(0.88, 1.0))) * 255


def _rgb(values: np.ndarray) -> RGB:
    clipped = np.clip(np.round(values), 0, 255).astype(int)
    return (int(clipped[0]), int(clipped[1]), int(clipped[2]))


def _add_noise(image: Image.Image, std: float, seed: int) -> Image.Image:
    pixels = np.asarray(image, dtype=np.float32)
    noise = np.random.default_rng(seed + 1).normal(0, std, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def _jpeg(image: Image.Image, quality: int) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB")
