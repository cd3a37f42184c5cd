"""[worker] Llama 4 (Scout, Maverick): chunked attention that a left-padded batch keeps exact.

Three layers of four attend within fixed chunks of positions (``attention_chunk_size``), the fourth
globally. mlx-vlm's ``make_cache`` gives the chunked layers a ``ChunkedKVCache``, which has no batch
``merge``, and its forward builds one chunk mask from the first cache's scalar offset, so in a
left-padded batch every row's chunks would be counted from the batch's column, not its own position.
Here every layer keeps its whole KV (``ChunkKVCache``: a ``KVCache`` of its own type, so that
``--kv-bits`` leaves it in floats, as mlx-vlm leaves its ``ChunkedKVCache``) and the adapter's
language model (``ChunkedLanguageModel``) runs mlx-vlm's layers with masks built per row from each
row's own positions: a key is seen if it is the row's, not later, and (chunked layers) in the same chunk.

mlx-vlm's NoPE layers scale their queries by ``log(floor(position / floor_scale) + 1) * attn_scale + 1``
with the batch's longest row's positions (``offset.max()``), which from ``floor_scale`` (8192 real) on are
not a shorter row's: the adapter gives those layers ``RowTemperatureAttention``, which scales each row by
its own positions, the same operations on the same values as mlx-vlm's on one request.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
from mlx_vlm.models.base import LanguageModelOutput, scaled_dot_product_attention
from mlx_vlm.models.cache import BatchKVCache, KVCache
from mlx_vlm.models.llama4.language import Attention

from vlmserve.engine.models.base import ModelAdapter
from vlmserve.preprocess.image_sizes import ProcessorLimit, limit_of


class ChunkKVCache(KVCache):
    """A chunked-attention layer's KV, kept whole (the mask picks the chunk)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx-vlm leaves its caches unannotated

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        return ChunkBatchKVCache.merge(caches)

    def to_batch(self, left_padding: list[int]) -> Any:
        return ChunkBatchKVCache(left_padding)


class ChunkBatchKVCache(BatchKVCache):
    """A batch of chunked-attention layers' KV; rows taken out stay ``ChunkKVCache``."""

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        merged = super().merge(caches)  # type: ignore[no-untyped-call]
        return merged if isinstance(merged, cls) else cls([0] * len(caches))  # all empty: a plain one came back

    def extract(self, idx: int) -> Any:
        row = super().extract(idx)  # type: ignore[no-untyped-call]
        out = ChunkKVCache()
        out.keys, out.values, out.offset = row.keys, row.values, row.offset
        return out


class RowTemperatureAttention(Attention):
    """mlx-vlm's Llama 4 attention, whose NoPE queries in a batch are tuned by each row's own positions."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        offset = getattr(cache, "offset", 0)
        if self.use_rope or not self.attn_temperature_tuning or not isinstance(offset, mx.array):
            out: mx.array = super().__call__(x, mask, cache)  # one request: mlx-vlm's own
            return out
        rows, width, _ = x.shape
        queries, keys, values = (proj(x).reshape(rows, width, heads, -1).transpose(0, 2, 1, 3) for proj, heads in
                                 ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads),
                                  (self.v_proj, self.n_kv_heads)))
        # mlx-vlm's scale at 1-based positions; a padding column's are clamped to 1 (its output is never read)
        positions = mx.maximum(offset.reshape(-1, 1) + mx.arange(1, width + 1), 1)
        scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
        queries = (queries * scales[:, None, :, None]).astype(queries.dtype)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        projected: mx.array = self.o_proj(out.transpose(0, 2, 1, 3).reshape(rows, width, -1))
        return projected


def chunked(layer: int) -> bool:
    """mlx-vlm's rule: RoPE and chunked attention on three layers of four, the fourth global (NoPE)."""
    return (layer + 1) % 4 != 0


class ChunkedLanguageModel:
    """mlx-vlm's Llama 4 language model with masks that honour each row's left padding; every other
    attribute reads through to it (``model.layers``, ``lm_head``...)."""

    def __init__(self, language_model: Any) -> None:
        self.__dict__["language_model"] = language_model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["language_model"], name)

    def make_cache(self) -> list[Any]:
        layers = self.__dict__["language_model"].config.num_hidden_layers
        return [ChunkKVCache() if chunked(i) else KVCache() for i in range(layers)]  # type: ignore[no-untyped-call]

    def __call__(self, inputs: mx.array | None = None, inputs_embeds: mx.array | None = None, mask: Any = None,
                 cache: list[Any] | None = None, **kwargs: Any) -> LanguageModelOutput:
        lm = self.__dict__["language_model"]
        text = lm.model
        h = text.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        layers = text.layers
        caches = cache if cache is not None else [None] * len(layers)
        queries, keys = _positions(caches[0], h.shape[0], h.shape[1])
        # [B, 1, L, K]: a row's own keys, none later; a padding column's query sees the padding before it,
        # so that no softmax row is empty (its output is never read)
        seen = (keys <= queries) & ((keys >= 0) | (queries < 0))
        size = lm.config.attention_chunk_size
        local = seen & (keys // size == queries // size)
        for i, (layer, c) in enumerate(zip(layers, caches)):
            h = layer(h, local if chunked(i) else seen, cache=c)
        return LanguageModelOutput(logits=lm.lm_head(text.norm(h)))


def _positions(cache: Any, rows: int, width: int) -> tuple[mx.array, mx.array]:
    """Each row's query positions ``[B, 1, L, 1]`` in this forward and the positions of the keys it will
    attend to ``[B, 1, 1, K]`` (a padding column's is negative): a batch cache's column ``j`` is row ``b``'s
    position ``j - left_padding[b]``; a one-request cache's column is its position."""
    if cache is None:
        before, padding = 0, mx.zeros((rows,), dtype=mx.int32)
    elif hasattr(cache, "left_padding"):
        before, padding = int(cache._idx), cache.left_padding.astype(mx.int32)
    else:
        before, padding = int(cache.offset), mx.zeros((rows,), dtype=mx.int32)
    columns = mx.arange(before + width, dtype=mx.int32)
    keys = columns[None] - padding[:, None]  # [B, K]
    queries = keys[:, before:]  # [B, L]
    return queries[:, None, :, None], keys[:, None, None, :]


class Llama4Adapter(ModelAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llama4",)
    tool_format: ClassVar[str | None] = "llama4"
    # mlx-vlm's Llama 4 get_input_embeddings takes no cached_image_features: it always runs the tower
    vision_cache: ClassVar[bool] = False

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.language_model = ChunkedLanguageModel(model.language_model)
        for i, layer in enumerate(model.language_model.model.layers):
            if not chunked(i) and type(layer.self_attn) is Attention:
                layer.self_attn.__class__ = RowTemperatureAttention  # same weights; one request computes as before

    def make_cache(self) -> list[Any]:
        return ChunkedLanguageModel(self.model.language_model).make_cache()

    @property
    def mm_prefix_exact(self) -> bool:
        # Image tokens attend causally, and every forward's masks come from positions alone, so a chunk
        # after a restored prefix sees what a whole prefill's would (tested against cold prefills)
        return True

    @classmethod
    def processor_limit(cls, processor: Any) -> ProcessorLimit | None:
        return limit_of(processor, _tiles_limit)


def _tiles_limit(ip: Any) -> ProcessorLimit | None:
    """mlx-vlm's Llama4ImageProcessor stretches an image onto a canvas of ``size`` square tiles (one
    canvas, ``size`` x ``size``, where ``max_patches`` is 1)."""
    size, tiles = int(ip.size), int(ip.max_patches)
    if tiles <= 1:
        return ProcessorLimit(type(ip).__name__, fixed=(size, size))
    return None  # several canvases, each stretched to: no one size is safe to shrink an image to
