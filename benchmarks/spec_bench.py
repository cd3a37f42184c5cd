"""Speculative decoding against none, in one run, on the same engine code: tokens/s per workload and
concurrency, the ratio, and the draft acceptance (engine/speculative.py).

Workloads, on the demo model (a Gemma 4 trained here, so its drafts are accepted as a real model's
would be) unless ``--model`` says otherwise:
- ``copy``: the caption of a picture, with the right caption as the request's prediction;
- ``edit``: the same, with a prediction that has one word wrong (a colour);
- ``free``: the caption with no prediction: ngram lookups only.

Each cell runs ``--rounds`` rounds of ``c`` concurrent requests through ``AsyncEngine`` (no HTTP),
greedy; the answers with and without drafts are checked equal.

    python benchmarks/spec_bench.py [--model DIR] [--concurrency 1,4,8] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from vlmserve.config import DEMO_MODEL_DIR
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.frontend.async_engine import AsyncEngine

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]


async def _one(engine: AsyncEngine, rid: str, image: Image.Image, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate_chat(rid, QUESTION, [image], None, params):
        assert out.error is None, out.error
        tokens += out.token_ids
    return tokens


async def _cell(engine: AsyncEngine, image: Image.Image, params: SamplingParams, c: int, rounds: int) -> dict[str, Any]:
    before = await engine.stats()
    start, tokens, outputs = time.perf_counter(), 0, []
    for r in range(rounds):
        outs = await asyncio.gather(*(_one(engine, f"{r}-{i}-{time.monotonic_ns()}", image, params) for i in range(c)))
        tokens += sum(len(o) for o in outs)
        outputs += outs
    seconds = time.perf_counter() - start
    after = await engine.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {"tok_s": tokens / seconds, "tokens": tokens, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None, "outputs": outputs}


async def main(args: argparse.Namespace) -> None:
    image = Image.open(ROOT / "assets" / "example.png").convert("RGB")
    levels = [int(c) for c in args.concurrency.split(",")]
    spec = SpeculativeConfig(num_speculative_tokens=args.k)
    results: dict[str, dict[str, Any]] = {}
    for label, config in (("off", None), ("ngram", spec)):
        engine = AsyncEngine(args.model, config=EngineConfig(max_batch_size=max(levels), speculative=config,
                                                             prefix_cache=False, vision_cache_bytes=0))
        await engine.start()
        try:
            greedy = SamplingParams(max_tokens=64)
            caption = engine.prompter.detokenize(await _one(engine, "probe", image, greedy))
            edited = caption.replace("red", "green", 1) if "red" in caption else caption[:-2]
            workloads = {"copy": caption, "edit": edited, "free": None}
            for name, text in workloads.items():
                params = greedy
                if text is not None and label != "off":
                    ids = engine.prompter.tokenize(text, add_special_tokens=False)
                    params = dataclasses.replace(greedy, prediction=tuple(ids))
                for c in tqdm(levels, desc=f"{label} {name}"):
                    results[f"{label}/{name}/{c}"] = await _cell(engine, image, params, c, args.rounds)
        finally:
            await engine.shutdown()
    rows = []
    for key, spec_cell in results.items():
        label, name, c = key.split("/")
        if label == "off":
            continue
        base = results[f"off/{name}/{c}"]
        assert spec_cell.pop("outputs") == base["outputs"], f"{name} c={c}: drafts changed the answers"
        rows.append({"workload": name, "c": int(c), "tok_s_off": round(base["tok_s"], 1),
                     "tok_s_spec": round(spec_cell["tok_s"], 1), "ratio": round(spec_cell["tok_s"] / base["tok_s"], 2),
                     "acceptance": spec_cell["acceptance"] and round(spec_cell["acceptance"], 3),
                     "drafted": spec_cell["drafted"]})
    print("| workload | c | tok/s off | tok/s spec | ratio | acceptance | draft tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['c']} | {r['tok_s_off']} | {r['tok_s_spec']} | {r['ratio']}x | "
              f"{r['acceptance'] if r['acceptance'] is not None else '-'} | {r['drafted']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_bench.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR))
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    asyncio.run(main(parser.parse_args()))
