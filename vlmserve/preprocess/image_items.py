"""[pool] A prompt's processed pixel arrays, cut into one item per image, each with a strong hash.

The hash covers exactly what the vision tower will see: the processed pixels (so the processor's
resizing and normalization are in it) and the per-image layout arrays (Qwen's patch grid, Gemma 4's
patch positions), with their dtypes and shapes. Two images whose bytes differ in one pixel hash
apart; the same picture sent again in a later turn hashes the same.

How arrays split, read from their shapes:
- ``image_grid_thw`` ``[N, 3]`` (Qwen2-VL, Qwen2.5-VL, Qwen3.5...) or ``image_grid_hws`` ``[N, 2]``
  (Kimi-VL): ``pixel_values`` is every image's patches concatenated; image ``i`` has ``t*h*w`` (``h*w``) of them;
- a tuple of ``pixel_values`` (Gemma 4 with images of different sizes): one entry per image;
- ``pixel_values`` ``[N, ...]`` (Gemma 3, LLaVA, Gemma 4 with equal sizes): row ``i``;
- ``image_sizes`` ``[N, 2]`` (Pixtral, Mistral 3): row ``i`` of ``pixel_values`` cut to image ``i``'s size;
- anything else (SmolVLM's tiles, LLaVA-NeXT's patches, LFM2-VL's tiles): no items here, no vision
  cache; phase 1 then keys each image by its decoded picture (``picture_hash``), arrays-free.

Videos split by the same rules under their own names (``pixel_values_videos`` with ``video_grid_thw``
or ``video_position_ids``): a clip is one item, all its frames.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.inputs import HostArray, ImageItem

_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_position_ids", "image_sizes", "image_grid_hws")
_GRIDS = ("image_grid_hws",)  # patch grids besides the kinds' own ``*_grid_thw``
_VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "video_position_ids")


def image_items(arrays: Mapping[str, HostArray], num_images: int, num_tokens: int,
                num_videos: int = 0) -> tuple[ImageItem, ...]:
    """One item per image, then one per video (their arrays split by the same rules, under their
    own names), or ``()`` where the arrays do not split per image by a rule above. Per-token arrays
    (``[1, num_tokens]``, such as ``mm_token_type_ids``) and scalars (Kimi-VL's ``image_token_id``) belong
    to the prompt."""
    others = {k: v for k, v in arrays.items()
              if not (isinstance(v, np.ndarray) and (v.shape == (1, num_tokens) or v.ndim == 0))}
    if set(others) - set(_IMAGE_KEYS) - set(_VIDEO_KEYS):
        return ()  # an image array of a kind not known to split
    items: list[dict[str, np.ndarray]] = []
    for keys, n in ((_IMAGE_KEYS, num_images), (_VIDEO_KEYS, num_videos)):
        own = {k: v for k, v in others.items() if k in keys}
        if n == 0:
            continue
        split = _split(own, n, keys[0], keys[1]) if keys[0] in own else None
        if split is None:
            return ()
        items += split
    return tuple(ImageItem(_hash(item), item) for item in items)


def _split(arrays: Mapping[str, HostArray], n: int, pixels: str, grid: str) -> list[dict[str, np.ndarray]] | None:
    grid = next((g for g in (grid, *_GRIDS) if g in arrays), grid)
    if grid in arrays:
        return _split_patches(arrays, pixels, grid)
    if "image_sizes" in arrays:
        return _split_sized(arrays, n)
    if isinstance(arrays[pixels], tuple):
        return _split_tuples(arrays, n)
    return _split_rows(arrays, n)


def _split_patches(arrays: Mapping[str, HostArray], pixels_key: str, grid_key: str) -> list[dict[str, np.ndarray]] | None:
    pixels, grid = arrays[pixels_key], arrays[grid_key]
    if not isinstance(pixels, np.ndarray) or not isinstance(grid, np.ndarray) or grid.ndim != 2:
        return None
    counts = [int(np.prod(row)) for row in grid]
    if sum(counts) != pixels.shape[0]:
        return None
    starts = np.cumsum([0, *counts])
    return [{pixels_key: pixels[a:b], grid_key: grid[i:i + 1]}
            for i, (a, b) in enumerate(zip(starts[:-1], starts[1:]))]


def _split_sized(arrays: Mapping[str, HostArray], n: int) -> list[dict[str, np.ndarray]] | None:
    """Pixtral's and Mistral 3's: every image padded to the prompt's largest, ``image_sizes`` its own
    height and width. Each item is its image cut to its size, so that its hash is the same whatever
    other images share its prompt."""
    pixels, sizes = arrays["pixel_values"], arrays["image_sizes"]
    if not isinstance(pixels, np.ndarray) or not isinstance(sizes, np.ndarray) or pixels.ndim != 4 \
            or sizes.shape != (n, 2) or pixels.shape[0] != n:
        return None
    return [{"pixel_values": pixels[i:i + 1, :, :h, :w], "image_sizes": sizes[i:i + 1]}
            for i, (h, w) in enumerate(sizes.tolist())]


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


def picture_hash(image: Image.Image, kwargs: Mapping[str, Any] | None = None) -> str:
    """A decoded picture's hash, with the processor keywords it goes with: the key of an image whose
    processed arrays do not split per image (LFM2-VL's tiles). The processor is deterministic, so equal
    pictures and keywords give equal arrays; an item with this key carries no arrays of its own."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"picture:{image.mode}:{image.size};{sorted((kwargs or {}).items())};".encode())
    h.update(image.tobytes())
    return h.hexdigest()
