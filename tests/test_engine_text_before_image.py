"""A prompt with images reuses the text before its first image from the text store (issue 57): an agent
session's first screenshot finds the previous turn's text prompt cached, with or without the image-keyed
cache, and every turn answers as a cold prefill (every cache off) does, token for token."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import gather, running_engine, scene
from test_engine_mm_prefix import micro_model

from vlmserve.engine.params import SamplingParams
from vlmserve.preprocess.video import VideoSampling, decode_video
from vlmserve.testing import build_model
from vlmserve.testing.clips import write_clip

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
RED, BLUE = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220))
# An agent's long first message. Not a system message: some templates (Pixtral-12B's first one) move that
# to the last user turn, so no turn would repeat the previous one, text or image.
TASK = ("You are a coding agent. Use the tools: read_file(path), run(command), screenshot(). "
        "Answer briefly and check your work before you say it is done. ") * 3 + "Fix the settings page."
# Tokens a reused prefix may fall short of the previous prompt: its generation prompt, where the next
# turn renders it otherwise (a recurrent cache's snapshot is taken before it, at the prompt's stem)
SLACK = 2


def _session(turn: int, kind: str = "image") -> tuple[list[dict[str, Any]], list[Any]]:
    """An agent's turn 1 (text), 2 (a screenshot in the tool result) or 3 (another one)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    results = [("I will take a screenshot.", "The screenshot:", RED), ("I moved the button.", "After it:", BLUE)]
    for reply, text, _ in results[:turn - 1]:
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": [{"type": "text", "text": text}, {"type": kind}]}]
    return messages, [picture for *_, picture in results[:turn - 1]]


async def _turns(model: Any, turns: int = 3, clip: Any = None, **config: Any) -> list[tuple[list[int], int, int, int]]:
    """Each turn's reply, cached tokens, prompt tokens, and the tokens before its first image (with ``clip``,
    decoded frames: a screen recording in the place of each screenshot)."""
    out = []
    async with running_engine(model, **config) as engine:
        media = engine.loaded.adapter.media_token_ids()
        for k in range(1, turns + 1):
            messages, images = _session(k, "image" if clip is None else "video")
            pictures, videos = (images, []) if clip is None else ([], [clip] * len(images))
            prompt = await engine.preprocess(lambda p, m=messages, i=pictures, v=videos: p.build(m, i, None, videos=v))
            result = await gather(engine.generate(f"t{k}", prompt, GREEDY))
            before = next((i for i, t in enumerate(prompt.input_ids) if t in media), len(prompt))
            out.append((result.token_ids, result.num_cached_tokens, len(prompt), before))
    return out


def _check(warm: list[tuple[list[int], int, int, int]], cold: list[tuple[list[int], int, int, int]]) -> None:
    assert [t for t, *_ in warm] == [t for t, *_ in cold]  # exact: what a cold prefill gives
    assert not any(n for _, n, *_ in cold)
    (_, first, text_len, _), (_, second, length, before) = warm[:2]
    assert first == 0 and before < length  # the image turn's picture is in its prompt
    assert text_len - SLACK <= second <= before, (text_len, second, before)  # the text turn, never the picture


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5", "gemma3", "gemma4", "llava",
                                  "pixtral", "mistral3", "lfm2_vl", "glm4v", "glm4v_moe", "llama4",
                                  "kimi_vl", "qwen3_vl_moe", "qwen3_5_moe", "internvl_chat", "smolvlm",
                                  "smolvlm_tiles"])
def test_the_first_screenshot_reuses_the_previous_text_turn_with_the_image_keyed_cache(arch, tmp_path):
    """With ``--mm-prefix-cache``: turn 2 reuses turn 1's text prompt from the text store, turn 3 turn 2's
    prompt, its picture included, from the image-keyed store (``smolvlm_tiles``: a 2x2 grid and a view)."""
    model = micro_model(arch, tmp_path)
    warm = asyncio.run(_turns(model, mm_prefix_cache=True))
    cold = asyncio.run(_turns(model, prefix_cache=False))
    _check(warm, cold)
    assert warm[2][1] > warm[2][3], warm[2]  # past the text before the first picture


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma4", "lfm2_vl", "smolvlm", "smolvlm_tiles"])
def test_by_default_an_image_prompt_reuses_the_text_before_its_first_image_and_no_more(arch, tmp_path):
    """Default flags: the text store serves the text before the first image, never an image's KV (turn 3
    reuses no more than the text before turn 2's picture, which its prompt repeats)."""
    model = micro_model(arch, tmp_path)
    warm = asyncio.run(_turns(model))
    cold = asyncio.run(_turns(model, prefix_cache=False))
    _check(warm, cold)
    assert 0 < warm[2][1] <= warm[2][3], warm[2]


@pytest.mark.parametrize("arch", ["paligemma"])
def test_families_whose_restored_image_prefix_is_not_proven_exact_reuse_nothing(arch):
    model = build_model(arch, "micro")
    warm = asyncio.run(_turns(model, turns=2, mm_prefix_cache=True))  # PaliGemma takes one image a prompt
    assert [n for _, n, *_ in warm] == [0, 0]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_screen_recording_reuses_the_text_before_it_too(arch, tmp_path):
    """A clip's frames are media tokens too (Qwen3-VL's and Qwen3.5's time-stamped groups, which the
    image-keyed store cannot key): the text before the first frame comes from the text store, exactly."""
    clip = decode_video(write_clip(tmp_path / "screen.mp4"), VideoSampling(fps=2.0, max_frames=8), 10**8)
    model = build_model(arch, "micro")
    warm = asyncio.run(_turns(model, turns=2, clip=clip))
    cold = asyncio.run(_turns(model, turns=2, clip=clip, prefix_cache=False))
    _check(warm, cold)
