"""[pool] How much of an image a model's own processor keeps, read from its config, so that decoding
can stop there: a 7000x7000 photo for a model that sees 1 MP need never be held at 49 MP.

A ``ProcessorLimit`` answers, for an upright image of a given size, the smallest size the decoded
image must keep so that the processor still resizes *down* to what it would have made of the
original. An image at or under that size reaches the processor unchanged (so parity with mlx-vlm
holds exactly); a larger one is shrunk by a whole factor, never below it. A family whose resize we
cannot bound from its config gets no limit: its images are decoded whole, as before.

The rules are here; which one a family's processor follows is its model adapter's fact
(``ModelAdapter.processor_limit``), which the engine hands to ``PromptBuilder.for_processor``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

LOW_DETAIL = 512  # OpenAI's detail: low is one 512x512 view of the image
LOW_SOFT_TOKENS = 70  # Gemma 4's smallest soft-token budget (its processors take 70, 140, 280, 560, 1120)


@dataclass(slots=True, frozen=True)
class ProcessorLimit:
    """The processor's resize rules; an image must keep what the largest of them needs.

    - ``area``: scaled, aspect kept, to at most this many pixels (Qwen2/2.5/3-VL, Qwen3.5, Gemma 4);
    - ``longest_edge``: scaled so its longest edge is this (Pixtral, Mistral 3, SmolVLM);
    - ``shortest_edge``: scaled so its shortest edge is this, then cropped (CLIP: LLaVA);
    - ``fixed``: resized to exactly this ``(width, height)`` (Gemma 3, PaliGemma);
    - ``boxes``: fitted, aspect kept, into one of these ``(width, height)`` (LLaVA-NeXT's grid);
    - ``tiles``: LFM2-VL's tile grid (see ``TileGrid``).
    """

    family: str
    area: int | None = None
    longest_edge: int | None = None
    shortest_edge: int | None = None
    fixed: tuple[int, int] | None = None
    boxes: tuple[tuple[int, int], ...] = ()
    tiles: TileGrid | None = None
    takes_pixel_kwargs: bool = False  # its processor takes min_pixels/max_pixels per call (Qwen's)
    # ``detail: low``: fewer pixels give fewer image tokens (the image is shrunk to ``LOW_DETAIL``), or
    # the processor takes a smaller soft-token budget per call (Gemma 4's ``max_soft_tokens``)
    shrinks: bool = False
    soft_tokens: int | None = None

    def low_detail(self, image: Image.Image) -> Image.Image:
        """An image for ``detail: low``: fitted, aspect kept, into OpenAI's 512x512 where that means
        fewer tokens here; as it came elsewhere."""
        if not self.shrinks or (image.width <= LOW_DETAIL and image.height <= LOW_DETAIL):
            return image
        scale = LOW_DETAIL / max(image.width, image.height)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        return image.resize(size, Image.Resampling.BICUBIC)

    def low_detail_kwargs(self) -> dict[str, int]:
        """The processor's per-call budget for a request whose every image is ``detail: low``."""
        if self.soft_tokens is not None and self.soft_tokens > LOW_SOFT_TOKENS:
            return {"max_soft_tokens": LOW_SOFT_TOKENS}
        return {}

    def keeps(self, width: int, height: int) -> tuple[float, float]:
        """The smallest ``(width, height)`` an upright ``width x height`` image may be shrunk to."""
        scales = []
        if self.area:
            scales.append(math.sqrt(self.area / (width * height)))
        if self.longest_edge:
            scales.append(self.longest_edge / max(width, height))
        if self.shortest_edge:
            scales.append(self.shortest_edge / min(width, height))
        scales.extend(min(w / width, h / height) for w, h in self.boxes)
        scale = max(scales, default=0.0)
        need_w, need_h = width * scale, height * scale
        boxes = ([self.fixed] if self.fixed else []) + ([self.tiles.keeps(width, height)] if self.tiles else [])
        for box_w, box_h in boxes:
            need_w, need_h = max(need_w, box_w), max(need_h, box_h)
        return need_w, need_h

    def reduction(self, width: int, height: int) -> int:
        """The largest whole factor that shrinks the image no further than ``keeps`` allows (1: none).
        Pillow rounds a reduced size up, so ``width // factor`` is the least it can be."""
        need_w, need_h = self.keeps(width, height)
        if need_w <= 0 or need_h <= 0:
            return 1
        return max(1, min(int(width // need_w), int(height // need_h)))


def limit_of(processor: Any, rule: Callable[[Any], ProcessorLimit | None]) -> ProcessorLimit | None:
    """``rule`` (one of the functions below, the model adapter's choice) read from the processor's image
    processor; None where it has none, does not resize, or its config lacks what the rule reads."""
    ip = getattr(processor, "image_processor", None)
    if ip is None or getattr(ip, "do_resize", True) is False:
        return None
    try:
        return rule(ip)
    except (AttributeError, TypeError, ValueError):
        return None


def sized_limit(ip: Any, shrinks: bool = True) -> ProcessorLimit | None:
    """By the processor's size fields: Qwen's smart_resize (``max_pixels`` and ``merge_size``), else a
    longest edge, a shortest edge or a fixed size. ``shrinks``: whether a processor that scales to its
    longest edge makes fewer tokens of fewer pixels (Pixtral's, Mistral 3's; not SmolVLM's, which scales up)."""
    kind = type(ip).__name__
    if getattr(ip, "max_pixels", None) and getattr(ip, "merge_size", None):
        return ProcessorLimit(kind, area=int(ip.max_pixels), takes_pixel_kwargs=True, shrinks=True)
    size = getattr(ip, "size", None)
    longest, shortest = _field(size, "longest_edge"), _field(size, "shortest_edge")
    height, width = _field(size, "height"), _field(size, "width")
    if longest:
        return ProcessorLimit(kind, longest_edge=longest, shrinks=shrinks)
    if shortest:
        return ProcessorLimit(kind, shortest_edge=shortest)
    if height and width:
        return ProcessorLimit(kind, fixed=(width, height))
    return None


def gemma4_limit(ip: Any) -> ProcessorLimit:
    """Gemma 4: resized, aspect kept, to at most ``max_soft_tokens`` pooled patches, a budget a request
    may lower (``detail: low``)."""
    patches = int(ip.max_soft_tokens) * int(ip.pooling_kernel_size) ** 2
    return ProcessorLimit(type(ip).__name__, area=patches * int(ip.patch_size) ** 2, soft_tokens=int(ip.max_soft_tokens))


def llava_next_limit(ip: Any) -> ProcessorLimit:
    """LLaVA-NeXT: the CLIP view (its shortest edge) and the anyres grid, fitted into one of its pinpoints."""
    boxes = tuple((int(w), int(h)) for h, w in ip.image_grid_pinpoints)
    return ProcessorLimit(type(ip).__name__, shortest_edge=_field(ip.size, "shortest_edge"), boxes=boxes)


def lfm2_limit(ip: Any) -> ProcessorLimit:
    """LFM2-VL: one view smart-resized to at most ``max_image_tokens`` tokens or, for a large image with
    splitting on, a grid of ``tile_size`` tiles (the image resized to exactly the grid) plus that view."""
    unit = int(ip.encoder_patch_size) * int(ip.downsample_factor)
    area = int(ip.max_image_tokens) * unit * unit
    if not getattr(ip, "do_image_splitting", False):
        return ProcessorLimit(type(ip).__name__, area=area, shrinks=True)
    grid = TileGrid(int(ip.tile_size), int(ip.min_tiles), int(ip.max_tiles), area * float(ip.max_pixels_tolerance))
    return ProcessorLimit(type(ip).__name__, area=area, tiles=grid, shrinks=True)


@dataclass(slots=True, frozen=True)
class TileGrid:
    """LFM2-VL's split (mlx-vlm's ``processing_lfm2_vl``): an image over ``large`` pixels is resized to
    the grid of ``min_tiles..max_tiles`` tiles whose shape is closest to its own. A shrunk image must
    keep that grid's size, and stay over ``large`` so that it is still split."""

    tile: int
    min_tiles: int
    max_tiles: int
    large: float

    def keeps(self, width: int, height: int) -> tuple[float, float]:
        if width * height <= self.large:
            return float(width), float(height)  # not split, and never shrunk: as it came
        grids = [(w, h) for w in range(1, self.max_tiles + 1) for h in range(1, self.max_tiles + 1)
                 if self.min_tiles <= w * h <= self.max_tiles]
        w, h = min(grids, key=lambda g: (abs(width / height - g[0] / g[1]), -g[0] * g[1]))
        over = math.sqrt(2 * self.large / (width * height))  # twice the threshold: rounding never crosses it
        return max(w * self.tile, width * over), max(h * self.tile, height * over)


def _field(size: Any, key: str) -> int | None:
    """A size entry from a dict or a transformers ``SizeDict``; None when absent or empty."""
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None
