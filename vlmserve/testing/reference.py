"""[worker] The correctness oracle: mlx-vlm's own single-request greedy decode.

For families we cannot train, what mlx-vlm computes is the truth: our engine, alone or batched,
must produce the same greedy tokens from the same prompt token ids and pixel values. Run it on
the thread that loaded the model (the engine's worker: ``worker.call(reference_greedy, ...)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from vlmserve.engine.loader import LoadedModel
from vlmserve.engine.oracle import greedy, mlx_vlm_inputs
from vlmserve.engine.runner import on_device
from vlmserve.inputs import PromptInputs


def reference_greedy(model: Any, prompt: PromptInputs, max_tokens: int, **kv: Any) -> list[int]:
    """``mlx_vlm.generate``'s step function, greedy, on exactly these inputs; never stops at EOS. ``kv``:
    its KV quantization keywords (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``)."""
    input_ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
    arrays = on_device(prompt.arrays)
    pixel_values = arrays.pop("pixel_values", None)
    with _windows_kept(bool(kv.get("kv_bits"))):
        return greedy(model, input_ids, pixel_values, arrays, max_tokens, **kv)


def mlx_vlm_answer(loaded: LoadedModel, text: str, images: list[Any], max_tokens: int) -> tuple[list[int], list[int]]:
    """One user turn wholly as ``mlx_vlm.generate`` answers it: its prompt ids and greedy tokens."""
    inputs = mlx_vlm_inputs(loaded, text, images)
    return inputs.ids, greedy(loaded.model, inputs.input_ids, inputs.pixel_values, inputs.arrays, max_tokens)


@contextmanager
def _windows_kept(on: bool) -> Iterator[None]:
    """While open, mlx-vlm's KV quantization leaves sliding-window layers as they are (its own tries
    to pack them and raises NotImplementedError): every other layer is packed by mlx-vlm's code."""
    import sys

    from mlx_vlm.generate.common import maybe_quantize_kv_cache
    from mlx_vlm.models.cache import RotatingKVCache

    def plain_only(prompt_cache: list[Any], *args: Any, **kwargs: Any) -> None:
        plain = [i for i, c in enumerate(prompt_cache) if not isinstance(c, RotatingKVCache)]
        view = [prompt_cache[i] for i in plain]
        maybe_quantize_kv_cache(view, *args, **kwargs)
        for i, layer in zip(plain, view):
            prompt_cache[i] = layer

    if not on:
        yield
        return
    module = sys.modules["mlx_vlm.generate"]  # the package (``mlx_vlm.generate`` is its function of that name)
    module.maybe_quantize_kv_cache = plain_only  # type: ignore[attr-defined]  # generate_step looks it up here
    try:
        yield
    finally:
        del module.maybe_quantize_kv_cache  # type: ignore[attr-defined]


def reference_prompt_logprobs(model: Any, prompt: PromptInputs) -> list[float | None]:
    """Each prompt token's logprob given the tokens before it, from one whole forward of mlx-vlm's
    model (no cache, no chunks); the first is None."""
    input_ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
    out = model(input_ids, None)  # no mask: the causal one, as generate_step's prefill has
    logits = out.logits[0].astype(mx.float32)
    scored = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(scored[:-1], input_ids[0, 1:, None], axis=-1)[:, 0]
    return [None, *(float(x) for x in chosen.tolist())]
