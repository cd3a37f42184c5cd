"""[worker] LFM2-VL: the default call path with its own exact draft verifier (convolution state).

Its images embed as one padded batch, and its processor splits a large image into a grid of tiles
plus one smaller view (``preprocess/image_sizes.py``'s ``lfm2_limit``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, lfm2_limit, limit_of


class LFM2VLAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("lfm2_vl",)
    batch_embed: ClassVar[bool] = True  # mlx-vlm's get_input_embeddings takes a padded batch (tested)

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, lfm2_limit)

    @property
    def mm_prefix_exact(self) -> bool:
        # An image's span, tiles and thumbnail between <|image_start|> and <|image_end|>, holds special
        # tokens only (span_token_ids), so it is one run of the key; hashed whole in phase 1.
        return True

    @property
    def exact_verifier(self) -> bool:
        return True  # mlx-vlm's LFM2 records its convolution states at each drafted position
