"""[worker] The engine's two caches in one place: the text prefix cache (KV) and the vision cache.

The scheduler asks them what is cached (a reused prefix at admission, which images still need the
tower) and so decides each step's work; the runner reads and fills them as it executes the plan.
Adding a cache means a field here, a question in ``CacheBook`` and its use in the runner.
"""

from __future__ import annotations

from typing import Any

from vlmserve.engine.params import PromptInputs, pixel_count
from vlmserve.engine.prefix_cache import PrefixCache, PrefixCacheStats
from vlmserve.engine.vision_cache import VisionCache, VisionCacheStats


class EngineCaches:
    """The prefix cache (None: off) and the vision cache (None: off, or the family has none)."""

    def __init__(self, prefix: PrefixCache | None, vision: VisionCache | None) -> None:
        self.prefix = prefix
        self.vision = vision

    @property
    def prefix_enabled(self) -> bool:
        return self.prefix is not None

    def lookup_prefix(self, tokens: list[int]) -> tuple[Any, int]:
        """A private copy of the longest cached prefix's KV and its length, or (None, 0)."""
        return self.prefix.lookup(tokens) if self.prefix is not None else (None, 0)

    def store_prefix(self, tokens: list[int], cache: list[Any]) -> None:
        if self.prefix is not None:
            self.prefix.store(tokens, cache)

    def uncached_images(self, prompt: PromptInputs) -> tuple[int, int]:
        """The prompt's images that need the vision tower, and their pixel values (what the tower's
        time follows): all of them where features are not kept per image."""
        if self.vision is None or not prompt.images:
            return (prompt.num_images, pixel_count(prompt.arrays)) if prompt.has_images else (0, 0)
        missing = [item for item in prompt.images if item.key not in self.vision]
        return len(missing), sum(pixel_count(item.arrays) for item in missing)

    def stats(self) -> tuple[PrefixCacheStats | None, VisionCacheStats | None]:
        return (self.prefix.stats() if self.prefix is not None else None,
                self.vision.stats() if self.vision is not None else None)
