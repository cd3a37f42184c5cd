"""[main] What constrained decoding costs per output token, at batch 1 and 8, on the real engine.

For each batch size, the same requests run unconstrained, under a regex and under a JSON schema
(a long string field, so every request decodes all its tokens under the grammar). The time per
output token is measured from each request's first token to its last, on the real worker and
runner (AsyncEngine, in process), as the median of a few runs; the cost is the ratio to the
unconstrained run. Constrained batches also give up pipelining (engine/guided.py): it is in the
number.

    python benchmarks/guided_bench.py [--model DIR] [--tokens 64] [--runs 3] [--readme]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from vlmserve.config import default_model_path
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.preprocess.guided import GuideSpec
from vlmserve.progress import progress

SPECS = {
    "none": None,
    "regex": GuideSpec("regex", "[a-z ]{400,800}"),
    "json_schema": GuideSpec("json_schema", {"type": "object", "required": ["story"],
                                             "properties": {"story": {"type": "string", "minLength": 400}}}),
}


async def _one(engine: AsyncEngine, rid: str, params: SamplingParams) -> tuple[float, int]:
    first = last = None
    count = 0
    async for out in engine.generate_chat(rid, [{"role": "user", "content": f"Tell me a story {rid}."}], [], None,
                                          params):
        if out.token_ids:
            now = time.perf_counter()
            first = first or now
            last, count = now, count + len(out.token_ids)
    assert first is not None and last is not None and count > 1, (rid, count)
    return (last - first) / (count - 1), count


async def measure(model: str, batches: list[int], tokens: int, runs: int) -> dict[str, dict[int, float]]:
    engine = AsyncEngine(model, config=EngineConfig(max_batch_size=max(batches), prefix_cache=False))
    await engine.start()
    try:
        results: dict[str, dict[int, float]] = {name: {} for name in SPECS}
        total = len(SPECS) * len(batches) * runs
        with progress(total=total, desc="constrained decoding", file=sys.stderr) as bar:
            for batch in batches:
                for name, spec in SPECS.items():
                    guide = await engine.guide(spec) if spec else None
                    params = SamplingParams(max_tokens=tokens, ignore_eos=guide is None, guide=guide)
                    per_run = []
                    for run in range(runs):
                        got = await asyncio.gather(*(_one(engine, f"{name}-{batch}-{run}-{i}", params)
                                                     for i in range(batch)))
                        per_run.append(statistics.mean(t for t, _ in got))
                        bar.update(1)
                    results[name][batch] = statistics.median(per_run)
        return results
    finally:
        await engine.shutdown()


def table(results: dict[str, dict[int, float]], batches: list[int]) -> str:
    head = "| constraint | " + " | ".join(f"batch {b}: ms/token | x unconstrained" for b in batches) + " |"
    rows = [head, "|---|" + "---|---|" * len(batches)]
    for name, by_batch in results.items():
        cells = [f"{by_batch[b] * 1000:.2f} | {by_batch[b] / results['none'][b]:.2f}" for b in batches]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the built-in demo model)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--runs", type=int, default=3, help="runs per cell (the median is kept)")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--readme", action="store_true", help="append the table to benchmarks/README.md")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = args.model or str(default_model_path())
    results = asyncio.run(measure(model, batches, args.tokens, args.runs))
    text = table(results, batches)
    print(text)
    if args.readme:
        readme = Path(__file__).with_name("README.md")
        readme.write_text(readme.read_text() + f"\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
