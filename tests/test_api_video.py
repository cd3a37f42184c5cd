"""Video input, as vLLM takes it (``video_url`` parts): frames sampled as mlx-vlm samples them, each
family's own video processor, and greedy tokens equal to mlx-vlm's own video path from the same file.

The oracle: mlx-vlm's ``prepare_inputs`` reads the clip itself (``load_video``, its sampling) and
runs the processor; our phase 1 must give the same prompt token ids and pixel arrays, and our engine,
alone, batched and with the vision cache, the tokens mlx-vlm's ``generate_step`` gives on them.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from conftest import gather, running_engine, scene
from server_utils import ServerProcess, image_data_url, start_server

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.inputs import PromptInputs
from vlmserve.preprocess.prompt import render_chat
from vlmserve.preprocess.video import VideoError, VideoSampling, decode_video
from vlmserve.testing import build_model
from vlmserve.testing.clips import write_clip
from vlmserve.testing.reference import reference_greedy

VIDEO_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4", "qwen3_vl_moe", "qwen3_5_moe")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLING = VideoSampling(fps=2.0, max_frames=8)


def video_data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    return {"red": write_clip(root / "red.mp4"), "blue": write_clip(root / "blue.mp4", 20, 10.0, color=(255, 0, 0)),
            "one": write_clip(root / "one.mp4", frames=1)}


# -- decoding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fps, max_frames", [(2.0, 8), (1.0, 32), (8.0, 6), (0.5, 32), (30.0, 768)])
def test_frames_are_the_ones_mlx_vlm_samples(clips, fps, max_frames):
    from mlx_vlm.utils import load_video

    for clip in (clips["red"], clips["blue"]):
        ours = decode_video(clip, VideoSampling(fps=fps, max_frames=max_frames), 10**8)
        frames, meta = load_video(str(clip), fps=fps, max_frames=max_frames)
        assert list(ours.indices) == meta.frames_indices
        assert np.array_equal(ours.frames, frames)
        assert ours.sampled_fps == pytest.approx(meta.sampled_fps)


def test_a_clip_that_cannot_be_sampled_is_refused(clips, tmp_path):
    with pytest.raises(VideoError, match="1 frame.*needs at least 2"):
        decode_video(clips["one"], SAMPLING, 10**8, "video 1")
    with pytest.raises(VideoError, match="video 1: not a video"):
        decode_video(b"\x00\x01 definitely not an mp4" * 50, SAMPLING, 10**8, "video 1")
    with pytest.raises(VideoError, match="over the 1000-pixel limit"):
        decode_video(clips["red"], SAMPLING, 1000, "video 1")
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(clips["red"].read_bytes()[:600])
    with pytest.raises(VideoError, match="video 1: "):
        decode_video(cut, SAMPLING, 10**8, "video 1")


# -- the engine against mlx-vlm's own video path ------------------------------------------------------------


def _started(arch: str) -> Iterator[tuple[AsyncEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(str(build_model(arch, "micro")), config=EngineConfig(max_batch_size=8, prefill_chunk=16))
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.fixture(scope="module", params=VIDEO_ARCHS)
def family(request: pytest.FixtureRequest) -> Iterator[tuple[AsyncEngine, asyncio.AbstractEventLoop]]:
    yield from _started(request.param)


@pytest.fixture(scope="module")
def gemma4() -> Iterator[tuple[AsyncEngine, asyncio.AbstractEventLoop]]:
    yield from _started("gemma4")


@pytest.fixture(scope="module")
def smolvlm() -> Iterator[tuple[AsyncEngine, asyncio.AbstractEventLoop]]:
    yield from _started("smolvlm")


def _messages(text: str, kinds: tuple[str, ...] = ("video",)) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": k} for k in kinds), {"type": "text", "text": text}]}]


def _mlx_vlm_inputs(processor: Any, text: str, clip: Path) -> dict[str, np.ndarray]:
    """mlx-vlm's own video path on the clip (it reads and samples the file): on the worker, as numpy."""
    from mlx_vlm.utils import prepare_inputs

    inputs = prepare_inputs(processor, videos=[str(clip)], prompts=[text], fps=SAMPLING.fps,
                            max_frames=SAMPLING.max_frames)
    return {k: np.asarray(v) for k, v in inputs.items() if hasattr(v, "shape")}


async def _tokens(engine: AsyncEngine, request_id: str, prompt: PromptInputs) -> list[int]:
    result = await gather(engine.generate(request_id, prompt, GREEDY))
    assert result.error is None, result.error
    return result.token_ids


def test_engine_equals_mlx_vlms_video_path(family, clips):
    engine, loop = family
    messages = _messages("What happens in this clip?")
    prompt = engine.prompter.build(messages, videos=[decode_video(clips["red"], SAMPLING, 10**8)])
    text = render_chat(engine.prompter.processor, messages, videos=True)
    theirs = engine.worker.call(_mlx_vlm_inputs, engine.prompter.processor, text, clips["red"])
    assert prompt.input_ids == theirs["input_ids"].reshape(-1).tolist()
    for key, value in prompt.arrays.items():
        assert np.array_equal(np.asarray(value), theirs[key]), key
    assert prompt.num_images == 1 and len(prompt.images) == 1  # one clip, one vision-cache item

    reference = engine.worker.call(reference_greedy, engine.loaded.model, prompt, GREEDY.max_tokens)
    assert loop.run_until_complete(_tokens(engine, "alone", prompt)) == reference
    before = loop.run_until_complete(engine.stats()).vision
    assert loop.run_until_complete(_tokens(engine, "again", prompt)) == reference  # the clip's features cached
    after = loop.run_until_complete(engine.stats()).vision
    if engine.loaded.adapter.vision_cache:  # not for Qwen3-VL (DeepStack)
        assert (after.hits, after.misses) == (before.hits + 1, before.misses)

    # the same words about another clip: its own tokens (no prefix of the first clip's KV is reused)
    other = engine.prompter.build(messages, videos=[decode_video(clips["blue"], SAMPLING, 10**8)])
    assert other.images[0].key != prompt.images[0].key
    theirs = engine.worker.call(reference_greedy, engine.loaded.model, other, GREEDY.max_tokens)
    assert loop.run_until_complete(_tokens(engine, "other", other)) == theirs


def test_gemma4_takes_an_image_and_a_video_in_one_prompt(gemma4, clips):
    engine, loop = gemma4  # the Qwen families refuse it (mlx-vlm's merge fills one kind): the API tests below
    messages = _messages("Is the disc the colour of the square?", ("image", "video"))
    prompt = engine.prompter.build(messages, [scene("square", (30, 30, 200))],
                                   videos=[decode_video(clips["red"], SAMPLING, 10**8)])
    assert prompt.num_images == 2 and len(prompt.images) == 2
    reference = engine.worker.call(reference_greedy, engine.loaded.model, prompt, GREEDY.max_tokens)
    assert loop.run_until_complete(_tokens(engine, "both", prompt)) == reference
    assert loop.run_until_complete(_tokens(engine, "both-again", prompt)) == reference  # both from the cache


def test_videos_batch_with_images_and_text(family, clips):
    engine, loop = family
    prompts = [
        engine.prompter.build(_messages("Describe the motion."), videos=[decode_video(clips["blue"], SAMPLING, 10**8)]),
        engine.prompter.build(_messages("And this one?"),
                              videos=[decode_video(clips["red"], VideoSampling(fps=4.0, max_frames=6), 10**8)]),
        engine.prompter.build(_messages("What colour?", ("image",)), [scene("circle", (200, 30, 30))]),
        engine.prompter.build(_messages("Say something.", ())),
    ]
    references = [engine.worker.call(reference_greedy, engine.loaded.model, p, GREEDY.max_tokens) for p in prompts]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(_tokens(engine, f"mix-{i}", p) for i, p in enumerate(prompts))))

    assert loop.run_until_complete(together()) == references


def test_smolvlm2_sees_a_clip_as_time_stamped_frames(smolvlm, clips):
    """SmolVLM2 has no video processor in mlx-vlm: the frames go as images (mlx-vlm's frame fallback), in
    the prompt SmolVLM2 was trained on (transformers' SmolVLMProcessor: an intro, then each frame's time)."""
    from mlx_vlm.generate.video import resolve_video_inputs
    from mlx_vlm.utils import VideoSampling as MlxVlmSampling

    engine, loop = smolvlm
    prompt = engine.prompter.build(_messages("What happens?"), videos=[decode_video(clips["blue"], SAMPLING, 10**8)])
    frames = resolve_video_inputs(engine.prompter.processor, [str(clips["blue"])], fps=SAMPLING.fps,
                                  max_frames=SAMPLING.max_frames, sampling=MlxVlmSampling(max_frames=8)).images
    assert len(frames) == prompt.num_images == 4  # 2 s at 2 fps
    stamps = "".join(f"\nFrame from 00:0{t}:" + "{image}" for t in (0, 0, 1, 1))  # frames 0, 6, 13, 19 at 10 fps
    text = ("You are provided the following series of four frames from a 0:00:02 [H:MM:SS] video.\n" + stamps
            + "\n\n").split("{image}")
    parts = [p for chunk in text for p in ({"type": "text", "text": chunk}, {"type": "image"})][:-1]
    expected = engine.prompter.build([{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}],
                                     frames)
    assert prompt.input_ids == expected.input_ids
    assert all(np.array_equal(prompt.arrays[k], expected.arrays[k]) for k in expected.arrays)
    reference = engine.worker.call(reference_greedy, engine.loaded.model, prompt, GREEDY.max_tokens)
    assert loop.run_until_complete(_tokens(engine, "frames", prompt)) == reference


def test_frame_counts_are_written_as_num2words_writes_them():
    from vlmserve.preprocess.prompt import _words

    assert [_words(n) for n in (4, 21, 32, 100, 105, 999, 1000, 1001, 1234)] == [
        "four", "twenty-one", "thirty-two", "one hundred", "one hundred and five", "nine hundred and ninety-nine",
        "one thousand", "one thousand and one", "one thousand, two hundred and thirty-four"]


# -- the API ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, clips) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("video-server")
    models = [build_model("qwen2_5_vl", "micro"), build_model("gemma4", "micro"), build_model("smolvlm", "micro"),
              build_model("llava", "micro")]
    args = [a for m in models for a in ("--model", str(m))]
    args += ["--allowed-media-dir", str(clips["red"].parent), "--video-max-frames", "16",
             "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1})]
    proc = start_server(args, root / "server.log", timeout=300)
    yield proc
    proc.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _video_message(url: str, text: str = "What happens?", image: str | None = None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "video_url", "video_url": {"url": url}}]
    if image is not None:
        parts.append({"type": "image_url", "image_url": {"url": image}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _count(server: ServerProcess, model: str, messages: list[dict[str, Any]], **extra: Any) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


@pytest.mark.parametrize("model", ["qwen2_5_vl", "gemma4", "smolvlm"])
def test_a_video_chat_through_the_openai_sdk(server, clips, model):
    name = build_model(model, "micro").name
    client = _client(server)
    messages = _video_message(video_data_url(clips["red"]))
    r = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    text_only = _count(server, name, [{"role": "user", "content": "What happens?"}])
    assert r.usage.prompt_tokens == _count(server, name, messages) > text_only + 3  # placeholders and markers
    # streamed, from an allowed local file: the same clip, the same prompt and tokens
    stream = client.chat.completions.create(model=name, messages=_video_message(str(clips["red"])), max_tokens=4,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_fps_and_max_frames_choose_the_frames(server, clips):
    name = build_model("gemma4", "micro").name  # a fixed token count per frame (Qwen's budget is the whole clip's)
    messages = _video_message(video_data_url(clips["red"]))
    default = _count(server, name, messages)  # the server's 2 fps: 4 of the clip's 16 frames (2 s at 8 fps)
    eight = _count(server, name, messages, mm_processor_kwargs={"fps": 8, "max_frames": 8})
    sixteen = _count(server, name, messages, mm_processor_kwargs={"fps": 8})  # the server's --video-max-frames
    assert sixteen - eight == 2 * (eight - default) > 0
    assert _count(server, name, messages, mm_processor_kwargs={"fps": 1}) == default  # 2 frames, raised to 4
    r = _client(server).chat.completions.create(model=name, messages=messages, max_tokens=2, temperature=0,
                                                extra_body={"mm_processor_kwargs": {"fps": 8, "max_frames": 8}})
    assert r.usage.prompt_tokens == eight


@pytest.mark.parametrize("case, model, messages, extra, status, words", [
    ("no video processor", "llava", "red", {}, 400, "does not take video"),
    ("image and video on Qwen", "qwen2_5_vl", "red+image", {}, 400, "images or a video in one prompt"),
    ("two videos", "gemma4", "red+red", {}, 400, "2 videos is over the limit of 1"),
    ("corrupt", "gemma4", "corrupt", {}, 400, "video 1: not a video"),
    ("an image as a video", "gemma4", "png", {}, 400, "not a video"),
    ("too many frames asked", "gemma4", "red", {"mm_processor_kwargs": {"max_frames": 64}}, 400, "max_frames 64"),
    ("no frames per second", "gemma4", "red", {"mm_processor_kwargs": {"fps": 0}}, 400, "fps 0"),
    ("outside the allowed directory", "gemma4", "/etc/hostname", {}, 400, "outside the allowed media"),
    ("in an assistant turn", "gemma4", "assistant", {}, 400, "videos are only allowed in user messages"),
])
def test_bad_video_requests_are_400s_and_change_nothing(server, clips, case, model, messages, extra, status, words):
    red = video_data_url(clips["red"])
    picture = image_data_url(scene("square", (30, 30, 200)))
    built = {
        "red": _video_message(red), "red+image": _video_message(red, image=picture),
        "red+red": [{"role": "user", "content": [_video_message(red)[0]["content"][0]] * 2 + [
            {"type": "text", "text": "Compare."}]}],
        "corrupt": _video_message("data:video/mp4;base64," + base64.b64encode(b"\x00" * 4000).decode()),
        "png": _video_message(picture), "/etc/hostname": _video_message("/etc/hostname"),
        "assistant": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": _video_message(red)[0]["content"]}],
    }[messages]
    name = build_model(model, "micro").name
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": name, "messages": built, "max_tokens": 2, **extra})
    assert r.status_code == status, (case, r.text)
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error", (case, error)
    if case == "no video processor":
        assert error["code"] == "unsupported_media" and "(llava)" in error["message"]
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                    json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200 and httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "gemma4"])
def test_a_chat_about_a_clip_reuses_its_kv_where_the_clip_is_one_run(arch, clips):
    """With ``--mm-prefix-cache``, later turns about a clip reuse the earlier turns' KV, the clip's
    included, where its placeholders are one run (Qwen2/2.5-VL); Gemma 4 time-stamps each frame (a
    run per frame), so its turns reuse nothing. Every answer is the cold engine's."""
    video = decode_video(clips["red"], SAMPLING, 10**8)

    def turn(k: int) -> list[dict[str, Any]]:
        messages = _messages("What happens in this clip?")
        for i in range(1, k):
            messages += [{"role": "assistant", "content": f"Answer {i}."}, {"role": "user", "content": f"And {i}?"}]
        return messages

    async def scenario(mm: bool) -> tuple[list[list[int]], list[int], int, bool]:
        async with running_engine(build_model(arch, "micro"), mm_prefix_cache=mm, prefill_chunk=16) as engine:
            tokens, cached = [], []
            media = engine.loaded.adapter.media_token_ids()
            for k in range(1, 4):
                prompt = await engine.preprocess(lambda p, k=k: p.build(turn(k), videos=[video]))
                after_clip = max(i for i, t in enumerate(prompt.input_ids) if t in media) + 1
                result = await gather(engine.generate(f"t{k}", prompt, GREEDY))
                tokens.append(result.token_ids)
                cached.append(result.num_cached_tokens)
            # the same later turn about another clip: nothing past the text before its clip
            other = await engine.preprocess(lambda p: p.build(turn(3), videos=[decode_video(clips["blue"], SAMPLING,
                                                                                             10**8)]))
            before_clip = min(i for i, t in enumerate(other.input_ids) if t in media)
            reused = (await gather(engine.generate("other", other, GREEDY))).num_cached_tokens
            return tokens, cached, after_clip, reused > before_clip

    warm, cached, after_clip, crossed = asyncio.run(scenario(True))
    cold, _, _, _ = asyncio.run(scenario(False))
    assert warm == cold and not crossed  # the other clip's turn reused nothing past the text before its clip
    assert all(n > after_clip for n in cached[1:]) if arch != "gemma4" else not any(cached), (cached, after_clip)
