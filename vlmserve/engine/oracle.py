"""[worker] mlx-vlm's own answer to one request: its prompt path and its greedy decode, nothing of ours.

What a family nobody here has tested is checked against at start-up (``frontend/self_check.py``), and what
the tests hold every family to (``testing/reference.py``). Runs on the thread that loaded the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from vlmserve.engine.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class Answer:
    """mlx-vlm's prompt ids for one user turn and its greedy tokens after them."""

    prompt: list[int]
    tokens: list[int]


def greedy(model: Any, input_ids: mx.array, pixel_values: mx.array | None, arrays: dict[str, Any],
           max_tokens: int, **kv: Any) -> list[int]:
    """``mlx_vlm.generate``'s step function, greedy, on exactly these inputs (one unpadded row); never stops
    at EOS. ``kv``: its KV quantization keywords."""
    from mlx_vlm.generate.ar import generate_step

    mask = mx.ones(input_ids.shape, dtype=mx.int32)  # the processor's attention mask for one prompt
    steps = generate_step(input_ids, model, pixel_values, mask, max_tokens=max_tokens, temperature=0.0, **kv,
                          **arrays)
    return [int(token) for token, _ in steps]


def mlx_vlm_answer(loaded: LoadedModel, text: str, images: list[Any], max_tokens: int) -> Answer:
    """One user turn (``images`` first, then ``text``) as ``mlx_vlm.generate`` builds it (its
    ``apply_chat_template`` and ``prepare_inputs``) and decodes it greedily."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    model, processor = loaded.model, loaded.processor
    formatted = apply_chat_template(processor, model.config, text, num_images=len(images))
    add_special = should_add_special_tokens(model.config.model_type, processor)
    inputs = prepare_inputs(processor, images=images or None, prompts=formatted,  # type: ignore[no-untyped-call]
                            image_token_index=getattr(model.config, "image_token_index", None),
                            add_special_tokens=add_special)
    input_ids = mx.array(inputs["input_ids"])
    arrays = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    tokens = greedy(model, input_ids, inputs.get("pixel_values"), arrays, max_tokens)
    prompt: list[int] = input_ids[0].tolist()  # type: ignore[assignment]  # one row of ids
    return Answer(prompt, tokens)
