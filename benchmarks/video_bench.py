"""[main] What a video costs, per family: prompt tokens per frame, phase 1, and TTFT for an 8-frame clip.

    python benchmarks/video_bench.py [--archs gemma4,qwen2_5_vl,...] [--reps 3] [--frames 8]
        [--size 448x252] [--dtype bfloat16|float32] [--out DIR]
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/video_bench.py --dtype float32

For each family whose processor takes video, builds its small model (``ignore_eos=True``) and runs
one in-process engine (the real worker, vision cache on). Qwen's video processors fit the whole clip
into one pixel budget; the small models' is their image budget (about 3 tokens a frame), so the bench
copies each with the budget mlx-vlm's Qwen video processor defaults to: 768 merge units (``(patch *
merge)**2`` pixels each) for the clip. Gemma 4's is its real one, 70 soft tokens a frame. Clips are mp4s of ``--frames`` * 4 frames
at 8 fps, sampled at 2 fps: ``--frames`` frames each, a disc crossing a white ``--size`` frame, each
clip its own colour so that no two share vision features. For each of ``--reps`` clips, one after
the other on an idle engine:

- phase 1: decode the clip and run the processor (the pool's work), alone;
- cold: a streamed request, its clip never seen (vision tower, then prefill), TTFT;
- warm: the same request again (its features from the vision cache), TTFT;
- text: the same question without the clip, TTFT.

Tokens per frame is (the prompt with the clip - the prompt without it) / frames: placeholders plus
each family's per-frame markers (Qwen3-VL and Gemma 4 time-stamp each frame group). Writes
``video.json`` and ``video.md`` to DIR (default ``benchmarks/results/video-DTYPE``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from compare import machine
from report import _table

from vlmserve.progress import progress
from vlmserve.testing.clips import write_clip

HERE = Path(__file__).resolve().parent
ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma4")
QUESTION = "What happens in this clip?"


QWEN_VIDEO_UNITS = 768  # mlx-vlm's Qwen3VLVideoProcessor default: max_pixels = 32 * 32 * 768 at patch 16, merge 2


def bench_model(arch: str, root: Path) -> Path:
    """The small model; a Qwen one copied with mlx-vlm's default video pixel budget (module docstring)."""
    from vlmserve.testing import build_model

    model = build_model(arch, "small", ignore_eos=True)
    video_config = model / "video_preprocessor_config.json"
    if not video_config.is_file():
        return model
    copy = root / model.name
    shutil.copytree(model, copy)
    config = json.loads(video_config.read_text())
    config["max_pixels"] = (config["patch_size"] * config["merge_size"]) ** 2 * QWEN_VIDEO_UNITS
    (copy / video_config.name).write_text(json.dumps(config))
    return copy


async def bench_arch(arch: str, model: Path, clips: list[Path], frames: int, dtype: str) -> dict[str, Any]:
    from vlmserve.engine.engine_config import EngineConfig
    from vlmserve.engine.params import SamplingParams
    from vlmserve.frontend.async_engine import AsyncEngine
    from vlmserve.inputs import PromptInputs
    from vlmserve.preprocess.video import VideoSampling, decode_video

    engine = AsyncEngine(str(model), config=EngineConfig(dtype=dtype))
    await engine.start()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    sampling = VideoSampling(fps=2.0, max_frames=frames)
    video_message = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text_message = [{"role": "user", "content": QUESTION}]

    async def ttft(prompt: PromptInputs, request_id: str) -> float:
        start = time.perf_counter()
        async for out in engine.generate(request_id, prompt, params):
            assert out.error is None, out.error
            if out.token_ids:
                return time.perf_counter() - start
        raise AssertionError("no token")

    rows: dict[str, list[float]] = {"phase1": [], "cold": [], "warm": [], "text": []}
    tokens = text_tokens = 0
    assert engine.prompter is not None
    prompter = engine.prompter
    try:
        for i, clip in enumerate(clips):
            start = time.perf_counter()
            video = decode_video(clip, sampling, 10**9)
            prompt = prompter.build(video_message, videos=[video])
            rows["phase1"].append(time.perf_counter() - start)
            text = prompter.build(text_message)
            tokens, text_tokens = len(prompt), len(text)
            rows["cold"].append(await ttft(prompt, f"cold-{i}"))
            rows["warm"].append(await ttft(prompt, f"warm-{i}"))
            rows["text"].append(await ttft(text, f"text-{i}"))
    finally:
        await engine.shutdown()
    medians = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    return {"arch": arch, "frames": frames, "prompt_tokens": tokens, "text_tokens": text_tokens,
            "tokens_per_frame": (tokens - text_tokens) / frames, "ms": medians, "runs": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", default="448x252")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/video-DTYPE")
    args = parser.parse_args()
    size = tuple(int(n) for n in args.size.split("x"))
    assert len(size) == 2
    args.out = args.out or HERE / "results" / f"video-{args.dtype}"
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        colors = np.random.default_rng(0).integers(0, 200, (args.reps, 3))
        clips = [write_clip(Path(tmp) / f"clip{i}.mp4", args.frames * 4, 8.0, (size[0], size[1]),
                            (int(b), int(g), int(r))) for i, (b, g, r) in enumerate(colors)]
        bar = progress(args.archs.split(","), desc="video bench", unit="family")
        for arch in bar:
            bar.set_postfix_str(arch)
            results.append(asyncio.run(bench_arch(arch, bench_model(arch, Path(tmp)), clips, args.frames,
                                                args.dtype)))
    header = ["family (small)", "frames", "prompt tokens", "tokens / frame", "phase 1 ms", "TTFT cold ms",
              "TTFT warm ms", "TTFT text ms"]
    body = [[r["arch"], r["frames"], r["prompt_tokens"], f"{r['tokens_per_frame']:.1f}",
             *(f"{r['ms'][k]:.0f}" for k in ("phase1", "cold", "warm", "text"))] for r in results]
    host = machine(dict(os.environ))
    report = (f"Video costs, {args.dtype} ({args.frames} frames of a {args.size} clip, medians of {args.reps}), "
              f"{json.dumps(host)}\n\n{_table(header, body)}\n")
    (args.out / "video.json").write_text(json.dumps({"machine": host, "results": results}, indent=1))
    (args.out / "video.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
