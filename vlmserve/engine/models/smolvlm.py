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

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, lambda ip: sized_limit(ip, shrinks=False))

    @property
    def mm_prefix_exact(self) -> bool:
        # Positions are 1-D and causal, and each image's tiles embed on their own; its span's several runs
        # (tile rows broken by newlines) pair with the one image through ``last_run_marks``
        return True

    def last_run_marks(self, processor: Any) -> frozenset[int]:
        # every span ends <global-img><image>*N<fake_token_around_image>: the whole image's view
        tokenizer = getattr(processor, "tokenizer", processor)
        token_id = tokenizer.convert_tokens_to_ids(getattr(processor, "global_image_token", "<global-img>"))
        known = isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None)
        return frozenset({token_id}) if known else frozenset()

    @property
    def decoder(self) -> Any | None:
        return self.language_model
