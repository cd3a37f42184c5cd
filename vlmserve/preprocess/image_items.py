"""[pool] A prompt's processed pixel arrays, cut into one item per image, each with a strong hash.

The hash covers exactly what the vision tower will see: the processed pixels (so the processor's
resizing and normalization are in it) and the per-image layout arrays (Qwen's patch grid, Gemma 4's
patch positions), with their dtypes and shapes. Two images whose bytes differ in one pixel hash
apart; the same picture sent again in a later turn hashes the same.

How arrays split, read from their shapes:
- ``image_grid_thw`` ``[N, 3]`` (Qwen2-VL, Qwen2.5-VL, Qwen3.5...): ``pixel_values`` is every image's
  patches concatenated; image ``i`` has ``t*h*w`` of them;
- a tuple of ``pixel_values`` (Gemma 4 with images of different sizes): one entry per image;
- ``pixel_values`` ``[N, ...]`` (Gemma 3, LLaVA, Gemma 4 with equal sizes): row ``i``;
- anything else (SmolVLM's tiles, LLaVA-NeXT's patches, Pixtral's sizes): no items, no vision cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from vlmserve.engine.params import HostArray, ImageItem

_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids")


def image_items(arrays: Mapping[str, HostArray], num_images: int, num_tokens: int) -> tuple[ImageItem, ...]:
    """One item per image, or ``()`` where the arrays do not split per image by a rule above.
    Per-token arrays (``[1, num_tokens]``, such as ``mm_token_type_ids``) belong to the prompt."""
    pixels = arrays.get("pixel_values")
    if pixels is None or num_images == 0:
        return ()
    others = {k: v for k, v in arrays.items() if not (isinstance(v, np.ndarray) and v.shape == (1, num_tokens))}
    if set(others) - set(_IMAGE_KEYS):
        return ()  # an image array of a kind not known to split
    if "image_grid_thw" in arrays:
        per_image = _split_patches(arrays)
    elif isinstance(pixels, tuple):
        per_image = _split_tuples(others, num_images)
    else:
        per_image = _split_rows(others, num_images)
    if per_image is None:
        return ()
    return tuple(ImageItem(_hash(item), item) for item in per_image)


def _split_patches(arrays: Mapping[str, HostArray]) -> list[dict[str, np.ndarray]] | None:
    pixels, grid = arrays["pixel_values"], arrays["image_grid_thw"]
    if not isinstance(pixels, np.ndarray) or not isinstance(grid, np.ndarray) or grid.ndim != 2:
        return None
    counts = [int(np.prod(row)) for row in grid]
    if sum(counts) != pixels.shape[0]:
        return None
    starts = np.cumsum([0, *counts])
    return [{"pixel_values": pixels[a:b], "image_grid_thw": grid[i:i + 1]}
            for i, (a, b) in enumerate(zip(starts[:-1], starts[1:]))]


def _split_tuples(arrays: Mapping[str, HostArray], n: int) -> list[dict[str, np.ndarray]] | None:
    if not all(isinstance(v, tuple) and len(v) == n for v in arrays.values()):
        return None
    return [{k: v[i] for k, v in arrays.items()} for i in range(n)]


def _split_rows(arrays: Mapping[str, HostArray], n: int) -> list[dict[str, np.ndarray]] | None:
    rows = {k: v for k, v in arrays.items() if isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == n}
    if len(rows) < len(arrays):
        return None
    return [{k: v[i:i + 1] for k, v in rows.items()} for i in range(n)]


def _hash(item: Mapping[str, np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(item):
        value = np.ascontiguousarray(item[name])
        h.update(f"{name}:{value.dtype.str}:{value.shape};".encode())
        h.update(value.data)
    return h.hexdigest()
