"""[worker] ModelRunner: executes what the scheduler planned, through the family's adapter.

Each request prefills alone (batch 1) into its own KV cache, the number of prompt tokens the
scheduler gave it per step, then joins the decode batch's left-padded caches (mlx-lm's
BatchKVCache / BatchRotatingKVCache / ArraysCache). Prefilling alone is what lets prompts of
any length, with or without images, join one decode batch: mlx-vlm's own batch prefill
concatenates per-prompt 4-D masks and fails on gemma3 when lengths differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from vlmserve.engine import guided
from vlmserve.engine.batch import DecodeBatch
from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.models import Embedded
from vlmserve.engine.params import HostArray, ImageItem, PromptInputs, SamplingParams
from vlmserve.engine.sampler import RowState, Sample, sample
from vlmserve.engine.vision_cache import VisionCache


@dataclass(slots=True)
class PrefillGroup:
    """Prompts prefilled together in one left-padded forward, until they join the decode batch."""

    request_ids: list[str]
    cache: list[Any]
    row_state: dict[str, mx.array]


@dataclass(slots=True)
class PrefillState:
    """One request's prompt on its way into its own KV cache (or a group's), until it joins the batch."""

    prompt: PromptInputs
    params: SamplingParams
    input_ids: mx.array
    cache: list[Any]
    embedded: Embedded | None  # None before ``embed`` and once the prompt is in the cache
    num_computed: int = 0
    row_state: dict[str, mx.array] | None = None  # set when done, with the sampling row and first token
    sampling: RowState | None = None
    first_token: int | None = None
    length: int = 0  # positions: the embedding's length
    group: PrefillGroup | None = None  # set when prefilled with others: its KV is a row of the group's

    @property
    def done(self) -> bool:
        return self.num_computed >= self.length


class ModelRunner:
    """Prefill chunks per request and one batched decode step; owns every MLX array of a request."""

    def __init__(self, loaded: LoadedModel, vision_cache: VisionCache | None = None) -> None:
        self.loaded = loaded
        self.adapter = loaded.adapter
        self.prefilling: dict[str, PrefillState] = {}
        self.batch = DecodeBatch()
        self.guide_errors: dict[str, str] = {}  # requests whose grammar failed in decode, for the core to fail
        # Only where the family's features can be computed per image (the adapter says so).
        self.vision_cache = vision_cache if self.adapter.vision_cache else None

    def begin(self, request_id: str, prompt: PromptInputs, params: SamplingParams,
              cache: list[Any] | None = None, num_cached: int = 0) -> None:
        """Take a phase-1 prompt in; ``cache`` may hold a reused prefix. ``embed`` comes next."""
        assert not (prompt.has_images and num_cached), "image prompts never reuse KV"
        input_ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
        self.prefilling[request_id] = PrefillState(
            prompt, params, input_ids, cache if cache is not None else self.adapter.make_cache(), None, num_cached)

    def embedding_groups(self, request_ids: list[str]) -> list[list[str]]:
        """Begun prompts in the groups ``embed`` takes: image prompts whose images have one shape
        together where the adapter allows it (one vision forward), every other prompt alone."""
        groups: dict[object, list[str]] = {}
        for request_id in request_ids:
            prompt = self.prefilling[request_id].prompt
            pixels = prompt.arrays.get("pixel_values")
            batched = isinstance(pixels, np.ndarray) and self.adapter.batch_embed and not self._caches(prompt)
            key = ("images", pixels.shape[1:]) if batched else request_id
            groups.setdefault(key, []).append(request_id)
        return list(groups.values())

    def embed(self, request_ids: list[str]) -> None:
        """The vision tower and the merge for one group; afterwards ``prompt_length`` is known."""
        states = [self.prefilling[r] for r in request_ids]
        arrays = [on_device(s.prompt.arrays) for s in states]
        if len(states) == 1:
            prompt = states[0].prompt
            features = self._image_features(prompt.images) if self._caches(prompt) else None
            embedded = [self.adapter.embed(states[0].input_ids, arrays[0], features)]
        else:
            embedded = self.adapter.embed_rows([s.input_ids for s in states], arrays)
        mx.eval([e.inputs_embeds for e in embedded])
        for state, e in zip(states, embedded):
            state.embedded, state.length = e, e.inputs_embeds.shape[1]

    def _caches(self, prompt: PromptInputs) -> bool:
        return self.vision_cache is not None and bool(prompt.images)

    def _image_features(self, images: tuple[ImageItem, ...]) -> mx.array:
        """Each image's features from the vision cache, or from the tower (alone) and then cached."""
        assert self.vision_cache is not None
        features = []
        for item in images:
            cached = self.vision_cache.get(item.key)
            if cached is None:
                cached = self.adapter.encode_image(on_device(item.arrays))
                mx.eval(cached)
                self.vision_cache.put(item.key, cached)
            features.append(cached)
        return self.adapter.join_features(features)

    def prompt_length(self, request_id: str) -> int:
        """The positions a begun prompt fills: its embedding's length, which the token count may not be."""
        return self.prefilling[request_id].length

    def prefill(self, request_id: str, num_tokens: int) -> Sample | None:
        """Prefill the next ``num_tokens`` prompt tokens; once the prompt is done, sample its first token."""
        state = self.prefilling[request_id]
        assert state.embedded is not None, "prefill after the prompt is done"
        start = state.num_computed
        end = min(state.length, start + num_tokens)
        if end == state.length and end - start > 1 and self.adapter.can_chunk(state.prompt):
            # The last token alone, as mlx-vlm's generate_step does: the rest's logits are never
            # evaluated, so MLX never computes them (a [tokens, vocab] head is most of a short prefill).
            self.adapter.prefill(state.input_ids, state.embedded, start, end - 1, state.cache)
            start = end - 1
        logits = self.adapter.prefill(state.input_ids, state.embedded, start, end, state.cache)
        state.num_computed = end
        if not state.done:
            mx.eval([c.state for c in state.cache])
            return None
        mx.eval(logits, [c.state for c in state.cache], state.embedded.row_state)
        state.row_state = state.embedded.row_state
        return self._sample_first(logits, [state])[0]

    def prefills_whole(self, request_id: str, num_tokens: int) -> bool:
        """Whether this step runs the whole prompt, which may then prefill together with others."""
        state = self.prefilling[request_id]
        return state.num_computed == 0 and num_tokens >= state.length and self.adapter.can_batch(state.prompt)

    def prefill_together(self, request_ids: list[str]) -> dict[str, Sample]:
        """Whole prompts in one left-padded forward (the adapter's), then each one's first token."""
        states = [self.prefilling[r] for r in request_ids]
        embedded = [s.embedded for s in states]
        assert all(e is not None for e in embedded)
        split_last = all(self.adapter.can_chunk(s.prompt) for s in states)
        logits, cache = self.adapter.prefill_rows([s.input_ids for s in states], embedded, split_last)
        row_state = {k: mx.concatenate([e.row_state[k] for e in embedded]) for k in embedded[0].row_state}
        mx.eval(logits, [c.state for c in cache], row_state)
        group = PrefillGroup(list(request_ids), cache, row_state)
        for state in states:
            state.num_computed, state.group, state.cache = state.length, group, []
        return dict(zip(request_ids, self._sample_first(logits, states)))

    def _sample_first(self, logits: mx.array, states: list[PrefillState]) -> list[Sample]:
        for state in states:
            state.embedded = None  # the vision features are in the KV now; free them
            state.sampling = RowState.create(state.params, state.prompt.input_ids)
        rows = [s.sampling for s in states]
        sampled = sample(logits, rows, allowed=guided.allowed(rows, logits.shape[-1]))
        firsts = [sampled.read(i) for i in range(len(states))]
        for state, first in zip(states, firsts):
            state.first_token = first.token_id
        return firsts

    def prompt_cache(self, request_id: str) -> list[Any]:
        """The KV of a finished prefill (for the prefix cache; it must not be mutated afterwards)."""
        state = self.prefilling[request_id]
        assert state.done
        if state.group is None:
            return state.cache
        row = state.group.request_ids.index(request_id)
        return [c.extract(row) for c in state.group.cache]

    def join(self, request_ids: list[str]) -> None:
        """Move prefilled requests into the decode batch as its last rows; each one's first token is its next input."""
        states = [self.prefilling.pop(r) for r in request_ids]
        for request_id, state in zip(request_ids, states):
            if state.group is None:
                assert state.row_state is not None and state.sampling is not None and state.first_token is not None
                rows = [type(c).merge([c]) for c in state.cache]
                self.batch.extend([request_id], rows, state.row_state, [state.sampling], [state.first_token])
        for group in {id(s.group): s.group for s in states if s.group is not None}.values():
            self._join_group(group, {r: s for r, s in zip(request_ids, states) if s.group is group})

    def _join_group(self, group: PrefillGroup, joining: dict[str, PrefillState]) -> None:
        """The group's rows that go on (others already finished with their first token) join together."""
        keep = [i for i, r in enumerate(group.request_ids) if r in joining]
        cache, row_state = group.cache, group.row_state
        if len(keep) < len(group.request_ids):
            index = mx.array(keep)
            for layer in cache:
                layer.filter(index)
            row_state = {k: v[index] for k, v in row_state.items()}
        ids = [group.request_ids[i] for i in keep]
        states = [joining[r] for r in ids]
        self.batch.extend(ids, cache, row_state, [s.sampling for s in states], [s.first_token for s in states])

    def decode(self) -> dict[str, Sample]:
        """Dispatch one decode step for every row (``mx.async_eval``), then read the step before it.

        As mlx-lm's generators do: the next step's graph is built and queued before the host waits
        for the previous one. The samples returned are the rows' tokens from the previous step; a
        row that just joined has none yet (its first token went out with its prefill).
        """
        batch = self.batch
        assert batch.cache is not None and batch.tokens is not None
        if guided.guided(batch.sampling):  # the grammars need this step's inputs now: no pipelining
            refused = guided.consume(batch.sampling, batch.tokens.tolist())
            self.guide_errors.update({batch.request_ids[i]: why for i, why in refused.items()})
        logits = self.adapter.decode(batch.tokens[:, None], batch.cache, batch.row_state)
        step = sample(logits, batch.sampling, batch.tokens, guided.allowed(batch.sampling, logits.shape[-1]))
        mx.async_eval(*step.arrays())
        return batch.advance(step)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Drop finished or aborted requests, prefilling or decoding, and free their KV."""
        ids = list(request_ids)
        for request_id in ids:
            self.prefilling.pop(request_id, None)
        self.batch.remove(ids)


def on_device(arrays: dict[str, HostArray]) -> dict[str, Any]:
    """Phase 1's numpy arrays as ``mx.array``s (a tuple, one array per image, as a list of them)."""
    return {k: [mx.array(a) for a in v] if isinstance(v, tuple) else mx.array(v) for k, v in arrays.items()}
