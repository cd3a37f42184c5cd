"""[worker] mlx-vlm's own view of one request: its prompt path, its greedy decode, and how far a decode is from it.

What a family nobody here has tested is checked against at start-up (``frontend/self_check.py``), and what
the tests hold every family to (``testing/reference.py``). Runs on the thread that loaded the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from vlmserve.engine.loader import LoadedModel

# Mantissa bits of each logits dtype: a token within ROUNDING_ULPS units in the last place of the best
# logit is as good as the best, since summing the same products in another order moves logits that far.
_MANTISSA = {mx.float32: 23, mx.float16: 10, mx.bfloat16: 7}
ROUNDING_ULPS = 8


@dataclass(frozen=True, slots=True)
class Inputs:
    """One user turn as ``mlx_vlm.generate`` builds it: ids ``[1, L]``, pixels, the processor's other arrays
    (the worker's arrays: never handed to another thread)."""

    input_ids: mx.array
    pixel_values: mx.array | None
    arrays: dict[str, Any]

    @property
    def ids(self) -> list[int]:
        ids: list[int] = self.input_ids[0].tolist()  # type: ignore[assignment]  # one row of ids
        return ids


def greedy(model: Any, input_ids: mx.array, pixel_values: mx.array | None, arrays: dict[str, Any],
           max_tokens: int, **kv: Any) -> list[int]:
    """``mlx_vlm.generate``'s step function, greedy, on exactly these inputs (one unpadded row); never stops
    at EOS. ``kv``: its KV quantization keywords."""
    from mlx_vlm.generate.ar import generate_step

    mask = mx.ones(input_ids.shape, dtype=mx.int32)  # the processor's attention mask for one prompt
    steps = generate_step(input_ids, model, pixel_values, mask, max_tokens=max_tokens, temperature=0.0, **kv,
                          **arrays)
    return [int(token) for token, _ in steps]


def mlx_vlm_inputs(loaded: LoadedModel, text: str, images: list[Any]) -> Inputs:
    """One user turn (``images`` first, then ``text``) through mlx-vlm's ``apply_chat_template`` and
    ``prepare_inputs``, as ``mlx_vlm.generate`` calls them."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    model, processor = loaded.model, loaded.processor
    formatted = apply_chat_template(processor, model.config, text, num_images=len(images))
    add_special = should_add_special_tokens(model.config.model_type, processor)
    inputs = prepare_inputs(processor, images=images or None, prompts=formatted,  # type: ignore[no-untyped-call]
                            image_token_index=getattr(model.config, "image_token_index", None),
                            add_special_tokens=add_special)
    arrays = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    return Inputs(mx.array(inputs["input_ids"]), inputs.get("pixel_values"), arrays)


def mlx_vlm_prompt(loaded: LoadedModel, text: str, images: list[Any]) -> list[int]:
    """The prompt ids of one user turn as mlx-vlm builds it."""
    return mlx_vlm_inputs(loaded, text, images).ids


def first_departure(loaded: LoadedModel, text: str, images: list[Any], tokens: list[int]) -> int | None:
    """Where ``tokens``, decoded greedily after one user turn, first leave mlx-vlm's greedy choice by more than
    rounding (None: nowhere). mlx-vlm's model reads its own prompt and the tokens in one forward; at each
    position the token taken must be its best, or within ``ROUNDING_ULPS`` of it in the logits' own dtype."""
    inputs = mlx_vlm_inputs(loaded, text, images)
    steps = mx.array([tokens], dtype=inputs.input_ids.dtype)
    ids = mx.concatenate([inputs.input_ids, steps], axis=1)
    # no mask: the model's own causal one (SmolVLM's forward reads a mask of ones as something else)
    logits = loaded.model(ids, inputs.pixel_values, **inputs.arrays).logits[0]
    length = inputs.input_ids.shape[1]
    scored = logits[length - 1: length - 1 + len(tokens)]
    bits = _MANTISSA.get(scored.dtype, 23)
    scored = scored.astype(mx.float32)
    best = scored.max(axis=-1)
    taken = mx.take_along_axis(scored, steps[0, :, None], axis=-1)[:, 0]
    for i, (top, got) in enumerate(zip(best.tolist(), taken.tolist())):  # type: ignore[arg-type]
        ulp = 2.0 ** (math.frexp(max(abs(top), 1.0))[1] - 1 - bits)
        if top - got > ROUNDING_ULPS * ulp:
            return i
    return None
