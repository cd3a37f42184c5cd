"""[worker] GLM-4.1V and GLM-4.5V/4.6V: M-RoPE positions computed per request, never read from the model.

mlx-vlm's GLM ``get_input_embeddings`` returns only the embeddings and leaves the image prompt's
M-RoPE positions and delta on the language model object (``_position_ids``, ``_rope_deltas``), which
the next request then reads: a text request after an image one, and every row of a batch, would go by
another prompt's delta. So each prompt's positions come from mlx-vlm's own ``get_rope_index`` on its
own ids and grids; prefill passes them (sliced to the chunk) and decode passes ``cache.offset +
rope_deltas`` per row as ``position_ids``, which the language model then takes as they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import mlx.core as mx
from mlx_vlm.speculative.common import verify_forward

from vlmserve.engine.models.base import Embedded
from vlmserve.engine.models.qwen import MRoPEAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, limit_of


class GLMAdapter(MRoPEAdapter):
    """GLM-4.1V; GLM-4.5V/4.6V below differ only in their tower."""

    model_types: ClassVar[tuple[str, ...]] = ("glm4v",)
    tool_format: ClassVar[str | None] = "glm"
    # GLM-4.1V's tower attends within the first image, the second, and all the others together (mlx-vlm's
    # Glm4vVisionAttention splits in three): several prompts' images are never encoded in one forward
    batch_embed: ClassVar[bool] = False
    # mlx-vlm's Glm46VProcessor has no video processor (transformers' Glm4vVideoProcessor needs torchvision) and
    # GLM-4.1V's get_input_embeddings splits features by image_grid_thw alone: no video, rather than SmolVLM2's frames
    video_as_frames: ClassVar[bool] = False

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, _glm_limit)

    def embed(self, input_ids: mx.array, arrays: dict[str, Any], cached: dict[str, mx.array] | None = None) -> Embedded:
        return self._placed(input_ids, arrays, super().embed(input_ids, arrays, cached))

    def _placed(self, input_ids: mx.array, arrays: dict[str, Any], embedded: Embedded) -> Embedded:
        """The prompt's own M-RoPE positions ``[3, 1, L]`` and delta ``[1, 1]``, from its ids and grids."""
        positions, deltas = self.language_model.get_rope_index(
            input_ids, arrays.get("image_grid_thw"), arrays.get("video_grid_thw"), None)
        lm_kwargs = {**embedded.lm_kwargs, "position_ids": positions}
        row_state = {"rope_deltas": mx.array(deltas).astype(mx.int32).reshape(1, 1)}
        return replace(embedded, lm_kwargs=lm_kwargs, row_state=row_state)

    def embed_rows(self, input_ids: list[mx.array], arrays: list[dict[str, mx.array]]) -> list[Embedded]:
        return [self._placed(i, a, e) for i, a, e in zip(input_ids, arrays, super().embed_rows(input_ids, arrays))]

    def prefill(self, input_ids: mx.array, embedded: Embedded, start: int, end: int, cache: list[Any],
                every_position: bool = False) -> mx.array:
        # The language model takes position_ids as given: the chunk's own columns of the prompt's
        window = {**embedded.lm_kwargs, "position_ids": embedded.lm_kwargs["position_ids"][..., start:end]}
        return super().prefill(input_ids, replace(embedded, lm_kwargs=window), start, end, cache, every_position)

    def decode(self, tokens: mx.array, cache: list[Any], row_state: dict[str, mx.array]) -> mx.array:
        out = self.language_model(tokens, cache=cache, position_ids=_positions(cache, tokens.shape[1], row_state))
        logits: mx.array = out.logits[:, -1, :]
        return logits

    def verify(self, tokens: mx.array, cache: list[Any], row_state: dict[str, mx.array]) -> tuple[mx.array, Any]:
        def forward(block: mx.array, cache: list[Any]) -> Any:  # mlx-vlm verifies in short blocks: each its own positions
            return self.language_model(block, cache=cache, position_ids=_positions(cache, block.shape[1], row_state))

        out, transaction = verify_forward(forward, tokens, cache)  # type: ignore[no-untyped-call]
        logits: mx.array = out.logits
        return logits, transaction


class GLMMoEAdapter(GLMAdapter):
    """GLM-4.5V/4.6V: the tower masks each image to itself, so images of several prompts encode together,
    each bitwise as alone (tested)."""

    model_types: ClassVar[tuple[str, ...]] = ("glm4v_moe",)
    batch_embed: ClassVar[bool] = True


def _positions(cache: list[Any], width: int, row_state: dict[str, mx.array]) -> mx.array:
    """``[3, B, width]`` positions after each row's cached tokens: its offset (a batch cache keeps one per
    row, counting only its own tokens) plus its delta, the same on all three M-RoPE axes."""
    offset = cache[0].offset
    offsets = offset if isinstance(offset, mx.array) else mx.array(offset)
    start = offsets.reshape(-1, 1) + row_state["rope_deltas"].reshape(-1, 1)
    rows = start + mx.arange(width)[None]
    return mx.broadcast_to(rows[None], (3, *rows.shape))


def _glm_limit(ip: Any) -> ProcessorLimit:
    """GLM's smart_resize: aspect kept, to at most ``size["longest_edge"]`` pixels counted over its
    ``temporal_patch_size`` frames (a still image is that many copies): an area per image."""
    size = ip.size
    longest = size["longest_edge"] if isinstance(size, dict) else size.longest_edge
    return ProcessorLimit(type(ip).__name__, area=int(longest) // int(ip.temporal_patch_size), shrinks=True)
