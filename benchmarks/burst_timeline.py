"""[main] One burst, step by step: which piece of which prompt ran in which engine step (issue 46).

    python benchmarks/burst_timeline.py [--arch gemma4|qwen2_5_vl|smolvlm_real] [--max-share 4]
        [--no-gate] [--out benchmarks/results/burst-timeline]

In process (``AsyncEngine``, its real worker thread), the stall scenario of ``stall_bench.py``: one text
stream decodes (``ignore_eos``), then 8 fresh 224x224 image prompts arrive at once, 48 tokens each. Every
step's plan is recorded as the scheduler wrote it (encodes with their tower blocks, prefill pieces with
their tokens and layers, the rows that decode, those held by the join gate, the prompt-token budget) with
the seconds the runner took. Prints the burst's steps as a table and writes ``timeline-ARCH.json`` and a
plot, ``timeline-ARCH.png``: each step a bar as long as it took, coloured by what it ran, each image's
first token marked. The small fixtures run in bfloat16; ``smolvlm_real`` is the real-weights SmolVLM
(``real_weights.py``, float32, this process's BLAS: the stock wheel's unless OpenBLAS is preloaded).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from loadgen import synthetic_pil_images

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine

IMAGES, IMAGE_TOKENS, IMAGE_SIZE, STEADY = 8, 48, 224, 12
OUT = Path(__file__).resolve().parent / "results" / "burst-timeline"


def model_path(arch: str) -> Path:
    if arch == "smolvlm_real":
        from real_weights import build_smolvlm_smollm2
        return build_smolvlm_smollm2()
    from vlmserve.testing.build import build_model
    return build_model(arch, "small", ignore_eos=True)


def record(engine: AsyncEngine, steps: list[dict[str, Any]]) -> None:
    """Wrap the engine's scheduler and runner (on the worker) so that each step's plan and time is kept."""
    core = engine.core
    assert core is not None
    schedule, execute = core.scheduler.schedule, core.runner.execute

    def planned() -> Any:
        plan = schedule()
        steps.append({"t": time.perf_counter(), "budget": core.scheduler.stream_tokens, "plan": plan})
        return plan

    def executed(plan: Any) -> Any:
        start = time.perf_counter()
        out = execute(plan)
        steps[-1]["s"] = time.perf_counter() - start
        return out

    core.scheduler.schedule, core.runner.execute = planned, executed  # type: ignore[method-assign]


def describe(step: dict[str, Any], held: int) -> dict[str, Any]:
    plan = step["plan"]
    return {"t": step["t"], "s": step.get("s", 0.0), "budget": step["budget"], "decode": len(plan.decode),
            "held": held, "join": list(plan.join),
            "encode": [[c.request_id, c.first_block, c.last_block] for c in plan.encode if c.request_id != "stream"],
            "prefill": [[c.request_id, c.start, c.end, c.first_layer, c.last_layer] for c in plan.prefill]}


async def burst(path: Path, config: EngineConfig) -> dict[str, Any]:
    engine = AsyncEngine(str(path), config=config)
    await engine.start()
    steps: list[dict[str, Any]] = []
    record(engine, steps)
    gaps: list[tuple[float, float]] = []
    first: dict[str, float] = {}
    stop = asyncio.Event()

    async def stream() -> None:
        last = None
        messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
        async for _ in engine.generate_chat("stream", messages, [], None, SamplingParams(max_tokens=4000, ignore_eos=True)):
            now = time.perf_counter()
            if last is not None:
                gaps.append((now, now - last))
            last = now
            if stop.is_set():
                return

    async def image(i: int, picture: Any) -> None:
        sent = time.perf_counter()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture."}]}]
        async for _ in engine.generate_chat(f"img{i}", messages, [picture], None,
                                            SamplingParams(max_tokens=IMAGE_TOKENS, ignore_eos=True)):
            first.setdefault(f"img{i}", time.perf_counter() - sent)

    task = asyncio.create_task(stream())
    while len(gaps) < STEADY:
        await asyncio.sleep(0.01)
    start = time.perf_counter()
    await asyncio.gather(*(image(i, p) for i, p in enumerate(synthetic_pil_images(IMAGES, IMAGE_SIZE, seed=46))))
    end = time.perf_counter()
    stop.set()
    await task
    await engine.shutdown()
    during = [g for t, g in gaps if start <= t <= end]
    held = 0
    timeline = []
    for step in steps:
        if start - 0.05 <= step["t"] <= end:
            row = describe(step, held)
            timeline.append({**row, "t": row["t"] - start})
        held += sum(1 for c in step["plan"].prefill if c.hold) - len(step["plan"].join)
    ttft = sorted(first.values())
    return {"stall_ratio": max(during) / statistics.median(during), "longest_gap_s": max(during),
            "median_gap_s": statistics.median(during), "image_ttft_s": ttft, "burst_s": end - start,
            "steps": timeline}


def table(result: dict[str, Any]) -> str:
    lines = ["| t s | step ms | budget | decode | held | encode (blocks) | prefill (tokens, layers) |",
             "|---|---|---|---|---|---|---|"]
    for s in result["steps"]:
        enc = ", ".join(f"{r} {a}-{'end' if b is None else b}" for r, a, b in s["encode"])
        pre = ", ".join(f"{r} {a}:{b}" + (f" L{x}-{'end' if y is None else y}" if x or y is not None else "")
                        for r, a, b, x, y in s["prefill"])
        lines.append(f"| {s['t']:.2f} | {s['s'] * 1000:.0f} | {s['budget']} | {s['decode']} | {s['held']} | {enc} | {pre} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 2.8))
    colours = {"decode": "#9e9e9e", "encode": "#1f77b4", "prefill": "#ff7f0e", "both": "#9467bd"}
    for s in result["steps"]:
        kind = "both" if s["encode"] and s["prefill"] else "encode" if s["encode"] else \
            "prefill" if s["prefill"] else "decode"
        ax.barh(0, s["s"], left=s["t"], color=colours[kind], edgecolor="white", linewidth=0.3)
    for t in result["image_ttft_s"]:
        ax.axvline(t, color="#2ca02c", linewidth=1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend([*handles, plt.Line2D([0], [0], color="#2ca02c")], [*colours, "an image's first token"],
              ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    ax.set_yticks([])
    ax.set_xlabel("seconds since the images were sent")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--arch", default="gemma4", choices=("gemma4", "qwen2_5_vl", "smolvlm_real"))
    parser.add_argument("--max-share", type=float, default=EngineConfig().stream_step_share_max)
    parser.add_argument("--no-gate", action="store_true", help="rows join the decode batch as their prompt ends")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    config = EngineConfig(max_batch_size=16, stream_step_share_max=args.max_share, join_gate=not args.no_gate)
    result = asyncio.run(burst(model_path(args.arch), config))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"timeline-{args.arch}{'-nogate' if args.no_gate else ''}"
    result["config"] = {k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, (int, float, bool, str))}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    ttft = result["image_ttft_s"]
    summary = (f"{args.arch}: stall ratio {result['stall_ratio']:.1f} (longest {result['longest_gap_s'] * 1000:.0f} ms, "
               f"median {result['median_gap_s'] * 1000:.0f} ms), image TTFT p50 {statistics.median(ttft):.2f} s, "
               f"max {max(ttft):.2f} s")
    plot(result, args.out / f"{name}.png", summary)
    print(table(result))
    print(summary)


if __name__ == "__main__":
    main()
