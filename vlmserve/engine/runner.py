"""[worker] ModelRunner: vision forward, chunked prefill and batched decode on mlx-vlm models.

Each request is prefilled alone (batch 1) into its own KV cache, then merged into the
running batch's left-padded caches (mlx-lm's BatchKVCache / BatchRotatingKVCache).
Prefilling alone is what lets prompts of any length, with or without images, join one
decode batch: mlx-vlm's own batch prefill concatenates per-prompt 4-D masks and fails
on gemma3 when lengths differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.params import PromptInputs

DEFAULT_PREFILL_CHUNK = 512


@dataclass(slots=True)
class SeqState:
    """One request's tensors inside the runner: prompt arrays, KV cache, progress."""

    seq_id: str
    prompt: PromptInputs
    input_ids: mx.array
    cache: list[Any] | None
    num_computed: int = 0
    embeds: mx.array | None = None
    lm_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.prompt)


class ModelRunner:
    """Executes what the scheduler decided: prefill chunks and one batched decode step."""

    def __init__(self, loaded: LoadedModel, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.prefill_chunk = prefill_chunk
        self.batch: list[str] = []  # seq ids, in the row order of batch_cache
        self.batch_cache: list[Any] | None = None

    def new_cache(self) -> list[Any]:
        return self.model.language_model.make_cache()

    def start(self, seq_id: str, prompt: PromptInputs, cache: list[Any] | None = None, num_cached: int = 0) -> SeqState:
        """Turn a phase-1 prompt into MLX arrays; ``cache`` may hold a reused prefix."""
        assert not (prompt.has_images and num_cached), "image prompts never reuse KV"
        return SeqState(
            seq_id=seq_id,
            prompt=prompt,
            input_ids=mx.array(prompt.input_ids, dtype=mx.int32)[None],
            cache=cache if cache is not None else self.new_cache(),
            num_computed=num_cached,
        )

    def prefill_step(self, seq: SeqState) -> mx.array | None:
        """Prefill the next chunk; returns the last position's logits ``[1, vocab]`` when done."""
        if seq.embeds is None:
            self._embed(seq)
        start = seq.num_computed
        # Image prompts go in one piece: bidirectional image attention must see every image token.
        end = len(seq.prompt) if seq.prompt.has_images else min(len(seq.prompt), start + self.prefill_chunk)
        out = self.model.language_model(
            seq.input_ids[:, start:end],
            inputs_embeds=seq.embeds[:, start:end],
            cache=seq.cache,
            **seq.lm_kwargs,
        )
        seq.num_computed = end
        if not seq.prefill_done:
            mx.eval([c.state for c in seq.cache])
            return None
        logits = out.logits[:, -1, :]
        mx.eval(logits, [c.state for c in seq.cache])
        seq.embeds = None  # the vision features are in the KV now; free them
        seq.lm_kwargs = {}
        return logits

    def _embed(self, seq: SeqState) -> None:
        arrays = {k: mx.array(v) for k, v in seq.prompt.arrays.items()}
        pixel_values = arrays.pop("pixel_values", None)
        mask = mx.ones(seq.input_ids.shape, dtype=mx.int32)  # one unpadded row (gemma3 needs it)
        features = self.model.get_input_embeddings(seq.input_ids, pixel_values, mask=mask, **arrays)
        extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
        seq.embeds = features.inputs_embeds
        seq.lm_kwargs = {**arrays, **extra}

    # -- the decode batch ------------------------------------------------------

    def join_batch(self, seq: SeqState) -> None:
        """Move a prefilled request's KV into the running batch (a new last row)."""
        assert seq.prefill_done and seq.cache is not None
        rows = [type(c).merge([c]) for c in seq.cache]
        if self.batch_cache is None:
            self.batch_cache = rows
        else:
            for batch_layer, row in zip(self.batch_cache, rows):
                batch_layer.extend(row)
        self.batch.append(seq.seq_id)
        seq.cache = None

    def leave_batch(self, seq_ids: Iterable[str]) -> None:
        """Drop finished or aborted requests' rows and free their KV."""
        gone = set(seq_ids)
        keep = [i for i, sid in enumerate(self.batch) if sid not in gone]
        if len(keep) == len(self.batch):
            return
        self.batch = [self.batch[i] for i in keep]
        if not keep:
            self.batch_cache = None
            return
        index = mx.array(keep)
        for layer in self.batch_cache or []:
            layer.filter(index)

    def decode(self, tokens: list[int]) -> mx.array:
        """One token for every row of the batch; returns logits ``[B, vocab]``."""
        assert len(tokens) == len(self.batch) and self.batch_cache is not None
        inputs = mx.array(tokens, dtype=mx.int32)[:, None]
        out = self.model.language_model(inputs, cache=self.batch_cache)
        return out.logits[:, -1, :]
