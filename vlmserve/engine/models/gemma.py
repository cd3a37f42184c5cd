"""[worker] Gemma-lineage families whose image tokens attend bidirectionally.

Gemma 3 (mlx-vlm passes a full-prompt attention mask with images), Gemma 4 (bidirectional
vision attention) and PaliGemma (mlx-vlm attends both ways over the whole prompt) must see
every image token in one forward, so their image prompts prefill in one piece; PaliGemma's
text prompts too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.gemma4.gemma4 import masked_scatter

from vlmserve.engine.models.base import Embedded, ModelAdapter
from vlmserve.inputs import AUDIO_KEYS, ImageItem, PromptInputs
from vlmserve.preprocess.image_sizes import ProcessorLimit, gemma4_limit, limit_of


class Gemma3Adapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma3",)
    chunk_images: ClassVar[bool] = False
    vision_cache: ClassVar[bool] = True

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        if getattr(getattr(processor, "image_processor", None), "do_pan_and_scan", False):
            return None  # its crops come from the full image
        return super().processor_limit(processor)  # resized to exactly its size

    @property
    def mm_prefix_exact(self) -> bool:
        # An image span attends both ways, but a cached prefix always ends before a span or after it
        # (the key differs from a span's first token on), and within the sliding window (mm_prefix_limit)
        return True

    def encode_image(self, arrays: dict[str, mx.array]) -> mx.array:
        # As mlx-vlm's Gemma 3 get_input_embeddings runs its tower: [1, tokens, hidden]
        dtype = self.language_model.model.embed_tokens(mx.zeros((1, 1), dtype=mx.int32)).dtype
        hidden, _, _ = self.model.vision_tower(arrays["pixel_values"].transpose(0, 2, 3, 1).astype(dtype),
                                               output_hidden_states=True)
        features: mx.array = self.model.multi_modal_projector(hidden)
        return features

    def text_tail(self, prompt: PromptInputs) -> int | None:
        return _past_last_media(self, prompt)

    def can_batch(self, prompt: PromptInputs) -> bool:
        # With images, mlx-vlm hands the language model a [1, 1, L, L] mask per prompt, which
        # cannot be stacked for prompts of different lengths (its own BatchGenerator fails there).
        return not prompt.has_images


class Gemma4Adapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma4",)
    chunk_images: ClassVar[bool] = False
    tool_format: ClassVar[str | None] = "gemma4"
    batch_embed: ClassVar[bool] = True
    vision_cache: ClassVar[bool] = True
    encodes_clips: ClassVar[bool] = True
    layer_returns_tuple: ClassVar[bool] = True

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, gemma4_limit)

    @property
    def mm_prefix_exact(self) -> bool:
        return True  # as Gemma 3's

    def text_tail(self, prompt: PromptInputs) -> int | None:
        return _past_last_media(self, prompt)

    def encode_image(self, arrays: dict[str, mx.array]) -> mx.array:
        if "pixel_values_videos" in arrays:  # [1, frames, patches, dim]: the frames go through as a batch
            out: mx.array = self.model.encode_image(arrays["pixel_values_videos"], arrays["video_position_ids"])
            return out.reshape(1, -1, out.shape[-1])  # [1, frames * tokens, hidden]
        pixels = arrays["pixel_values"]
        pixels = pixels[None] if pixels.ndim == 3 else pixels  # an image of a size of its own
        features: mx.array = self.model.encode_image(pixels, arrays.get("image_position_ids"))  # [1, tokens, hidden]
        return features

    def encode_clip(self, arrays: dict[str, mx.array]) -> mx.array:
        # As mlx-vlm's get_input_embeddings runs the audio tower, but keeping only the valid frames as transformers
        # does: mlx-vlm scatters a padded batch's frames in a row, so a shorter first clip's padding took the
        # second clip's first places (mlx-vlm 0.7.10; tests/test_audio.py)
        encoded, invalid = self.model.audio_tower(arrays["input_features"], ~arrays["input_features_mask"].astype(mx.bool_))
        features: mx.array = self.model.embed_audio(encoded)
        return features[:, :int((~invalid).sum().item())]

    def embed(self, input_ids: mx.array, arrays: dict[str, Any], cached: dict[str, mx.array] | None = None) -> Embedded:
        cached = dict(cached or {})
        clips = cached.pop("cached_audio_features", None)
        if clips is None:
            return super().embed(input_ids, arrays, cached or None)
        embedded = super().embed(input_ids, {k: v for k, v in arrays.items() if k not in AUDIO_KEYS}, cached or None)
        embeds = embedded.inputs_embeds  # the clips' features at the audio tokens, as mlx-vlm's scatter puts them
        at = mx.broadcast_to((input_ids == self.model.config.audio_token_id)[..., None], embeds.shape)
        embedded.inputs_embeds = masked_scatter(embeds, at, clips.astype(embeds.dtype))  # type: ignore[no-untyped-call]
        return embedded

    def join_features(self, items: tuple[ImageItem, ...], features: list[mx.array]) -> dict[str, mx.array]:
        # Scattered in order over each kind's placeholders: images', then videos'
        joined = {}
        for key, video in (("cached_image_features", False), ("cached_video_features", True)):
            own = [f for item, f in zip(items, features) if ("pixel_values_videos" in item.arrays) == video]
            if own:
                joined[key] = mx.concatenate(own, axis=1)
        return joined

    def vision_blocks(self) -> tuple[Any, str] | None:
        return self.model.vision_tower.encoder, "layers"

    @property
    def packs_kv(self) -> str | None:
        if self._first_shared() is None:
            return None
        return ("its KV-sharing layers (E2B/E4B) read their source layer's KV through plain attention, which cannot "
                "read a packed cache (mlx-vlm's own generate fails the same way)")

    def layer_starts(self) -> tuple[int, ...] | None:
        # Shared-KV layers (E2B/E4B) read their source layer's KV within one forward: a piece may
        # start no later than the first source, so every reader runs with what it reads.
        first_shared = self._first_shared()
        if first_shared is None:
            return None
        return tuple(range(min(self.language_model.model.previous_kvs[first_shared:]) + 1))

    def _first_shared(self) -> int | None:
        """The first layer that reads an earlier layer's KV (E2B/E4B), or None where none does."""
        text_model = self.language_model.model
        first = getattr(text_model, "first_kv_shared_layer_idx", len(text_model.layers))
        return first if first < len(text_model.layers) else None


class PaliGemmaAdapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("paligemma",)
    chunk_images: ClassVar[bool] = False
    max_images: ClassVar[int | None] = 1  # mlx-vlm's vision tower keeps only the first image
    reuses_prefix: ClassVar[bool] = False  # the prefix-LM mask lets earlier tokens see later ones
    batch_prefill: ClassVar[bool] = False  # no mask at all: a row would attend to its left padding

    def can_chunk(self, prompt: PromptInputs) -> bool:
        # The prefix-LM mask spans the whole prompt, text included (mlx-vlm's own policy).
        text_config = getattr(self.model.config, "text_config", None)
        return not getattr(text_config, "use_bidirectional_attention", False) and super().can_chunk(prompt)

    @property
    def packs_kv(self) -> str | None:
        text_type = getattr(getattr(self.model.config, "text_config", None), "model_type", "gemma")
        if text_type == "gemma":  # PaliGemma 1's attention is mlx-vlm's shared one
            return None
        return f"mlx-vlm's PaliGemma attention on {text_type} multiplies float keys itself (soft-capped)"

    def decode(self, tokens: mx.array, cache: list[Any], row_state: dict[str, mx.array]) -> mx.array:
        # Attending both ways, mlx-vlm's PaliGemma builds no mask at all, so in a left-padded batch
        # a decode token would attend to its row's padding. One new token is causal anyway: mask it.
        mask = create_attention_mask(tokens, cache, return_array=True)
        logits: mx.array = self.language_model(tokens, cache=cache, mask=mask, **row_state).logits[:, -1, :]
        return logits

    def verify(self, tokens: mx.array, cache: list[Any], row_state: dict[str, mx.array]) -> tuple[mx.array, Any]:
        # A draft's positions are causal too, as decode's one (no mask would let them see padding and later ones)
        return super().verify(tokens, cache, {**row_state, "mask": create_attention_mask(tokens, cache, return_array=True)})


def _past_last_media(adapter: ModelAdapter, prompt: PromptInputs) -> int | None:
    """Past a prompt's last media token: only its vision spans attend both ways, so from there a chunk
    after a cached prefix is causal text (tested against cold prefills)."""
    media = adapter.media_token_ids()
    last = max((i for i, t in enumerate(prompt.input_ids) if t in media), default=None)
    return None if last is None else last + 1
