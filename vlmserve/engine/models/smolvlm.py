"""[worker] SmolVLM: the default call path; its images embed as one padded batch.

Its processor (Idefics3's) scales every image to its longest edge, up as well as down, so fewer
pixels never make fewer tokens; and its language model holds its decoder layers itself.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, limit_of, sized_limit


class SmolVLMAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("smolvlm",)
    batch_embed: ClassVar[bool] = True  # mlx-vlm's get_input_embeddings takes a padded batch (tested)
    # mm_prefix_exact stays off: its image spans hold newline text tokens between tile rows (the image-keyed
    # store's key pairs one run of image tokens with one image). The text before the first image continues
    # exactly: positions are 1-D and causal, so its KV is that text's alone

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, lambda ip: sized_limit(ip, shrinks=False))

    @property
    def text_prefix_exact(self) -> bool:
        return True

    @property
    def decoder(self) -> Any | None:
        return self.language_model
