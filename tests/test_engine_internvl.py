"""InternVL3/3.5 (issue 56): the checkpoint's chat template renders prompts, and decoding keeps the tile
grid mlx-vlm's processor cuts.

mlx-vlm's InternVLChatProcessor carries a chat template of its own, which renders only list-of-parts
content (a string renders as ``User: \\nAssistant:\\n``) and would win over the checkpoint's
``chat_template.jinja``. Phase 1 takes a template that is only a processor class's default as none of
the checkpoint's, for any processor (``templater_of``); the engine's answers on the ids it renders are
mlx-vlm's own (tests/test_families.py's parity).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from test_families import _photo, image_bytes

from vlmserve.engine.models import adapter_class
from vlmserve.preprocess.images import decode_image
from vlmserve.preprocess.prompt import PromptBuilder, templater_of, tokenizer_of
from vlmserve.testing import build_model

WORDS = "zebra crossing at noon"


class _Tokenizer:
    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template


class _Processor:
    """A processor class that brings a template of its own, as mlx-vlm's InternVLChatProcessor does."""

    def __init__(self, tokenizer: _Tokenizer, chat_template: str = "{{ 'built in' }}") -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template


def test_a_processor_class_default_template_yields_to_the_checkpoints() -> None:
    checkpoint = _Processor(_Tokenizer("{{ 'the checkpoint' }}"))
    assert templater_of(checkpoint) is checkpoint.tokenizer
    given = _Processor(_Tokenizer("{{ 'the checkpoint' }}"), chat_template="{{ 'given' }}")
    assert templater_of(given) is given  # a template handed to the processor (its checkpoint's) is kept
    alone = _Processor(_Tokenizer(None))
    assert templater_of(alone) is alone  # no template of the checkpoint's: the processor's is all there is


@pytest.fixture(scope="module")
def processor() -> Any:
    from mlx_vlm.utils import load_processor

    importlib.import_module("mlx_vlm.models.internvl_chat")  # registers mlx-vlm's processor class
    return load_processor(build_model("internvl_chat", "micro"), add_detokenizer=False)


def test_string_content_keeps_its_words(processor: Any) -> None:
    builder = PromptBuilder.for_processor(processor)
    as_string = builder.build([{"role": "user", "content": WORDS}])
    as_parts = builder.build([{"role": "user", "content": [{"type": "text", "text": WORDS}]}])
    assert as_string.input_ids == as_parts.input_ids
    text = tokenizer_of(processor).decode(as_string.input_ids)
    assert text == f"<|im_start|>user\n{WORDS}<|im_end|>\n<|im_start|>assistant\n"
    # the processor's own template, which mlx-vlm leaves on it, loses them
    builtin = processor.apply_chat_template([{"role": "user", "content": WORDS}], tokenize=False,
                                            add_generation_prompt=True)
    assert WORDS not in builtin


@pytest.mark.parametrize("size", [(960, 720), (720, 960), (1200, 300), (300, 1200), (800, 800), (130, 70)])
def test_a_shrunk_image_is_tiled_as_the_whole_one(processor: Any, size: tuple[int, int]) -> None:
    """The same grid (so the same tokens and tile count) from the image decoded at reduced size as from
    the whole one, and nearly the same pixels; a large one is decoded smaller."""
    adapter = adapter_class("internvl_chat")
    assert adapter is not None
    limit = adapter.processor_limit(processor)
    builder = PromptBuilder.for_processor(processor, limit=limit)
    data = image_bytes(_photo(*size))
    full, reduced = decode_image(data), decode_image(data, keep=limit)
    parts = [{"type": "image"}, {"type": "text", "text": "describe it"}]
    want, got = (builder.build([{"role": "user", "content": parts}], [image]) for image in (full, reduced))
    assert got.input_ids == want.input_ids
    a, b = np.asarray(want.arrays["pixel_values"]), np.asarray(got.arrays["pixel_values"])
    assert a.shape == b.shape
    assert float(np.abs(a - b).mean()) < 0.05 * float(np.abs(a).max())
    if min(size) >= 300:
        assert reduced.width <= full.width // 2
