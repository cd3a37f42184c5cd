"""[main] What the untested-family path costs (issue 56): one model through its adapter and as a family none names.

    python benchmarks/untested_bench.py [--model small|real] [--requests 8] [--tokens 24]

SmolVLM's architecture served twice in one run: as ``smolvlm`` (SmolVLMAdapter: chunked and batched prefill,
prefix and vision caches) and, the same files under its parent's name ``idefics3``, as a family no adapter
names (UntestedAdapter: whole prompts prefilled alone, no caches, checked against mlx-vlm at start-up).
``small`` is the offline bf16 SmolVLM build; ``real`` the 163 M real-weights one of ``real_weights.py``.
Measured for each: start-up (load, warm-up, and the untested path's self-check), one request alone, and
``--requests`` mixed text and image requests at once (aggregate tokens/s, time to first token). Writes
``untested.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.testing import build_model

HERE = Path(__file__).resolve().parent


def picture(i: int) -> Image.Image:
    image = Image.new("RGB", (320, 240), (30 * i % 255, 120, 200))
    ImageDraw.Draw(image).ellipse((40 + i % 10 * 10, 40, 240, 200), fill=(220, 60, 30))
    return image


async def one(engine: AsyncEngine, i: int, tokens: int) -> tuple[float, float, int]:
    """(time to first token, end-to-end seconds, tokens) of request ``i``: every other one with a picture."""
    images = [picture(i)] if i % 2 else []
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": f"Tell me about number {i}."}]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start, first, count = time.perf_counter(), None, 0
    async for step in engine.generate_chat(f"r{i}-{time.monotonic_ns()}", [{"role": "user", "content": parts}],
                                           images, None, params):
        assert step.error is None, step.error
        first = first if first is not None or not step.token_ids else time.perf_counter() - start
        count += len(step.token_ids)
    return first or 0.0, time.perf_counter() - start, count


async def measure(path: Path, requests: int, tokens: int) -> dict[str, Any]:
    began = time.perf_counter()
    engine = AsyncEngine(str(path), config=EngineConfig(max_batch_size=requests))
    await engine.start()
    started = time.perf_counter() - began
    try:
        await one(engine, 1, tokens)  # one more warm request with a picture
        ttft1, e2e1, n1 = await one(engine, 3, tokens)
        wall = time.perf_counter()
        runs = await asyncio.gather(*(one(engine, 100 + i, tokens) for i in range(requests)))
        wall = time.perf_counter() - wall
        return {"adapter": engine.info.adapter, "max_batch_size": engine.info.max_batch_size,
                "start_s": round(started, 2), "alone_tok_s": round(n1 / e2e1, 1), "alone_ttft_s": round(ttft1, 3),
                "together_tok_s": round(sum(r[2] for r in runs) / wall, 1),
                "together_ttft_p50_s": round(statistics.median(r[0] for r in runs), 3),
                "together_ttft_max_s": round(max(r[0] for r in runs), 3)}
    finally:
        await engine.shutdown()


def source(model: str) -> Path:
    if model == "real":
        sys.path.insert(0, str(HERE))
        from real_weights import build_smolvlm_smollm2

        return Path(build_smolvlm_smollm2())
    return build_model("smolvlm", "small")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("small", "real"), default="small")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "untested")
    args = parser.parse_args()
    tested = source(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        untested = Path(tmp) / "idefics3"
        shutil.copytree(tested, untested)
        config = json.loads((untested / "config.json").read_text())
        (untested / "config.json").write_text(json.dumps({**config, "model_type": "idefics3"}))
        rows = {name: asyncio.run(measure(path, args.requests, args.tokens))
                for name, path in (("smolvlm", tested), ("idefics3", untested))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "untested.json").write_text(json.dumps({"model": args.model, **vars(args), "out": str(args.out),
                                                        "rows": rows}, indent=1))
    keys = list(rows["smolvlm"])
    print("| served as | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |")
    ratio = rows["idefics3"]["together_tok_s"] / rows["smolvlm"]["together_tok_s"]
    print(f"untested / adapter, {args.requests} at once: {ratio:.2f}x the tokens per second")


if __name__ == "__main__":
    main()
