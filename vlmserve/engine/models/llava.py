"""[worker] LLaVA 1.5: the default call path, with the vision cache. LLaVA-NeXT: one image per prompt.

mlx-vlm's LLaVA-NeXT encodes only ``pixel_values[0]`` and merges more image features than the
processor wrote image tokens (no anyres unpadding); the runner follows the embedding's length,
and a second image, which mlx-vlm would silently drop, is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, limit_of, llava_next_limit


class LlavaAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llava",)
    vision_cache: ClassVar[bool] = True

    @property
    def mm_prefix_exact(self) -> bool:
        return True  # causal image tokens, plain KV

    def encode_image(self, arrays: dict[str, mx.array]) -> mx.array:
        # As mlx-vlm's LLaVA get_input_embeddings runs its tower: [1, tokens, hidden]
        model = self.model
        *_, hidden_states = model.vision_tower(arrays["pixel_values"].transpose(0, 2, 3, 1), output_hidden_states=True)
        layers = model.vision_feature_layer
        chosen = [hidden_states[layer] for layer in ([layers] if isinstance(layers, int) else layers)]
        if model.vision_feature_select_strategy == "default":
            chosen = [h[:, 1:] for h in chosen]  # no CLS token
        features: mx.array = model.multi_modal_projector(chosen[0] if len(chosen) == 1 else mx.concatenate(chosen, axis=-1))
        return features


class LlavaNextAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llava_next",)
    max_images: ClassVar[int | None] = 1

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, llava_next_limit)  # its CLIP view, and its anyres grid's pinpoints
