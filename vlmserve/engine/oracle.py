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
    rounding (None: nowhere). mlx-vlm's prompt goes through its model as ``generate_step`` runs it (the
    embeddings, then the language model over its own cache), then the tokens one decode step each; at each
    position the token taken must be the best, or within ``ROUNDING_ULPS`` of it in the logits' own dtype."""
    from mlx_vlm.models.cache import make_prompt_cache

    inputs, model = mlx_vlm_inputs(loaded, text, images), loaded.model
    mask = mx.ones(inputs.input_ids.shape, dtype=mx.int32)
    embedded = model.get_input_embeddings(inputs.input_ids, inputs.pixel_values, mask=mask, **inputs.arrays)
    extra = {k: v for k, v in embedded.to_dict().items() if k != "inputs_embeds" and v is not None}
    cache = make_prompt_cache(model.language_model)
    out = model.language_model(inputs.input_ids, inputs_embeds=embedded.inputs_embeds, cache=cache, logits_to_keep=1,
                               **inputs.arrays, **extra)
    rows = [out.logits[0, -1]]
    for token in tokens[:-1]:
        rows.append(model.language_model(mx.array([[token]]), cache=cache, logits_to_keep=1).logits[0, -1])
    scored = mx.stack(rows)
    bits = _MANTISSA.get(scored.dtype, 23)
    scored = scored.astype(mx.float32)
    best = scored.max(axis=-1)
    taken = mx.take_along_axis(scored, mx.array(tokens)[:, None], axis=-1)[:, 0]
    tops: list[float] = best.tolist()  # type: ignore[assignment]  # one per token
    takens: list[float] = taken.tolist()  # type: ignore[assignment]
    for i, (top, got) in enumerate(zip(tops, takens)):
        ulp = 2.0 ** (math.frexp(max(abs(top), 1.0))[1] - 1 - bits)
        if top - got > ROUNDING_ULPS * ulp:
            return i
    return None
