"""[any] The contracts between the two phases: what preprocess/ (phase 1, the pool) hands the engine
(phase 2, the worker). Plain numpy and dataclasses, no MLX, and no import from the rest of the package, so
that both sides import it from below (vLLM keeps these in ``vllm/inputs/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

HostArray = np.ndarray | tuple[np.ndarray, ...]  # a tuple: one array per image (Gemma 4's sizes differ)
AUDIO_KEYS = ("input_features", "input_features_mask")  # Gemma 4's mel features of a prompt's clips, and their mask


@dataclass(slots=True, frozen=True)
class Guide:
    """A compiled grammar that constrains one request's output (preprocess/guided.py). ``template``
    is an llguidance ``LLMatcher`` in its start state, compiled once per grammar and copied for each
    request on the worker; it holds no MLX."""

    name: str  # what it constrains to, for errors and logs ("json_schema", "tool_call get_weather"...)
    template: Any = field(compare=False, repr=False)


@dataclass(slots=True, frozen=True)
class ImageItem:
    """One image of a prompt as its processor prepared it: its own slice of the pixel arrays, and a
    strong hash of them (the vision cache's key: equal keys, equal vision features)."""

    key: str
    arrays: dict[str, np.ndarray]


@dataclass(slots=True, frozen=True)
class PromptInputs:
    """Phase-1 output: plain lists and numpy arrays, never ``mx.array``.

    ``arrays`` holds what the processor returned besides ``input_ids`` (``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``...), passed to the model by name. ``images`` has
    one item per image, in prompt order, where the arrays split per image (else it is empty).
    """

    input_ids: list[int]
    arrays: dict[str, HostArray] = field(default_factory=dict)
    num_images: int = 0
    images: tuple[ImageItem, ...] = ()
    # How much of the prompt the next turn's prompt repeats (its stem: at most all of it but the
    # generation prompt's part the next turn renders otherwise), where a cache that cannot be cut back
    # (recurrent state) keeps its prefix. None: not known, or not asked.
    stem: int | None = None
    # One item per audio clip, in prompt order: its own mel features (its valid frames only) keyed by its decoded
    # samples' hash, so that the audio tower's output is cached by content beside images' (engine/vision_cache.py)
    clips: tuple[ImageItem, ...] = ()

    @property
    def has_images(self) -> bool:
        """Does the prompt carry media the token ids do not say (pixels of images or videos: ``num_images``
        counts both; or audio features): then it is embedded through the towers, never keyed by ids alone."""
        return "pixel_values" in self.arrays or "pixel_values_videos" in self.arrays or self.has_audio

    @property
    def has_audio(self) -> bool:
        return "input_features" in self.arrays

    @property
    def has_videos(self) -> bool:
        return "pixel_values_videos" in self.arrays

    @property
    def encodes_per_image(self) -> bool:
        """Does every image carry its own arrays, so that the vision tower may encode it alone (the vision
        cache)? Not an image keyed by its picture only (``picture_hash``: arrays that do not split)."""
        return bool(self.images) and all(item.arrays for item in self.images)

    def __len__(self) -> int:
        return len(self.input_ids)
