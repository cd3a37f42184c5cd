"""[any] Drawing scenes with Pillow, plus the appearance augmentations training uses.

Shapes are drawn without anti-aliasing on a canvas of varying size; the processor's bicubic
resize to the model's input size then smooths them, as it does any photo a user sends.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from vlmserve.testing.demo.scenes import GRID, Scene, Shape

RGB = tuple[int, int, int]

PALETTE: dict[str, RGB] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 180),
}
BACKGROUNDS: tuple[RGB, ...] = (
    (255, 255, 255), (245, 245, 240), (228, 228, 228), (225, 235, 245), (250, 240, 220), (232, 242, 232),
)  # fmt: skip
CANVAS_SIDES = (96, 120, 144, 192, 224, 256)


@dataclass(frozen=True, slots=True)
class Style:
    """How a scene looks: canvas, background, colour jitter, noise and JPEG re-encoding."""

    side: int = 224
    background: RGB = (245, 245, 240)
    jitter: int = 0  # seed of the per-shape colour jitter; 0 = exact palette colours
    jitter_amount: int = 0
    noise: float = 0.0  # std of Gaussian pixel noise, in 0-255 units
    jpeg_quality: int = 0  # 0 = no JPEG round trip


def sample_style(rng: np.random.Generator) -> Style:
    base = np.array(BACKGROUNDS[rng.integers(len(BACKGROUNDS))])
    background = np.clip(base + rng.integers(-8, 9, 3), 0, 255)
    return Style(
        side=int(CANVAS_SIDES[rng.integers(len(CANVAS_SIDES))]),
        background=(int(background[0]), int(background[1]), int(background[2])),
        jitter=int(rng.integers(1, 2**31)),
        jitter_amount=int(rng.integers(0, 26)),
        noise=float(rng.uniform(2, 10)) if rng.random() < 0.5 else 0.0,
        jpeg_quality=int(rng.integers(35, 91)) if rng.random() < 0.3 else 0,
    )


def render(scene: Scene, style: Style = Style()) -> Image.Image:
    """The scene as an RGB image; the same scene and style always give the same pixels."""
    image = Image.new("RGB", (style.side, style.side), style.background)
    draw = ImageDraw.Draw(image)
    jitter = np.random.default_rng(style.jitter)
    for shape in scene.shapes:
        delta = jitter.integers(-style.jitter_amount, style.jitter_amount + 1, 3) if style.jitter_amount else 0
        fill = np.clip(np.array(PALETTE[shape.colour]) + delta, 0, 255)
        _draw(draw, shape, style.side, (int(fill[0]), int(fill[1]), int(fill[2])))
    if style.noise:
        image = _add_noise(image, style.noise, style.jitter)
    if style.jpeg_quality:
        image = _jpeg(image, style.jpeg_quality)
    return image


def _draw(draw: ImageDraw.ImageDraw, shape: Shape, side: int, fill: RGB | int) -> None:
    cx, cy, r = shape.x * side, shape.y * side, shape.size * side / GRID / 2
    if shape.kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        return
    if shape.kind == "square":
        corners = [(-r, -r), (r, -r), (r, r), (-r, r)]
    elif shape.kind == "triangle":
        corners = [(0.0, -r), (r, r), (-r, r)]  # fills its box and points up, like a drawn one
    else:
        corners = _star_corners(r)
    draw.polygon(_turn(corners, shape.angle, cx, cy), fill=fill)


def _star_corners(r: float) -> list[tuple[float, float]]:
    points = []
    for i in range(10):
        radius = r if i % 2 == 0 else 0.45 * r
        a = math.pi * (i / 5 - 0.5)  # first point straight up
        points.append((radius * math.cos(a), radius * math.sin(a)))
    return points


def _turn(points: list[tuple[float, float]], degrees: float, cx: float, cy: float) -> list[tuple[float, float]]:
    a = math.radians(degrees)
    cos, sin = math.cos(a), math.sin(a)
    return [(cx + x * cos - y * sin, cy + x * sin + y * cos) for x, y in points]


def _add_noise(image: Image.Image, std: float, seed: int) -> Image.Image:
    pixels = np.asarray(image, dtype=np.float32)
    noise = np.random.default_rng(seed + 1).normal(0, std, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def _jpeg(image: Image.Image, quality: int) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB")
