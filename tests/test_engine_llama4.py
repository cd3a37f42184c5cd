"""Llama 4's adapter: chunked attention and NoPE temperature exact in a left-padded batch (issue 56).

mlx-vlm's Llama 4 builds its chunk mask from the batch's column, not each row's position, and tunes its
NoPE layers' queries by the longest row's positions; the adapter's language model and attention do both per
row. Here a short row padded beside a long one must give the logits it gives alone, on the micro build
(chunks of 32 tokens, so both rows cross one), against mlx-vlm's own forward, which must not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from vlmserve.testing import build_model

LONG, SHORT = list(range(30, 80)), list(range(100, 130))  # 50 and 30 tokens: the short row is padded by 20


@pytest.fixture(scope="module")
def model() -> Any:
    from mlx_vlm import load

    return load(str(build_model("llama4", "micro")))[0]


@pytest.fixture
def adapter(model: Any) -> Iterator[Any]:
    from vlmserve.engine.models import adapter_for

    yield adapter_for(model, "llama4")


def _alone(model: Any, ids: list[int]) -> mx.array:
    """mlx-vlm's own forward for one request (its ChunkedKVCache), prompt then its last token: the last logits."""
    lm, x = model.language_model, mx.array([ids])
    cache = lm.make_cache()
    lm(x[:, :-1], cache=cache)
    return lm(x[:, -1:], cache=cache).logits[0, -1]


def _batched(language_model: Any, cache: list[Any]) -> mx.array:
    """Both rows left-padded into one batch cache, the same two forwards: each row's last logits."""
    padded = mx.array([LONG, [0] * (len(LONG) - len(SHORT)) + SHORT])
    language_model(padded[:, :-1], cache=cache)
    return language_model(padded[:, -1:], cache=cache).logits[:, -1]


def _errors(model: Any, batched: mx.array) -> list[float]:
    return [float(mx.abs(batched[i] - _alone(model, ids)).max()) for i, ids in enumerate((LONG, SHORT))]


def test_chunked_layers_honour_each_rows_left_padding(model: Any, adapter: Any) -> None:
    from mlx_vlm.generate.ar import _make_cache

    padding = [0, len(LONG) - len(SHORT)]
    mlx_vlm = _errors(model, _batched(model.language_model, _make_cache(model.language_model, padding)))
    assert mlx_vlm[0] == 0 and mlx_vlm[1] > 1e-3  # mlx-vlm's own forward gets the padded row wrong
    assert _errors(model, _batched(adapter.language_model, _make_cache(adapter.language_model, padding))) == [0, 0]


def test_nope_temperature_is_each_rows_own(model: Any, adapter: Any) -> None:
    """With ``floor_scale`` at 16, the rows' NoPE queries are tuned differently (1 + 0.1 log 4 against log 2)."""
    from mlx_vlm.generate.ar import _make_cache

    layers = model.language_model.model.layers
    kept = [layer.self_attn.floor_scale for layer in layers]
    try:
        for layer in layers:
            layer.self_attn.floor_scale = 16
        cache = _make_cache(adapter.language_model, [0, len(LONG) - len(SHORT)])
        assert _errors(model, _batched(adapter.language_model, cache)) == [0, 0]
    finally:
        for layer, scale in zip(layers, kept):
            layer.self_attn.floor_scale = scale


def test_chunked_layers_stay_their_own_type_and_in_floats(adapter: Any) -> None:
    """A request's chunked layers merge into a batch and come back out as chunked ones, and --kv-bits packs
    only the global layers, as mlx-vlm's generate does (its ChunkedKVCache has no to_quantized)."""
    from vlmserve.engine.kv_quant import KVQuant, is_quantized, merge_rows
    from vlmserve.engine.models.llama4 import ChunkBatchKVCache, ChunkKVCache

    cache = adapter.make_cache()
    keys = mx.ones((1, 1, 40, 32))
    for layer in cache:
        layer.update_and_fetch(keys, keys)
    merged = [merge_rows(layer, 2) for layer in cache]
    assert [type(layer) is ChunkBatchKVCache for layer in merged] == [True, True, True, False]
    assert type(merged[0].extract(1)) is ChunkKVCache
    KVQuant(bits=8, group_size=32).settle(cache)
    assert [is_quantized(layer) for layer in cache] == [False, False, False, True]
