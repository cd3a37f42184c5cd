"""Audio in chat on the real worker, runner and MLX: Gemma 4 with a small audio tower (the "audio" variant).

The oracle is mlx-vlm's own greedy decode (``generate_step``) on the same prompt ids and mel features;
clips are decoded as mlx-vlm's ``load_audio`` decodes them.
"""

from __future__ import annotations

import asyncio
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import scene

from vlmserve.engine.params import SamplingParams
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.audio import AudioError, AudioLimits, decode_audio
from vlmserve.testing import build_model
from vlmserve.testing.reference import reference_greedy

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def tone(hz: float, seconds: float, rate: int = 16_000, channels: int = 1) -> bytes:
    """A sine tone as 16-bit PCM WAV bytes."""
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.4 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm, channels).tobytes())
    return out.getvalue()


class Audio:
    def __init__(self, **config: Any) -> None:
        from vlmserve.engine.engine_config import EngineConfig
        from vlmserve.frontend.async_engine import AsyncEngine

        self.loop = asyncio.new_event_loop()
        path = build_model("gemma4", "micro", variant="audio")
        config = {"max_batch_size": 8, "prefill_chunk": 16, "mm_prefix_cache": True, **config}
        self.engine = AsyncEngine(str(path), config=EngineConfig(**config))
        self.loop.run_until_complete(self.engine.start())

    def prompt(self, text: str, clips: list[bytes] = (), images: list[object] = ()) -> PromptInputs:
        audio = [decode_audio(c, "wav", f"clip {i}", AudioLimits()) for i, c in enumerate(clips)]
        parts = [*({"type": "audio"} for _ in audio), *({"type": "image"} for _ in images),
                 {"type": "text", "text": text}]
        return self.engine.prompter.build([{"role": "user", "content": parts}], list(images), audio=audio)

    async def tokens(self, request_id: str, prompt: PromptInputs) -> list[int]:
        out: list[int] = []
        async for step in self.engine.generate(request_id, prompt, GREEDY):
            assert step.error is None, step.error
            out += step.token_ids
        return out

    def reference(self, prompt: PromptInputs) -> list[int]:
        """mlx-vlm's greedy decode; for several clips, with each clip's valid frames in its own place."""
        return self.engine.worker.call(placed_reference, self.engine.loaded.model, prompt, GREEDY.max_tokens)


def placed_reference(model: Any, prompt: PromptInputs, max_tokens: int) -> list[int]:
    """``reference_greedy``; where the prompt has several clips, mlx-vlm's audio tower hands its scatter each
    clip's valid frames only, as transformers' Gemma 4 does. mlx-vlm 0.7.10 scatters the padded batch's frames
    in a row: a shorter first clip's padding frames took the next clip's first audio tokens."""
    if len(prompt.clips) < 2:
        return reference_greedy(model, prompt, max_tokens)
    tower = model.audio_tower

    def valid_frames(features: Any, invalid: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        encoded, out_invalid = tower(features, invalid)
        rows = [encoded[i:i + 1, :int((~out_invalid[i]).sum().item())] for i in range(encoded.shape[0])]
        return mx.concatenate(rows, axis=1), out_invalid

    object.__setattr__(model, "audio_tower", valid_frames)
    try:
        return reference_greedy(model, prompt, max_tokens)
    finally:
        object.__delattr__(model, "audio_tower")


@pytest.fixture(scope="module")
def audio() -> Iterator[Audio]:
    started = Audio()
    yield started
    started.loop.run_until_complete(started.engine.shutdown())
    started.loop.close()


def test_the_build_carries_its_feature_extractor() -> None:
    import json

    config = json.loads((build_model("gemma4", "micro", variant="audio") / "processor_config.json").read_text())
    assert config["feature_extractor"]["feature_extractor_type"] == "Gemma4AudioFeatureExtractor"


def test_a_clip_expands_to_one_token_per_40_ms(audio: Audio) -> None:
    prompt = audio.prompt("what is it?", [tone(440, 1.3)])
    token = audio.engine.prompter.processor.tokenizer.convert_tokens_to_ids("<|audio|>")
    assert prompt.input_ids.count(token) == 33  # ceil(1300 / 40)
    assert prompt.has_audio and prompt.has_images and prompt.num_images == 0


def test_greedy_tokens_equal_mlx_vlm_alone_and_audio_matters(audio: Audio) -> None:
    low, high = tone(220, 1.0), tone(1800, 2.2, rate=8000, channels=2)
    cases = [audio.prompt("what is it?", [low]), audio.prompt("what is it?", [high]),
             audio.prompt("two sounds", [low, high])]
    outs = [audio.loop.run_until_complete(audio.tokens(f"a{i}", p)) for i, p in enumerate(cases)]
    assert outs == [audio.reference(p) for p in cases]
    assert outs[0] != outs[1]


def test_audio_batched_with_image_and_text_rows_equals_alone(audio: Audio) -> None:
    red = scene("circle", (220, 30, 30))
    prompts = [audio.prompt("hi"), audio.prompt("what is it?", [tone(330, 0.8)]), audio.prompt("describe", [], [red]),
               audio.prompt("both", [tone(660, 1.5)], [red]), audio.prompt("a longer text question, slowly " * 3)]
    alone = [audio.loop.run_until_complete(audio.tokens(f"s{i}", p)) for i, p in enumerate(prompts)]
    assert alone == [audio.reference(p) for p in prompts]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(audio.tokens(f"t{i}", p) for i, p in enumerate(prompts))))

    assert audio.loop.run_until_complete(together()) == alone


def test_a_prompt_with_audio_never_reuses_kv_of_other_audio(audio: Audio) -> None:
    """The same text and token ids with a different clip: the second answer is the second clip's own."""
    first, second = audio.prompt("again?", [tone(250, 1.0)]), audio.prompt("again?", [tone(2500, 1.0)])
    assert first.input_ids == second.input_ids
    audio.loop.run_until_complete(audio.tokens("c1", first))
    assert audio.loop.run_until_complete(audio.tokens("c2", second)) == audio.reference(second)


def test_a_clip_heard_again_skips_the_audio_tower(audio: Audio) -> None:
    """The audio tower's output is kept in the vision cache by the clip's samples: another request with the same
    clip (other text, beside an image) takes it from there, and answers as mlx-vlm's greedy decode."""
    clip, green = tone(523, 1.1), scene("square", (12, 200, 90))  # neither shown by another test
    first, again = audio.prompt("what is it?", [clip]), audio.prompt("and now?", [clip], [green])
    assert first.clips[0].key == again.clips[0].key != audio.prompt("x", [tone(524, 1.1)]).clips[0].key
    before = audio.loop.run_until_complete(audio.engine.stats()).vision
    outs = [audio.loop.run_until_complete(audio.tokens(f"h{i}", p)) for i, p in enumerate((first, first, again))]
    after = audio.loop.run_until_complete(audio.engine.stats()).vision
    assert before is not None and after is not None
    assert outs == [outs[0], *(audio.reference(p) for p in (first, again))]
    assert (after.misses - before.misses, after.hits - before.hits) == (2, 2)  # the clip, the picture; the clip twice
    assert after.bytes > before.bytes


def test_a_clip_over_the_cache_budget_is_not_kept_and_answers_the_same(audio: Audio) -> None:
    """Clips share the images' byte budget: features larger than all of it are not kept, and nothing else is lost."""
    small = Audio(vision_cache_bytes=1024)
    try:
        prompt = small.prompt("what is it?", [tone(523, 1.1)])
        outs = [small.loop.run_until_complete(small.tokens(f"b{i}", prompt)) for i in range(2)]
        stats = small.loop.run_until_complete(small.engine.stats()).vision
    finally:
        small.loop.run_until_complete(small.engine.shutdown())
        small.loop.close()
    assert outs == [audio.reference(prompt)] * 2
    assert stats is not None and (stats.misses, stats.hits, stats.entries, stats.bytes) == (2, 0, 0, 0)


def test_two_clips_each_take_their_own_places(audio: Audio) -> None:
    """Each clip's valid frames at its own tokens. mlx-vlm 0.7.10 scatters the padded batch's frames in a row: right
    where the longer clip comes first, but a shorter first clip's padding takes the next clip's places."""
    low, high = tone(220, 1.0), tone(1800, 2.2)
    longer_first, shorter_first = audio.prompt("two", [high, low]), audio.prompt("two", [low, high])

    def same(prompt: PromptInputs) -> bool:  # on the worker, whose stream the arrays are on
        import mlx.core as mx

        from vlmserve.engine.runner import on_device

        adapter, model = audio.engine.loaded.adapter, audio.engine.loaded.model
        ids = mx.array(prompt.input_ids)[None]
        clips = mx.concatenate([adapter.encode_clip(on_device(c.arrays)) for c in prompt.clips], axis=1)
        ours = adapter.embed(ids, on_device(prompt.arrays), {"cached_audio_features": clips}).inputs_embeds
        theirs = model.get_input_embeddings(ids, None, **on_device(prompt.arrays)).inputs_embeds
        return bool(mx.array_equal(ours, theirs).item())

    assert audio.engine.worker.call(same, longer_first)
    assert not audio.engine.worker.call(same, shorter_first)


def test_clips_past_the_limits_are_refused() -> None:
    with pytest.raises(AudioError, match="2-second limit"):
        decode_audio(tone(440, 2.5), "wav", "clip 1", AudioLimits(max_seconds=2.0))
    with pytest.raises(AudioError, match="format 'ogg'"):
        decode_audio(tone(440, 0.5), "ogg", "clip 1", AudioLimits())
    with pytest.raises(AudioError, match="cannot decode"):
        decode_audio(b"RIFF" + b"\0" * 64, "wav", "clip 1", AudioLimits())


def test_a_processor_without_its_feature_extractor_takes_no_audio(audio: Audio) -> None:
    """mlx-vlm #903: without an extractor the processor would expand a fixed 750 placeholders and no features;
    such a processor has no audio rate (the API's 400 names it) and phase 1 refuses the clip."""
    import copy

    from vlmserve.preprocess.prompt import PromptBuilder, PromptError

    processor = copy.deepcopy(audio.engine.prompter.processor)
    processor.feature_extractor = None
    builder = PromptBuilder.for_processor(processor)
    assert builder.audio_rate is None and audio.engine.prompter.audio_rate == 16_000
    clip = decode_audio(tone(440, 0.5), "wav", "clip 1", AudioLimits())
    with pytest.raises(PromptError, match="no feature extractor"):
        builder.build([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "x"}]}], audio=[clip])


def test_a_conversion_lacking_feature_extractor_gets_mlx_vlms_defaults(audio: Audio, tmp_path: Path) -> None:
    """mlx-vlm 0.7.10 builds Gemma 4's fixed USM extractor when processor_config.json has none: such a copy
    hears exactly as the build does."""
    import json
    import shutil

    from vlmserve.engine.engine_config import EngineConfig
    from vlmserve.frontend.async_engine import AsyncEngine

    copy_dir = tmp_path / "no-extractor"
    shutil.copytree(build_model("gemma4", "micro", variant="audio"), copy_dir)
    config_path = copy_dir / "processor_config.json"
    config = json.loads(config_path.read_text())
    del config["feature_extractor"]
    config_path.write_text(json.dumps(config))
    engine = AsyncEngine(str(copy_dir), config=EngineConfig(max_batch_size=8))
    audio.loop.run_until_complete(engine.start())
    try:
        clip = decode_audio(tone(440, 1.0), "wav", "clip 1", AudioLimits())
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "x"}]}]
        assert engine.media_refusal(0, 0, 1) is None
        prompt, built = engine.prompter.build(messages, audio=[clip]), audio.engine.prompter.build(messages, audio=[clip])
        assert prompt.input_ids == built.input_ids
        assert all(np.array_equal(prompt.arrays[k], built.arrays[k]) for k in ("input_features", "input_features_mask"))
    finally:
        audio.loop.run_until_complete(engine.shutdown())


def test_decoding_a_clip_never_loads_mlx() -> None:
    """Phase 1 decodes on the pool: mlx-audio's reader and resampler are numpy in and out, and MLX stays
    unloaded in a process that only decodes (44.1 kHz stereo, resampled to 16 kHz)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import io, sys, wave
        import numpy as np
        from vlmserve.preprocess.audio import AudioLimits, decode_audio
        out = io.BytesIO()
        with wave.open(out, "wb") as w:
            w.setnchannels(2); w.setsampwidth(2); w.setframerate(44100)
            w.writeframes((np.sin(np.arange(44100 * 2) / 9) * 8000).astype("<i2").tobytes())
        samples = decode_audio(out.getvalue(), "wav", "clip", AudioLimits())
        assert samples.dtype == np.float32 and abs(len(samples) - 16000) < 10, len(samples)
        assert not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules), sorted(m for m in sys.modules if "mlx" in m)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
