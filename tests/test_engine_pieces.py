"""A prompt or an image split into pieces (language model layers, vision tower blocks) gives
bitwise what one whole forward gives, on the real runner and MLX, for every family that splits.

The families tests prove layer pieces against mlx-vlm's own decode on micro models (their 16-token
budget splits every image prompt that cannot be chunked). Micro towers have one block, so the
tower's pieces are proven here, on the small models."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import scene

from vlmserve.engine.loader import load_model
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import EncodeChunk, NewRequest, PrefillChunk, SchedulerOutput
from vlmserve.engine.runner import ModelRunner
from vlmserve.engine.worker import MLXWorkerThread
from vlmserve.preprocess.prompt import PromptBuilder
from vlmserve.testing import build_model

SPLIT_TOWERS = ("gemma4", "qwen2_vl", "qwen2_5_vl", "qwen3_5", "glm4v", "glm4v_moe", "qwen3_5_moe", "internvl_chat",
                "kimi_vl")
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


class Poisoned:
    """Stands in for a block: NaN out, while ``before[0]`` is past its index. A piece that starts at
    block ``first`` must never use what the blocks before it return (it carries their state)."""

    def __init__(self, block: Any, index: int, before: list[int]) -> None:
        self.__dict__.update(block=block, index=index, before=before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["block"], name)

    def __call__(self, h: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.block(h, *args, **kwargs)
        if self.index >= self.before[0]:
            return out
        return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")


def _poison(owner: Any, attr: str, before: list[int]) -> None:
    setattr(owner, attr, [Poisoned(b, i, before) for i, b in enumerate(getattr(owner, attr))])


def _run(runner: ModelRunner, prompt: Any, encodes: list[EncodeChunk], prefills: list[tuple[int, int | None]],
         before: list[int] | None = None) -> tuple[Any, int]:
    """Embed one prompt through ``encodes``, prefill it through the layer pieces ``prefills``; returns
    its embedding and first token. ``before``: where the poisoned blocks start, set per piece."""
    request_id = encodes[0].request_id
    runner.execute(SchedulerOutput(new=[NewRequest(request_id, prompt, GREEDY)]))
    for piece in encodes:
        if before is not None:
            before[0] = piece.first_block
        out = runner.execute(SchedulerOutput(encode=[piece]))
        assert not out.errors, out.errors
    embedded = runner.prompts[request_id].embedded
    length = embedded.inputs_embeds.shape[1]
    for first, last in prefills:
        if before is not None:
            before[0] = first
        out = runner.execute(SchedulerOutput(prefill=[PrefillChunk(request_id, 0, length, first, last)]))
        assert not out.errors, out.errors
    runner.execute(SchedulerOutput(finished=[request_id]))
    return embedded, out.samples[request_id].token_id


def _same(a: Any, b: Any) -> bool:
    import mlx.core as mx

    if a.lm_kwargs.keys() != b.lm_kwargs.keys():
        return False
    pairs = [(a.inputs_embeds, b.inputs_embeds), *((a.lm_kwargs[k], b.lm_kwargs[k]) for k in a.lm_kwargs)]
    return all(not isinstance(x, mx.array) or mx.array_equal(x, y).item() for x, y in pairs)


@pytest.mark.parametrize("arch", SPLIT_TOWERS)
def test_an_image_and_its_prompt_a_block_and_a_layer_at_a_time_are_as_whole(arch: str) -> None:
    worker = MLXWorkerThread(name=f"pieces-{arch}")
    worker.start()
    try:
        loaded = worker.call(load_model, str(build_model(arch, "small")))
        prompter = PromptBuilder.for_processor(loaded.processor)
        image = scene("circle", (220, 30, 30))
        prompt = prompter.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                                [image])
        adapter = loaded.adapter
        blocks, layers = adapter.num_vision_blocks, adapter.num_layers
        assert blocks >= 2 and layers >= 2, f"{arch}: {blocks} tower block(s), {layers} layer(s): nothing to split"
        encodes = [EncodeChunk("split", i, i + 1 if i + 1 < blocks else None) for i in range(blocks)]
        prefills = [(i, i + 1 if i + 1 < layers else None) for i in range(layers)]

        def both() -> tuple[bool, bool]:
            whole, first_whole = _run(ModelRunner(loaded), prompt, [EncodeChunk("whole")], [(0, None)])
            before = [0]
            _poison(*adapter.vision_blocks(), before)
            _poison(adapter.language_model.model, "layers", before)
            split, first_split = _run(ModelRunner(loaded), prompt, encodes, prefills, before)
            return _same(whole, split), first_whole == first_split

        assert worker.call(both) == (True, True)
    finally:
        worker.shutdown()


def test_families_that_read_other_blocks_do_not_split_their_tower() -> None:
    """Qwen3-VL's DeepStack reads blocks before the last: its tower goes whole."""
    worker = MLXWorkerThread(name="pieces-qwen3_vl")
    worker.start()
    try:
        loaded = worker.call(load_model, str(build_model("qwen3_vl", "micro")))
        assert loaded.adapter.vision_blocks() is None and loaded.adapter.num_vision_blocks == 0
    finally:
        worker.shutdown()
