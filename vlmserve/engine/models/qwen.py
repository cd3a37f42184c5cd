"""[worker] Qwen-style M-RoPE families: each request carries its own position delta into decode.

Image tokens advance M-RoPE positions by the image grid, not by one per token, so a request's
position runs ``rope_deltas`` behind (or ahead of) its token count. mlx-vlm keeps that delta on
the model object, which holds one request's value at a time; in a batch every row needs its
own, passed as ``rope_deltas`` ``[B, 1]`` on every decode step (as mlx-vlm's BatchGenerator does).
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.inputs import PromptInputs


class MRoPEAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe")
    tool_format: ClassVar[str | None] = "hermes"
    batch_embed: ClassVar[bool] = True
    vision_cache: ClassVar[bool] = True
    # mlx-vlm's merge fills the image placeholders when there are any, else the video ones: one kind a prompt
    mixes_media: ClassVar[bool] = False

    def encode_image(self, arrays: dict[str, mx.array]) -> mx.array:
        # As mlx-vlm's get_input_embeddings runs the tower: [patches / merge^2, hidden]; a video is
        # its frames' patches with a grid of t > 1, through the same tower
        tower = self.model.vision_tower
        video = "pixel_values_videos" in arrays
        pixels, grid = (arrays["pixel_values_videos"], arrays["video_grid_thw"]) if video else \
            (arrays["pixel_values"], arrays["image_grid_thw"])
        out = tower(pixels.astype(tower.patch_embed.proj.weight.dtype), grid)
        features: mx.array = out[0] if isinstance(out, tuple) else out  # Qwen3.5's tower also returns DeepStack's
        return features

    def vision_blocks(self) -> tuple[Any, str] | None:
        tower = self.model.vision_tower
        if getattr(tower, "deepstack_visual_indexes", None):
            return None  # Qwen3-VL's DeepStack reads blocks before the last (Qwen3.5 turns it off)
        return tower, "blocks"

    @property
    def mm_prefix_exact(self) -> bool:
        # Image tokens causal, and every chunk's M-RoPE positions from the whole prompt's grids (tested
        # against whole prefills). Qwen3.5's recurrent layers keep state a prefix cannot be cut back to:
        # its prefixes are snapshots taken at a prompt's stem (SchedulerConfig.snapshots).
        return True

    def row_state(self, features: dict[str, Any]) -> dict[str, mx.array]:
        deltas = features.get("rope_deltas")
        if deltas is None:  # a prompt whose positions are plain token counts
            return {"rope_deltas": mx.zeros((1, 1), dtype=mx.int32)}
        return {"rope_deltas": mx.array(deltas).astype(mx.int32).reshape(1, 1)}


class Qwen3VLAdapter(MRoPEAdapter):
    """Qwen3-VL adds DeepStack visual features inside the language model, at the image positions."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
    batch_embed: ClassVar[bool] = False  # its DeepStack features come back as one list for the whole batch
    vision_cache: ClassVar[bool] = False  # DeepStack: features the language model takes besides the merged ones

    def can_batch(self, prompt: PromptInputs) -> bool:
        # In a left-padded batch with images, mlx-vlm's DeepStack merge changed the tokens of
        # the batch's other rows (measured); image prompts prefill on their own.
        return not prompt.has_images


class Qwen3VLMoEAdapter(Qwen3VLAdapter):
    """Qwen3-VL MoE (30B-A3B, 235B-A22B): Qwen3-VL's language model with routed experts.

    mlx-vlm's MoE attention cuts the mask to the rows' longest offset + 1 before the cache update
    (``qwen3_vl_moe/language.py`` 97-122; the dense one cuts it to the keys' length after): narrower
    than the keys once every row of a batch is left-padded. A speculative commit that accepts unevenly
    leaves such a batch, so the padding all rows share is dropped after each commit.
    """

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl_moe",)

    def commit(self, transaction: Any, cache: list[Any], accepted: list[int], width: int) -> None:
        super().commit(transaction, cache, accepted, width)
        for layer in cache:
            padding = getattr(layer, "left_padding", None)
            if padding is not None and padding.size and int(padding.min().item()) > 0:
                layer.filter(mx.arange(padding.size))  # mlx-vlm's filter drops the shared padding
