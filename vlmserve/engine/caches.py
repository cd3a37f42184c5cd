"""[worker] The engine's caches in one place: the text prefix cache (KV), the vision cache and the image-keyed
prefix cache; and ``cache_policy``, the one place that decides which of them a model's engine keeps.

The scheduler asks them what is cached (a reused prefix at admission, which images still need the
tower) and so decides each step's work, in ids and counts; the runner reads and fills them as it
executes the plan. A prefix reused at admission is held here under the request's id
(``reserve_prefix``: found, not copied; the stored layers are never written, so a later admission's
eviction cannot touch them) until the runner takes its own copy as it enters the request
(``take_prefix``). Adding a cache means a field here, a question in ``CacheBook`` and its use in the
runner.

The image-keyed prefix cache (``mm_prefix``, opt-in) is a second store for prompts with images,
keyed by ``params.prefix_key``: their tokens with each image's placeholders written as its content
hash, so KV computed from one picture never serves another. It is on only for families where a
restored prefix continues exactly (the adapter's ``mm_prefix_exact``). There, a prompt with images
also looks up the text before its first image in the text store (``params.text_key``), with or
without the image-keyed cache, and reuses the longer of the two: an agent's first screenshot then
reuses the previous turn's text prompt. No image's KV ever comes from the text store.

With ``--prefix-cache-dir`` both stores spill what they evict to one disk tier (engine/disk_tier.py),
each under its own marker, and look there when memory holds less of a prompt than a file does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.models import ModelAdapter
from vlmserve.engine.params import pixel_count, prefix_key, text_key
from vlmserve.engine.prefix_cache import PrefixCache, PrefixCacheStats, Reuse
from vlmserve.engine.vision_cache import VisionCache, VisionCacheStats
from vlmserve.inputs import PromptInputs


@dataclass(slots=True, frozen=True)
class CachePolicy:
    """Which caches one model's engine keeps, and why each one asked for is not kept."""

    prefix: bool  # text prompts' KV (--no-prefix-cache turns it off)
    vision: bool  # images' features, across requests (--vision-cache-mb 0 turns it off)
    mm_prefix: bool  # image prompts' KV, keyed by their images' content (--mm-prefix-cache turns it on)
    stems: bool  # phase 1 marks where a prompt's snapshot is taken: the family's cache cannot be cut back
    text_for_images: bool = False  # prompts with images reuse the text store's KV of the text before them
    off: tuple[str, ...] = ()  # why a cache asked for is off, one sentence each (said at start-up)


def cache_policy(config: EngineConfig, adapter: ModelAdapter) -> CachePolicy:
    """The one decision of which caches an engine keeps: the config asks, the family and the mode allow."""
    off = []
    apart = config.pipeline  # the other ranks cannot look up a prefix rank 0 cached (engine/pipeline.py)
    if apart and (config.prefix_cache or config.mm_prefix_cache):
        off.append("the prefix caches are off across pipeline ranks: the other ranks could not look up what rank 0 "
                   "cached")
    vision = adapter.vision_cache and config.vision_cache_bytes > 0
    if config.vision_cache_bytes > 0 and not adapter.vision_cache:
        off.append("the vision cache is off for this family: its tower encodes a prompt's images together, not one "
                   "image alone")
    mm_prefix = config.mm_prefix_cache and adapter.mm_prefix_exact and not apart
    if config.mm_prefix_cache and not adapter.mm_prefix_exact:
        off.append("--mm-prefix-cache is off for this family: reusing an image prompt's cached prefix is not proven "
                   "exact here")
    prefix = config.prefix_cache and not apart
    # where an image prompt's restored prefix continues exactly, one that ends before its first image does too
    text_for_images = prefix and adapter.text_prefix_exact and adapter.reuses_prefix
    return CachePolicy(prefix, vision, mm_prefix, not adapter.trims_cache and (prefix or mm_prefix), text_for_images,
                       tuple(off))


class EngineCaches:
    """The prefix cache (None: off) and the vision cache (None: off, or the family has none)."""

    def __init__(self, prefix: PrefixCache | None, vision: VisionCache | None, mm_prefix: PrefixCache | None = None,
                 media_ids: frozenset[int] = frozenset(), mm_limit: int | None = None,
                 text_for_images: bool = False) -> None:
        self.prefix = prefix
        self.vision = vision
        self.mm_prefix = mm_prefix  # prompts with images (opt-in), keyed by their images' content too
        self.media_ids = media_ids  # the model's image placeholder token ids
        self.last_run_marks: frozenset[int] = frozenset()  # the adapter's: an image's last run follows one
        self.mm_limit = mm_limit  # the longest image prompt reused (the adapter's mm_prefix_limit)
        self.text_for_images = text_for_images  # image prompts look up the text before their first image
        self._reserved: dict[str, Reuse] = {}  # prefixes found at admission, by request id, until entered

    def _store(self, prompt: PromptInputs) -> PrefixCache | None:
        """Where a prompt's prefix is kept (None: nowhere), from what is known without walking its tokens."""
        if not prompt.has_images:
            return self.prefix
        hashed = len(prompt.images) == prompt.num_images  # every image has a content hash
        return self.mm_prefix if hashed and not self._too_long(prompt) else None

    def _too_long(self, prompt: PromptInputs) -> bool:
        # past the sliding window a restored prefix of an image prompt is not what its cold prefill computes
        return self.mm_limit is not None and len(prompt) > self.mm_limit

    def _keyed(self, prompt: PromptInputs) -> tuple[PrefixCache | None, list[int] | None]:
        store = self._store(prompt)
        key = prefix_key(prompt, self.media_ids, self.last_run_marks) if store is not None else None
        return (store, key) if key is not None else (None, None)

    def _lookups(self, prompt: PromptInputs) -> list[tuple[PrefixCache, list[int]]]:
        """Where a prompt's prefix may be found, its own store first; for a prompt with images, the text
        store too, up to its first image (``text_key``)."""
        store, key = self._keyed(prompt)
        found = [(store, key)] if store is not None and key is not None else []
        if prompt.has_images and self.text_for_images and self.prefix is not None and not self._too_long(prompt):
            text = text_key(prompt, self.media_ids)
            found += [(self.prefix, text)] if text is not None else []
        return found

    def reuses(self, prompt: PromptInputs) -> bool:
        """Whether this prompt's prefix may be stored, and looked up in its own store (its key may still be
        None: then ``store_prefix`` keeps nothing). A prompt with images may reuse the text before them
        either way (``reserve_prefix``)."""
        return self._store(prompt) is not None

    def reserve_prefix(self, request_id: str, prompt: PromptInputs) -> int:
        """How many of the prompt's first tokens a cached prefix covers (0: none), the longest any store
        holds; the store it comes from counts the lookup (a miss: the prompt's own store). The prefix is
        held for the request, not copied, until the runner takes it: an eviction meanwhile cannot touch it."""
        found = [(store, store.search(key)) for store, key in self._lookups(prompt)]
        if not found:
            return 0
        store, reuse = max(found, key=lambda f: f[1].length if f[1] is not None else 0)  # ties: the first
        store.count(len(prompt), reuse)
        if reuse is None:
            return 0
        self._reserved[request_id] = reuse
        return reuse.length

    def take_prefix(self, request_id: str) -> list[Any] | None:
        """The request's own KV of its reserved prefix (None: none), copied now, on the runner's call."""
        reuse = self._reserved.pop(request_id, None)
        return reuse.take() if reuse is not None else None

    def drop_prefix(self, request_id: str) -> None:
        """A request that ended before it entered: its reserved prefix is let go, uncopied."""
        self._reserved.pop(request_id, None)

    def prefetch(self, prompt: PromptInputs) -> None:
        """A prompt arrived: where its store has a disk tier, start reading the file it would reuse."""
        for store, key in self._lookups(prompt):
            if store.tier is not None:
                store.tier.prefetch(store.marker, key)

    def store_prefix(self, prompt: PromptInputs, cache: list[Any], length: int | None = None, ttl: float = 0.0) -> None:
        """Keep ``cache``, the prompt's first ``length`` positions (None: all of them), pinned for ``ttl``
        seconds (the request's ``cache_ttl_s``)."""
        store, key = self._keyed(prompt)
        if store is not None and key is not None:
            store.store(key if length is None else key[:length], cache, ttl)

    def held_bytes(self) -> int:
        """The KV the prefix stores hold (counted against the KV budget, with the running requests')."""
        return sum(store.nbytes for store in (self.prefix, self.mm_prefix) if store is not None)

    def release(self, n_bytes: int) -> None:
        """Give ``n_bytes`` of the stores' KV back to the budget: least recently used prefixes first,
        the image-keyed store's before the text store's."""
        for store in (self.mm_prefix, self.prefix):
            if store is not None and n_bytes > 0:
                n_bytes -= store.release(n_bytes)

    def uncached_images(self, prompt: PromptInputs) -> tuple[int, int]:
        """The prompt's images that need the vision tower, and their pixel values (what the tower's
        time follows): all of them where features are not kept per image."""
        if self.vision is None or not prompt.encodes_per_image:
            return (prompt.num_images, pixel_count(prompt.arrays)) if prompt.has_images else (0, 0)
        missing = [item for item in prompt.images if item.key not in self.vision]
        return len(missing), sum(pixel_count(item.arrays) for item in missing)

    def stats(self) -> tuple[PrefixCacheStats | None, VisionCacheStats | None, PrefixCacheStats | None]:
        return (self.prefix.stats() if self.prefix is not None else None,
                self.vision.stats() if self.vision is not None else None,
                self.mm_prefix.stats() if self.mm_prefix is not None else None)
