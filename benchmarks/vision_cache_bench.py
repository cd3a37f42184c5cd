"""[main] Multi-turn chat about one image: TTFT and vision time per turn, vlmserve's vision cache on and off, mlx_vlm.server.

    python benchmarks/vision_cache_bench.py [--arch qwen2_5_vl|gemma4] [--dtype float32|bfloat16] [--no-openblas]
        [--image-size 448] [--reps 6] [--waves 3] [--turns 4] [--max-tokens 24] [--servers on,off,mlx_vlm]
        [--vllm-mlx VENV] [--out DIR] [--plot PNG]
    python benchmarks/vision_cache_bench.py --rerender [--dtype ...] [--out DIR]   # tables and plot again

Builds qwen2_5_vl/small (``ignore_eos=True``: every answer is ``max_tokens`` long on both servers)
and copies it with a processor bound that keeps a 448x448 image whole (1024 patches, 256 image
tokens; the small model's own bound is 224x224); ``--arch gemma4`` builds gemma4/small and copies it
with the released models' image budget (280 soft tokens; the small build keeps 70). Then, one server at a time (vlmserve with the
cache on, vlmserve with ``--vision-cache-mb 0``, ``python -m mlx_vlm.server``), it runs
conversations of ``--turns`` streamed, greedy turns: turn k sends the image in the first user
message, the k-1 earlier questions and answers (fixed texts, the same on every server, so that
every server sees the same prompts) and a new question. At c=1, ``--reps`` conversations one
after the other; at c=4, ``--waves`` groups of 4 conversations in lockstep (the 4 turn-k requests
sent together, turn k+1 once all have finished). Each conversation has its own image, so turn 1
is always a miss. Around each turn (c=1) or wave (c=4) it reads vlmserve's /metrics: the delta of
``vlmserve_vision_seconds_total`` and of the cache's hits and misses. Writes ``vision_cache.json``
and ``vision_cache.md`` to DIR (default benchmarks/results/vision-cache-DTYPE) and the plot to
``benchmarks/vision_cache_ttft.png``. ``--servers mlx_vlm_apc`` adds mlx_vlm.server with its prefix
cache (APC) on, ``mm`` vlmserve with its image-keyed prefix cache (``--mm-prefix-cache``) on,
``vllm_mlx`` vllm-mlx (``serve --mllm --continuous-batching``, its prefix cache on by default) from the
venv ``--vllm-mlx`` names (``pip install vllm-mlx==0.6.0 "mlx[cpu]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from compare import OPENBLAS, ServerSpec, float32_copy, free_port, machine, server_specs, serving
from loadgen import Target, messages, stream_chat, synthetic_images
from prometheus_client.parser import text_string_to_metric_families
from report import _table

from vlmserve.progress import Progress, progress

HERE = Path(__file__).resolve().parent
SIZE, MAX_BATCH = "small", 8
VLLM_MLX = HERE / "results" / "venvs" / "vllm-mlx"
GEMMA4_SOFT_TOKENS = 280  # the released Gemma 4 checkpoints' image budget
QUESTIONS = ("What is in this picture?", "Which colour covers most of it?",
             "How many round shapes can you see, and where are they?", "Describe the top left corner in one sentence.")
ANSWER = "The picture shows a few {}-coloured shapes, circles and rectangles, on a plain ground; one overlaps another."
ANSWER_WORDS = ("red", "blue", "green")
COUNTERS = {"seconds": "vlmserve_vision_seconds_total", "hits": "vlmserve_vision_cache_hits_total",
            "misses": "vlmserve_vision_cache_misses_total"}


def bench_model(arch: str, dtype: str, image_size: int, root: Path) -> Path:
    """The small model (float32 copy if asked) whose processor keeps an ``image_size`` square whole
    (Qwen), or takes the released models' image budget (Gemma 4)."""
    from vlmserve.testing import build_model

    model = build_model(arch, SIZE, ignore_eos=True)
    if dtype == "float32":
        model = float32_copy(model, root)
    dest = root / f"{model.name}-px{image_size}"
    if not (dest / "model.safetensors").exists():
        tmp = root / f".{dest.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model, tmp)
        path = tmp / "processor_config.json"
        config = json.loads(path.read_text())
        if arch == "gemma4":
            config["image_processor"]["max_soft_tokens"] = GEMMA4_SOFT_TOKENS
        else:  # max_pixels: the real Qwen2.5-VL processors allow 12.8 M pixels; the small build stops at 224x224.
            config["image_processor"]["size"]["longest_edge"] = image_size * image_size
        path.write_text(json.dumps(config, indent=2))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def history(image_url: str, turn: int) -> list[dict[str, Any]]:
    """Turn ``turn`` (from 1) of a conversation: the image first, earlier answers, a new question."""
    msgs = messages(QUESTIONS[0], image_url)
    for k in range(1, turn):
        msgs += [{"role": "assistant", "content": ANSWER.format(ANSWER_WORDS[(k - 1) % len(ANSWER_WORDS)])},
                 {"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
    return msgs


class Conversations:
    """One server under test: sends the turns, reads its vision counters around them."""

    def __init__(self, target: Target, client: httpx.AsyncClient, bar: Progress, args: argparse.Namespace,
                 metrics: bool) -> None:
        self.target, self.client, self.bar, self.args, self.metrics = target, client, bar, args, metrics

    async def counters(self) -> dict[str, float]:
        """vlmserve's vision counters and cache gauges, summed over models; {} for a server without them."""
        if not self.metrics:
            return {}
        values: dict[str, float] = {}
        for family in text_string_to_metric_families((await self.client.get("/metrics")).text):
            for sample in family.samples:
                if sample.name.startswith("vlmserve_vision_"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    async def warmup(self, image_url: str) -> list[int | None]:
        """One conversation, not streamed, not counted; returns each turn's prompt tokens."""
        tokens = []
        for turn in range(1, self.args.turns + 1):
            body = {"model": self.target.model, "messages": history(image_url, turn), "temperature": 0.0,
                    "max_tokens": self.args.max_tokens, **self.target.extra_body}
            response = await self.client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            tokens.append((response.json().get("usage") or {}).get("prompt_tokens"))
            self.bar.update(1)
        return tokens

    async def wave(self, image_urls: list[str], turn: int) -> dict[str, Any]:
        """Turn ``turn`` of each conversation, all sent together; the vision counters' deltas around them."""
        before = await self.counters()
        results = await asyncio.gather(*(stream_chat(self.client, self.target, history(url, turn),
                                                     self.args.max_tokens, f"turn{turn}") for url in image_urls))
        after = await self.counters()
        self.bar.update(len(results))
        deltas = {k: after[name] - before[name] for k, name in COUNTERS.items() if name in after}
        return {"turn": turn, "requests": len(results), "ttft_ms": [_ms(r.ttft) for r in results if r.ok],
                "errors": [r.error for r in results if r.error], **deltas}

    async def scenario(self, groups: list[list[str]]) -> dict[str, Any]:
        """Each group's conversations in lockstep, one group after the other."""
        return {"waves": [await self.wave(group, turn) for group in groups for turn in range(1, self.args.turns + 1)]}


def add_turns(summary: dict[str, Any]) -> None:
    """Each server's numbers per turn number, from its waves."""
    for server in summary["servers"]:
        for c in ("c1", "c4"):
            if c in server:
                waves = server[c]["waves"]
                turns = sorted({w["turn"] for w in waves})
                server[c]["turns"] = [per_turn([w for w in waves if w["turn"] == t]) for t in turns]


def per_turn(waves: list[dict[str, Any]]) -> dict[str, Any]:
    """Median TTFT over the turn's requests; vision ms per wave (c=1: one request) and per request (the
    wave's total / its requests), each the median over the waves: one slow outlier on a shared machine
    does not move it."""
    ttfts = [t for w in waves for t in w["ttft_ms"]]
    out: dict[str, Any] = {"turn": waves[0]["turn"], "requests": sum(w["requests"] for w in waves), "ok": len(ttfts),
                           "ttft_ms_median": round(statistics.median(ttfts), 1) if ttfts else None,
                           "ttft_ms": ttfts, "errors": sorted({e for w in waves for e in w["errors"]})[:3]}
    if "seconds" in waves[0]:
        per_wave = [1000 * w["seconds"] for w in waves]
        out.update(vision_ms_per_request=round(statistics.median(v / w["requests"] for v, w in zip(per_wave, waves)), 1),
                   vision_ms_per_wave=round(statistics.median(per_wave), 1), vision_ms_per_wave_all=[round(v, 1) for v in per_wave],
                   hits=round(sum(w["hits"] for w in waves)), misses=round(sum(w["misses"] for w in waves)))
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


async def drive(spec: ServerSpec, target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then c=1, then c=4; distinct images throughout (the same set on every server)."""
    urls = synthetic_images(1 + args.reps + 4 * args.waves, size=args.image_size, seed=23)
    groups1 = [[u] for u in urls[1:1 + args.reps]]
    rest = urls[1 + args.reps:]
    groups4 = [rest[4 * i:4 * i + 4] for i in range(args.waves)]
    total = args.turns * (1 + args.reps + 4 * args.waves)
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=target.base_url, limits=limits, timeout=httpx.Timeout(120.0)) as client:
        with progress(total=total, desc=spec.label, unit="req", file=sys.stderr) as bar:
            conv = Conversations(target, client, bar, args, metrics=spec.label.startswith("vlmserve"))
            out: dict[str, Any] = {"prompt_tokens": await conv.warmup(urls[0])}
            for name, groups in (("c1", groups1), ("c4", groups4)):
                bar.set_postfix_str(name)
                out[name] = await conv.scenario(groups)
            out["cache_at_end"] = {k.removeprefix("vlmserve_vision_cache_"): v
                                   for k, v in (await conv.counters()).items() if not k.endswith("_total")}
    return out


def bench_server(spec: ServerSpec, port: int, model: Path, args: argparse.Namespace, env: dict[str, str],
                 log_path: Path) -> dict[str, Any]:
    """Start one server, run the scenarios against it, stop it (by its PID)."""
    out: dict[str, Any] = {"label": spec.label, "argv": spec.argv[1:], "loadavg_1m_at_start": os.getloadavg()[0]}
    with serving(spec, port, env, log_path) as (problem, ready_s):
        if problem is not None:
            return {**out, "failed": f"server {problem}; see {log_path}"}
        out["ready_s"] = round(ready_s, 1)
        target = Target(f"http://127.0.0.1:{port}", str(model), spec.extra_body)
        out.update(asyncio.run(drive(spec, target, args)))
    return {**out, "loadavg_1m_at_end": os.getloadavg()[0]}


def specs(model: Path, port: int, vllm_mlx: Path) -> dict[str, ServerSpec]:
    vlmserve, mlx_vlm = server_specs(model, port, MAX_BATCH)
    off = replace(vlmserve, label="vlmserve cache off", argv=[*vlmserve.argv, "--vision-cache-mb", "0"])
    mm = replace(vlmserve, label="vlmserve mm prefix cache", argv=[*vlmserve.argv, "--mm-prefix-cache"])
    vllm = ServerSpec("vllm-mlx", [str(vllm_mlx / "bin" / "vllm-mlx"), "serve", str(model), "--mllm",
                                   "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)], "/v1/models", {})
    return {"on": replace(vlmserve, label="vlmserve cache on"), "off": off, "mm": mm,
            "mlx_vlm": replace(mlx_vlm, label="mlx_vlm.server"), "mlx_vlm_apc": replace(mlx_vlm, label="mlx_vlm.server APC"),
            "vllm_mlx": vllm}


# mlx_vlm.server's automatic prefix cache is off by default; "mlx_vlm_apc" turns it on, in memory only
# (its disk store would carry KV over from one run to the next).
SERVER_ENV = {"mlx_vlm_apc": {"APC_ENABLED": "1", "APC_DISK_ENABLED": "0"}}


def feature_bytes(model: Path, image_size: int, dtype: str) -> dict[str, Any]:
    """What one image's cached features should take: tokens x the language model's width x dtype bytes."""
    config = json.loads((model / "config.json").read_text())
    vision = config["vision_config"]
    if "spatial_merge_size" in vision:  # Qwen: merged patches of the square
        tokens = (image_size // (vision["patch_size"] * vision["spatial_merge_size"])) ** 2
    else:  # Gemma 4: its soft-token budget
        tokens = json.loads((model / "processor_config.json").read_text())["image_processor"]["max_soft_tokens"]
    hidden = config.get("text_config", {}).get("hidden_size") or config["hidden_size"]
    width = 4 if dtype == "float32" else 2
    return {"image_tokens": tokens, "hidden": hidden, "dtype_bytes": width, "bytes": tokens * hidden * width}


def render(summary: dict[str, Any]) -> str:
    """One row per (concurrency, turn): median TTFT on each server, vision ms per request on vlmserve."""
    servers = [s for s in summary["servers"] if "failed" not in s]
    vlm = [s for s in servers if s["label"].startswith("vlmserve")]
    header = ["c", "turn", "prompt tokens", *(f"TTFT p50 ms, {s['label']}" for s in servers),
              *(f"vision ms/request, {s['label'].removeprefix('vlmserve ')}" for s in vlm), "hits/misses, cache on"]
    on = next((s for s in vlm if s["label"].endswith("on")), None)
    rows = [[c[1], i + 1, servers[0]["prompt_tokens"][i], *(s[c]["turns"][i]["ttft_ms_median"] for s in servers),
             *(s[c]["turns"][i]["vision_ms_per_request"] for s in vlm),
             f"{on[c]['turns'][i]['hits']}/{on[c]['turns'][i]['misses']}" if on else "-"]
            for c in ("c1", "c4") for i in range(summary["config"]["turns"])] if servers else []
    failed = "".join(f"\n**{s['label']} failed**: {s['failed']}\n" for s in summary["servers"] if "failed" in s)
    cache, f = (on or {}).get("cache_at_end", {}), summary["features"]
    measured = round(cache["bytes"] / cache["entries"]) if cache.get("entries") else None
    return (_table(header, rows) + failed + f"\nBytes per cached image: {measured} measured ({_int(cache.get('bytes'))} "
            f"bytes / {_int(cache.get('entries'))} entries), {f['bytes']} computed ({f['image_tokens']} tokens x {f['hidden']} x "
            f"{f['dtype_bytes']} bytes).\n")


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = list(range(1, summary["config"]["turns"] + 1))
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4), dpi=90)
    for ax, c in zip(axes, ("c1", "c4")):
        for s in summary["servers"]:
            if "failed" not in s:
                ax.plot(turns, [t["ttft_ms_median"] for t in s[c]["turns"]], "o-", label=s["label"])
        ax.set(xlabel="turn", ylabel="TTFT p50 ms", title=f"concurrency {c.removeprefix('c')}", ylim=(0, None))
        ax.set_xticks(turns)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{summary['arch']}/{SIZE} {summary['dtype']}, one {summary['image_size']}px image per conversation",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2_5_vl", choices=["qwen2_5_vl", "gemma4"])
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"], help="float32: a converted copy")
    parser.add_argument("--no-openblas", action="store_true", help=f"do not LD_PRELOAD {OPENBLAS} into the servers")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--reps", type=int, default=6, help="conversations at c=1")
    parser.add_argument("--waves", type=int, default=3, help="groups of 4 conversations at c=4")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--servers", default="on,off,mlx_vlm",
                        help="which of on, off, mm, mlx_vlm, mlx_vlm_apc, vllm_mlx, in this order")
    parser.add_argument("--vllm-mlx", type=Path, default=VLLM_MLX, help="the venv vllm-mlx is installed in")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/vision-cache[-ARCH]-DTYPE")
    parser.add_argument("--plot", type=Path, default=HERE / "vision_cache_ttft.png")
    parser.add_argument("--rerender", action="store_true", help="only redo the numbers per turn, table and plot")
    args = parser.parse_args(argv)
    arch = "" if args.arch == "qwen2_5_vl" else f"-{args.arch}"
    out = args.out or HERE / "results" / f"vision-cache{arch}-{args.dtype}"
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((out / "vision_cache.json").read_text()) if args.rerender else run(args, out)
    add_turns(summary)
    (out / "vision_cache.json").write_text(json.dumps(summary, indent=1))
    text = render(summary)
    (out / "vision_cache.md").write_text(text)
    plot(summary, args.plot)
    print(text)
    print(f"results in {out}, plot in {args.plot}")
    return 0


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1")
    if not args.no_openblas and Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    model = bench_model(args.arch, args.dtype, args.image_size, HERE / "results" / "models")
    port = free_port()
    chosen = specs(model, port, args.vllm_mlx)
    results = [bench_server(chosen[name], port, model, args, {**env, **SERVER_ENV.get(name, {})}, out / f"{name}.log")
               for name in args.servers.split(",")]
    return {"machine": machine(env), "arch": args.arch, "size": SIZE, "dtype": args.dtype, "image_size": args.image_size,
            "model": str(model), "config": {k: getattr(args, k) for k in ("reps", "waves", "turns", "max_tokens")},
            "features": feature_bytes(model, args.image_size, args.dtype), "servers": results}


if __name__ == "__main__":
    sys.exit(main())
