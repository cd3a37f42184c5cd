"""[worker] Kimi-VL: the default call path (MLA attention, DeepSeek-V3 MoE, MoonViT), with Kimi's tool syntax.

mlx-vlm's ``get_input_embeddings`` takes the processor's ``image_grid_hws`` and ``image_token_id`` as they
come; ``_grid_shapes`` (the same grid as Python tuples, which the prompt builder does not carry across
threads) only spares the tower a read of ``image_grid_hws`` (``_resolve_hw_shapes`` in mlx-vlm's
kimi_vl/vision.py): the features are the same bitwise (tests/test_engine_kimi_vl.py). MLA keeps one
ordinary KV cache per layer (keys ``nope + rope`` wide, values ``v_head_dim``), so quantized KV, drafts and
layer pieces go through the default path. No video: mlx-vlm's model reads ``video_grid_hws``, but its
KimiVLProcessor has neither a video processor nor a video token.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, limit_of


class KimiVLAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("kimi_vl",)
    tool_format: ClassVar[str | None] = "kimi"
    # MoonViT attends within each image (a block mask over the images' patches): one image's features are
    # the same alone (tests/test_vision_cache.py)
    vision_cache: ClassVar[bool] = True

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, _kimi_limit)

    def encode_image(self, arrays: dict[str, mx.array]) -> mx.array:
        # As mlx-vlm's get_input_embeddings runs the tower and projector (pixels in the processor's dtype,
        # as it passes them): [patches / merge^2, hidden]
        pixels = arrays["pixel_values"].transpose(0, 2, 3, 1)
        hidden = self.model.vision_tower(pixels, output_hidden_states=True, grid_thw=arrays["image_grid_hws"])
        features: mx.array = self.model.multi_modal_projector(hidden)
        return features

    def vision_blocks(self) -> tuple[Any, str] | None:
        # Only the last block's output reaches the merger (the blocks' states it collects go unread)
        return self.model.vision_tower, "blocks"

    @property
    def mm_prefix_exact(self) -> bool:
        # Image tokens are causal and positions are plain token counts: a restored prefix continues as a
        # whole prefill does (tests/test_engine_mm_prefix.py)
        return True


def _kimi_limit(ip: Any) -> ProcessorLimit:
    """KimiVLImageProcessor: scaled, aspect kept, to at most ``in_token_limit`` patches, then cropped to
    whole merged patches: an area per image."""
    return ProcessorLimit(type(ip).__name__, area=int(ip.in_token_limit) * int(ip.patch_size) ** 2)
