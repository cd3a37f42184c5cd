"""[main] One burst, step by step: which piece of which prompt ran in which engine step (issue 46).

    python benchmarks/burst_timeline.py [--arch gemma4|qwen2_5_vl|smolvlm_real] [--max-share 4]
        [--no-gate] [--max-batch-size N] [--tag -before] [--out benchmarks/results/burst-timeline]

In process (``AsyncEngine``, its real worker thread), the stall scenario of ``stall_bench.py``: one text
stream decodes (``ignore_eos``), then 8 fresh 224x224 image prompts arrive at once, 48 tokens each. Every
step's plan is recorded as the scheduler wrote it (encodes with their tower blocks, prefill pieces with
their tokens and layers, the rows that decode, those held by the join gate, the prompt-token budget) with
the seconds the runner took. Prints the burst's steps as a table and writes ``timeline-ARCH.json`` and a
plot, ``timeline-ARCH.png``: each step a bar as long as it took, coloured by what it ran, each image's
first token marked, each step's decode forward apart from its prompt work; and a table of what the last
image's tail is made of (burst_tail.py): phase 1, waiting for a batch row, its prompt and its answer, each
by decode, vision, prefill and idle seconds. The small fixtures run in bfloat16; ``smolvlm_real`` is the real-weights SmolVLM
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

from burst_tail import admissions, instrument, last_image_tail, split, tail_table
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


def record(engine: AsyncEngine, steps: list[dict[str, Any]], queued: dict[str, float]) -> None:
    """Wrap the engine's scheduler and runner (on the worker) so that each step's plan and time is kept,
    with its decode, vision and prefill seconds (burst_tail.py)."""
    core = engine.core
    assert core is not None
    instrument(core, steps, queued)
    schedule, execute = core.scheduler.schedule, core.runner.execute

    def planned() -> Any:
        plan = schedule()
        steps.append({"t": time.perf_counter(), "budget": core.scheduler.stream_tokens, "plan": plan})
        return plan

    def executed(plan: Any) -> Any:
        start = steps[-1]["t0"] = time.perf_counter()
        out = execute(plan)
        steps[-1]["s"] = time.perf_counter() - start
        return out

    core.scheduler.schedule, core.runner.execute = planned, executed  # type: ignore[method-assign]


def describe(step: dict[str, Any], held: int) -> dict[str, Any]:
    plan = step["plan"]
    return {"t": step["t"], "s": step.get("s", 0.0), "parts": split(step), "budget": step["budget"],
            "decode": len(plan.decode),
            "held": held, "join": list(plan.join),
            "encode": [[c.request_id, c.first_block, c.last_block] for c in plan.encode if c.request_id != "stream"],
            "prefill": [[c.request_id, c.start, c.end, c.first_layer, c.last_layer] for c in plan.prefill]}


async def burst(path: Path, config: EngineConfig) -> dict[str, Any]:
    engine = AsyncEngine(str(path), config=config)
    await engine.start()
    steps: list[dict[str, Any]] = []
    queued: dict[str, float] = {}
    record(engine, steps, queued)
    gaps: list[tuple[float, float]] = []
    first: dict[str, float] = {}
    life: dict[str, dict[str, float]] = {}
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
        times = life[f"img{i}"] = {"sent": sent}
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture."}]}]
        async for _ in engine.generate_chat(f"img{i}", messages, [picture], None,
                                            SamplingParams(max_tokens=IMAGE_TOKENS, ignore_eos=True)):
            first.setdefault(f"img{i}", time.perf_counter() - sent)
            times.setdefault("first", time.perf_counter())
        times["done"] = time.perf_counter()

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
    admitted = admissions(steps)
    for name, times in life.items():
        times.update(queued=queued[name], admitted=admitted[name])
    ttft = sorted(first.values())
    return {"tail": last_image_tail(steps, life), "last_done_s": max(t["done"] - t["sent"] for t in life.values()),
            "stall_ratio": max(during) / statistics.median(during), "longest_gap_s": max(during),
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
    """Top: each step a bar, its decode forward (grey) then its prompt work (coloured by kind). Bottom: the
    last image's segments (phase 1, waiting for a row, its prompt, its answer)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.4))
    colours = {"decode": "#9e9e9e", "encode": "#1f77b4", "prefill": "#ff7f0e", "both": "#9467bd"}
    for s in result["steps"]:
        kind = "both" if s["encode"] and s["prefill"] else "encode" if s["encode"] else \
            "prefill" if s["prefill"] else "decode"
        decode = s["parts"].get("decode in prompt steps", 0.0) if kind != "decode" else s["s"]
        ax.barh(1, decode, left=s["t"], color=colours["decode"], edgecolor="white", linewidth=0.3)
        if kind != "decode":
            ax.barh(1, s["s"] - decode, left=s["t"] + decode, color=colours[kind], edgecolor="white", linewidth=0.3)
    for t in result["image_ttft_s"]:
        ax.axvline(t, color="#2ca02c", linewidth=1)
    segments = {"phase 1": "#bcbd22", "waiting for a row": "#d62728", "its prompt": "#8c564b", "its answer": "#17becf"}
    for row in result["tail"]["segments"]:
        ax.barh(0, row["to_s"] - row["from_s"], left=row["from_s"], color=segments[row["segment"]], height=0.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*colours.values(), *segments.values())]
    ax.legend([*handles, plt.Line2D([0], [0], color="#2ca02c")], [*colours, *segments, "an image's first token"],
              ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False, fontsize=8)
    ax.set_yticks([0, 1], ["last image", "steps"])
    ax.set_xlabel("seconds since the images were sent")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--arch", default="gemma4", choices=("gemma4", "qwen2_5_vl", "smolvlm_real"))
    parser.add_argument("--max-share", type=float, default=EngineConfig().stream_step_share_max)
    parser.add_argument("--no-gate", action="store_true", help="rows join the decode batch as their prompt ends")
    parser.add_argument("--max-batch-size", type=int, default=EngineConfig().max_batch_size)
    parser.add_argument("--tag", default="", help="appended to the output files' names (a before/after pair)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    config = EngineConfig(max_batch_size=args.max_batch_size, stream_step_share_max=args.max_share,
                          join_gate=not args.no_gate)
    result = asyncio.run(burst(model_path(args.arch), config))
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"timeline-{args.arch}{'-nogate' if args.no_gate else ''}{args.tag}"
    result["config"] = {k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, (int, float, bool, str))}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    ttft = result["image_ttft_s"]
    summary = (f"{args.arch}: stall ratio {result['stall_ratio']:.1f} (longest {result['longest_gap_s'] * 1000:.0f} ms, "
               f"median {result['median_gap_s'] * 1000:.0f} ms), image TTFT p50 {statistics.median(ttft):.2f} s, "
               f"max {max(ttft):.2f} s, last image done {result['last_done_s']:.2f} s")
    plot(result, args.out / f"{name}.png", summary)
    print(table(result))
    print(tail_table(result["tail"]))
    print(summary)


if __name__ == "__main__":
    main()
