"""Every supported model family on the real worker, runner and MLX, with micro models built offline.

The oracle for families we cannot train is mlx-vlm itself: on the same prompt token ids and pixel
values, our engine's greedy tokens, alone and in a batch of 8, equal mlx-vlm's own single-request
greedy decode (``generate_step``). The engine runs with a 16-token prefill budget, so every prompt
that may be chunked is, and parity also proves chunked prefill right.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import scene
from PIL import Image, ImageDraw

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.models import adapter_class
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.plan import EncodeChunk, NewRequest, SchedulerOutput
from vlmserve.engine.vision_cache import VisionCache
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.images import decode_image
from vlmserve.preprocess.prompt import PromptBuilder, PromptError
from vlmserve.testing import ARCHS, FAMILY_BUILDS, build_family, build_model
from vlmserve.testing.reference import reference_greedy
from vlmserve.testing.tool_tuning import WEATHER_TOOL

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SYSTEM = {"role": "system", "content": "Be brief."}  # Mistral 3's template writes a long dated one without
LONG = "Tell me everything about the colours and shapes you know, one by one, slowly. " * 2


@dataclass
class Family:
    arch: str
    engine: AsyncEngine
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    @property
    def max_images(self) -> int:
        return self.engine.loaded.adapter.max_images or 2

    def prompt(self, text: str, images: list[Any] = ()) -> PromptInputs:
        parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        return self.engine.prompter.build([SYSTEM, {"role": "user", "content": parts}], list(images))

    async def tokens(self, request_id: str, prompt: PromptInputs, params: SamplingParams = GREEDY) -> list[int]:
        out: list[int] = []
        async for step in self.engine.generate(request_id, prompt, params):
            assert step.error is None, step.error
            out += step.token_ids
        return out

    def reference(self, prompt: PromptInputs, n: int = GREEDY.max_tokens) -> list[int]:
        return self.engine.worker.call(reference_greedy, self.engine.loaded.model, prompt, n)


def _start(path: Any, **config: Any) -> Family:
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(str(path), config=EngineConfig(**{"max_batch_size": 8, "prefill_chunk": 16, **config}))
    loop.run_until_complete(engine.start())
    return Family(engine.loaded.model_type, engine, loop)


def _stop(family: Family) -> None:
    family.run(family.engine.shutdown())
    family.loop.close()


@pytest.fixture(scope="module", params=FAMILY_BUILDS)
def family(request: pytest.FixtureRequest) -> Iterator[Family]:
    started = _start(build_family(request.param))
    yield started
    _stop(started)


def _images() -> tuple[Any, Any, Any]:
    return scene("circle", (220, 30, 30)), scene("square", (30, 60, 220), size=80), scene("triangle", (30, 170, 60))


def test_text_and_image_requests_succeed_and_images_matter(family: Family) -> None:
    red, blue, _ = _images()
    text = family.run(family.tokens("text", family.prompt("hello there")))
    with_red = family.run(family.tokens("red", family.prompt("describe it", [red])))
    with_blue = family.run(family.tokens("blue", family.prompt("describe it", [blue])))
    assert len(text) == len(with_red) == len(with_blue) == GREEDY.max_tokens
    assert with_red != with_blue


def test_greedy_tokens_equal_mlx_vlm_reference(family: Family) -> None:
    red, blue, _ = _images()
    cases = [("hello there", []), (LONG, []), ("describe it", [red]), (LONG, [blue])]
    if family.max_images > 1:
        cases.append(("compare the two", [red, blue]))
    for i, (text, images) in enumerate(cases):
        prompt = family.prompt(text, images)
        ours = family.run(family.tokens(f"p{i}", prompt))
        assert ours == family.reference(prompt), f"{family.arch}: case {i} ({len(images)} images)"


SHOT_CALL = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "screenshot", "arguments": {}}}


def _tool_result_prompt(family: Family, image: Any) -> PromptInputs:
    """A screenshot tool's result with the picture in it, as the chat API hands it on."""
    result = [{"type": "text", "text": "The page:"}, {"type": "image"}]
    return family.engine.prompter.build([SYSTEM, {"role": "user", "content": "Check the page."},
                                         {"role": "assistant", "content": "", "tool_calls": [SHOT_CALL]},
                                         {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": result}], [image])


def test_an_image_in_a_tool_result_pairs_with_its_pixels(family: Family) -> None:
    """Inside the result where the template writes it there (Qwen3-VL, Qwen3.5, GLM-4.xV), written in its text
    (Mistral 3.2), joined to the result's user turn (Gemma 3, Pixtral), else in a user turn after it: greedy
    tokens equal mlx-vlm's on the same ids and pixel values, and the image matters."""
    red, blue, _ = _images()
    prompts = [_tool_result_prompt(family, image) for image in (red, blue)]
    ours = [family.run(family.tokens(f"shot{i}", prompt)) for i, prompt in enumerate(prompts)]
    assert ours == [family.reference(prompt) for prompt in prompts]
    assert ours[0] != ours[1]


def test_an_image_in_the_first_turn_with_tools_pairs_with_its_pixels(family: Family) -> None:
    """Llama 4's template writes the first user turn into its tools preamble as a string: the image was a 400
    ("Found 0 placeholders"). Greedy tokens equal mlx-vlm's on the same ids and pixel values, with the image's
    placeholders all there; on Llama 4 the image matters (after a long preamble, some micro models' do not)."""
    red, blue, _ = _images()
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the weather here?"}]}
    prompts = [family.engine.prompter.build([SYSTEM, first], [image], [WEATHER_TOOL]) for image in (red, blue)]
    ours = [family.run(family.tokens(f"first{i}", prompt)) for i, prompt in enumerate(prompts)]
    assert ours == [family.reference(prompt) for prompt in prompts]
    media = family.engine.prompter.media_token_ids
    placeholders = [sum(i in media for i in p.input_ids) for p in (prompts[0], family.prompt("What?", [red]))]
    assert placeholders[0] == placeholders[1]
    assert ours[0] != ours[1] or family.arch != "llama4"


def test_batch_invariance_of_eight_mixed_requests(family: Family) -> None:
    """Text and image prompts of different lengths, sharing prefixes, joining at different steps."""
    red, blue, green = _images()
    cases = [("hi", []), ("describe it", [red]), (LONG, []), (LONG + " and more", []), ("what shape?", [green]),
             ("x", []), (LONG, [blue]), ("short answer please", [])]
    prompts = [family.prompt(text, images) for text, images in cases]
    alone = [family.run(family.tokens(f"a{i}", p)) for i, p in enumerate(prompts)]

    sizes: list[int] = []

    async def together() -> list[list[int]]:
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(family.tokens(f"b{i}", prompt)))
            steps = family.engine.metrics.steps
            while family.engine.metrics.steps < steps + i % 3:  # join 0, 1 or 2 steps apart
                await asyncio.sleep(0.001)
        while not all(t.done() for t in tasks):
            sizes.append(family.engine.metrics.batch_size)
            await asyncio.sleep(0.001)
        return [t.result() for t in tasks]

    assert family.run(together()) == alone
    assert max(sizes) >= 3  # they really shared decode steps
    stats = family.run(family.engine.stats())
    assert stats.running == stats.waiting == stats.batch_size == 0


def test_prompts_that_start_together_prefill_together_as_alone(family: Family) -> None:
    """Whole prompts admitted in one step share one left-padded forward where the family allows it."""
    red, blue, green = _images()
    cases = [("hi", []), ("describe it", [red]), (LONG, []), ("what shape?", [green]), ("x", [blue])]
    if family.max_images > 1:  # prompts with different image counts in one forward (SmolVLM's mask failed it)
        cases.append(("compare the two", [red, blue]))
    together = _start(family.engine.model_spec, prefill_chunk=512)  # every prompt goes whole
    try:
        prompts = [together.prompt(text, images) for text, images in cases]
        alone = [family.reference(p) for p in prompts]
        before = together.run(together.engine.stats()).prefill_batches

        async def all_at_once() -> list[list[int]]:
            hold = threading.Event()
            together.engine.worker.submit(hold.wait, 30)  # the worker waits while all of them are posted
            tasks = [asyncio.create_task(together.tokens(f"t{i}", p)) for i, p in enumerate(prompts)]
            await asyncio.sleep(0.05)
            hold.set()
            return list(await asyncio.gather(*tasks))

        assert together.run(all_at_once()) == alone
        after = together.run(together.engine.stats())
        batches = after.prefill_batches - before
        # A prefix stored from a row of the batch serves a later prompt as if it had been alone.
        assert together.run(together.tokens("again", prompts[2])) == alone[2]
        hits = together.run(together.engine.stats()).prefix.hits - after.prefix.hits
    finally:
        _stop(together)
    adapter = family.engine.loaded.adapter
    if all(adapter.can_batch(p) for p in prompts):
        assert batches >= 1
    assert batches >= 1 or not adapter.batch_prefill
    recurrent = family.arch in ("qwen3_5", "lfm2_vl")  # their recurrent state cannot be trimmed to reuse
    assert hits == 1 or recurrent or not adapter.reuses_prefix


def test_image_prompts_admitted_together_share_one_vision_forward(family: Family) -> None:
    """Where the family allows it, one get_input_embeddings call for several image prompts gives
    each exactly the embeddings and keywords it gets alone (bitwise)."""
    import mlx.core as mx

    red, _, green = _images()
    prompts = [family.prompt("describe it", [red]), family.prompt(LONG, [green]), family.prompt("x", [red])]
    ids = [f"v{i}" for i in range(len(prompts))]

    def embeddings(grouped: bool, vision_cache: Any = None) -> tuple[list[list[str]], list[Any]]:
        runner = family.engine.core.runner
        kept, runner.caches.vision = runner.caches.vision, vision_cache  # the tower itself, batched or not
        runner.execute(SchedulerOutput(new=[NewRequest(r, p, GREEDY) for r, p in zip(ids, prompts)]))
        groups = runner.embedding_groups(ids) if grouped else [[r] for r in ids]
        for group in groups:  # the runner shares a vision forward among the prompts one plan encodes
            assert not runner.execute(SchedulerOutput(encode=[EncodeChunk(r) for r in group])).errors
        out = [runner.prompts[r].embedded for r in ids]
        runner.execute(SchedulerOutput(finished=ids))
        runner.caches.vision = kept
        return groups, out

    def same(a: Any, b: Any) -> bool:  # on the worker: its arrays live on its stream
        if a.lm_kwargs.keys() != b.lm_kwargs.keys():
            return False
        pairs = [(a.inputs_embeds, b.inputs_embeds), *((a.lm_kwargs[k], b.lm_kwargs[k]) for k in a.lm_kwargs)]
        return all(type(x) is type(y) and (not isinstance(x, mx.array) or mx.array_equal(x, y).item()) for x, y in pairs)

    groups, together = family.engine.worker.call(embeddings, True)
    _, alone = family.engine.worker.call(embeddings, False)
    assert (len(groups) == 1) == family.engine.loaded.adapter.batch_embed
    assert [family.engine.worker.call(same, a, b) for a, b in zip(alone, together)] == [True] * len(prompts)
    if family.engine.loaded.adapter.vision_cache:  # features from the cache embed exactly as the tower's
        cache = VisionCache(1 << 30)
        _, cached = family.engine.worker.call(embeddings, False, cache)
        assert (cache.misses, cache.hits) == (2, 1)  # red twice: encoded once
        assert [family.engine.worker.call(same, a, b) for a, b in zip(alone, cached)] == [True] * len(prompts)


@pytest.mark.parametrize("family", ["paligemma", "llava_next"], indirect=True)
def test_more_images_than_the_family_takes_is_refused(family: Family) -> None:
    """mlx-vlm encodes only the first image for these: a second one is refused, not dropped."""
    red, blue, _ = _images()
    with pytest.raises(PromptError, match="at most 1 image"):
        family.run(family.tokens("two", family.prompt("compare", [red, blue])))


# A MoE at small, whose expert widths are multiples of convert's group of 64: its experts are quantized too
@pytest.mark.parametrize("arch, size", [("qwen2_5_vl", "micro"), ("gemma3", "micro"), ("qwen3_5_moe", "small")])
def test_four_bit_weights_match_mlx_vlm_on_the_same_weights(arch: str, size: str) -> None:
    family = _start(build_model(arch, size, quant_bits=4))
    try:
        mlp = family.engine.loaded.model.language_model.model.layers[0].mlp
        assert getattr(mlp, "switch_mlp", mlp).down_proj.bits == 4
        red, _, _ = _images()
        for i, (text, images) in enumerate([("hello there", []), ("describe it", [red])]):
            prompt = family.prompt(text, images)
            assert family.run(family.tokens(f"q{i}", prompt)) == family.reference(prompt)
    finally:
        _stop(family)


def image_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _photo(width: int, height: int) -> Any:
    """A smooth picture with shapes, as a downscaled photo would be (no pixel-level noise)."""
    image = Image.new("RGB", (width, height))
    image.putdata([(255 * x // width, 255 * y // height, 128) for y in range(height) for x in range(width)])
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 8, height // 8, width // 2, height // 2), fill=(220, 30, 30))
    draw.rectangle((width // 2, height // 2, 7 * width // 8, 7 * height // 8), fill=(30, 60, 220))
    return image


def _processor(arch: str) -> Any:
    """The micro model's processor alone, as mlx_vlm.load gives it."""
    from mlx_vlm.utils import load_processor

    importlib.import_module(f"mlx_vlm.models.{arch}")  # registers mlx-vlm's processor classes
    return load_processor(build_model(arch, "micro"), add_detokenizer=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_large_images_are_decoded_no_smaller_than_the_processor_keeps(arch: str) -> None:
    """Issue 31: an image larger than the processor uses is decoded at reduced size, never below its
    limit (the rule the family's adapter names, read from its processor's config): the prompt keeps
    its tokens and nearly its pixels; an image the processor would not shrink reaches it unchanged,
    so parity holds exactly."""
    adapter = adapter_class(arch)
    assert adapter is not None, f"{arch}: no adapter"
    processor = _processor(arch)
    limit = adapter.processor_limit(processor)
    assert limit is not None, f"{arch}: no processor limit"
    prompter = PromptBuilder.for_processor(processor, limit=limit)

    def prompt(image: Any) -> PromptInputs:
        parts = [{"type": "image"}, {"type": "text", "text": "describe it"}]
        return prompter.build([SYSTEM, {"role": "user", "content": parts}], [image])

    width, height = 960, 720
    while limit.reduction(width, height) < 3:  # a processor that keeps more than that (Kimi-VL's 4096 patches)
        width, height = 2 * width, 2 * height
    large = image_bytes(_photo(width, height))
    full, reduced = decode_image(large), decode_image(large, keep=limit)
    assert reduced.width < full.width // 2, (arch, limit, reduced.size)
    want, got = prompt(full), prompt(reduced)
    assert got.input_ids == want.input_ids
    assert want.arrays.keys() == got.arrays.keys()
    for key in (k for k in want.arrays if k.startswith("pixel_values")):  # not LLaVA-NeXT's original image_sizes
        a, b = np.asarray(want.arrays[key], np.float32), np.asarray(got.arrays[key], np.float32)
        assert a.shape == b.shape, key
        assert float(np.abs(a - b).mean()) < 0.02 * float(np.abs(a).max()), (key, float(np.abs(a - b).mean()))
    small = image_bytes(_photo(40, 30))
    assert np.array_equal(np.asarray(decode_image(small, keep=limit)), np.asarray(decode_image(small)))


# Processors widened past their size fields (micro ones see 64 px, where every rule keeps about as much)
WIDER = {"gemma4": {"max_soft_tokens": 280},  # a soft-token budget, not its 64x64 ``size``
         "llava_next": {"image_grid_pinpoints": [[32, 32], [192, 256], [256, 192]]}}  # the anyres grid, not the CLIP view


@pytest.mark.parametrize("arch", sorted(WIDER))
def test_a_family_whose_processor_sees_past_its_size_fields_keeps_what_it_sees(arch: str) -> None:
    """Gemma 4 resizes to its soft-token budget and LLaVA-NeXT into its anyres grid: their adapters' rules
    keep that much, where the size fields' rule (the default) would shrink the picture below it."""
    processor = _processor(arch)
    for name, value in WIDER[arch].items():
        setattr(processor.image_processor, name, value)
    adapter = adapter_class(arch)
    assert adapter is not None
    limit = adapter.processor_limit(processor)
    prompter = PromptBuilder.for_processor(processor, limit=limit)
    parts = [{"type": "image"}, {"type": "text", "text": "describe it"}]
    large = image_bytes(_photo(960, 720))
    full, reduced = decode_image(large), decode_image(large, keep=limit)
    want, got = (prompter.build([{"role": "user", "content": parts}], [image]) for image in (full, reduced))
    assert reduced.width < full.width // 2 and got.input_ids == want.input_ids
    a, b = np.asarray(want.arrays["pixel_values"], np.float32), np.asarray(got.arrays["pixel_values"], np.float32)
    # the default's picture comes back upscaled: 0.9% (Gemma 4) and 2.5% (LLaVA-NeXT) off, against 0.1% here
    assert float(np.abs(a - b).mean()) < 0.003 * float(np.abs(a).max())


def test_gemma3_with_pan_and_scan_decodes_images_whole() -> None:
    """Its crops are cut from the full image, so no size is safe to shrink it to."""
    processor = _processor("gemma3")
    processor.image_processor.do_pan_and_scan = True
    adapter = adapter_class("gemma3")
    assert adapter is not None and adapter.processor_limit(processor) is None


def test_the_engine_decodes_images_by_its_adapters_limit(family: Family) -> None:
    """Issue 48: the engine's phase 1 bounds images by the rule the family's adapter names."""
    loaded = family.engine.loaded
    assert family.engine.prompter.image_limit == type(loaded.adapter).processor_limit(loaded.processor)
    assert family.engine.prompter.image_limit is not None, family.arch
