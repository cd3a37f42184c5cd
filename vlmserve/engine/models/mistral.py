"""[worker] Mistral 3 and Pixtral: the default call path, Mistral's ``[TOOL_CALLS]`` format."""

from __future__ import annotations

from typing import ClassVar

from vlmserve.engine.models.base import ModelAdapter


class MistralAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("mistral3", "pixtral")
    tool_format: ClassVar[str | None] = "mistral"
    batch_embed: ClassVar[bool] = True

    @property
    def mm_prefix_exact(self) -> bool:
        # Plain KV caches and causal image tokens (tested against whole prefills); an image's span,
        # row breaks and end included (span_token_ids), is one run of the prefix key
        return True
