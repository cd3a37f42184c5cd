"""[worker] The correctness oracle: mlx-vlm's own single-request greedy decode.

For families we cannot train, what mlx-vlm computes is the truth: our engine, alone or batched,
must produce the same greedy tokens from the same prompt token ids and pixel values. Run it on
the thread that loaded the model (the engine's worker: ``worker.call(reference_greedy, ...)``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vlmserve.engine.params import PromptInputs
from vlmserve.engine.runner import on_device


def reference_greedy(model: Any, prompt: PromptInputs, max_tokens: int) -> list[int]:
    """``mlx_vlm.generate``'s step function, greedy, on exactly these inputs; never stops at EOS."""
    from mlx_vlm.generate.ar import generate_step

    input_ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
    arrays = on_device(prompt.arrays)
    pixel_values = arrays.pop("pixel_values", None)
    mask = mx.ones(input_ids.shape, dtype=mx.int32)  # the processor's attention mask for one prompt
    steps = generate_step(input_ids, model, pixel_values, mask, max_tokens=max_tokens, temperature=0.0, **arrays)
    return [int(token) for token, _ in steps]


def reference_prompt_logprobs(model: Any, prompt: PromptInputs) -> list[float | None]:
    """Each prompt token's logprob given the tokens before it, from one whole forward of mlx-vlm's
    model (no cache, no chunks); the first is None."""
    input_ids = mx.array(prompt.input_ids, dtype=mx.int32)[None]
    out = model(input_ids, None)  # no mask: the causal one, as generate_step's prefill has
    logits = out.logits[0].astype(mx.float32)
    scored = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(scored[:-1], input_ids[0, 1:, None], axis=-1)[:, 0]
    return [None, *(float(x) for x in chosen.tolist())]
