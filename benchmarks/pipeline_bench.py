"""[main] One model on one rank against two (pipeline parallel, ``mlx.launch --backend ring -n 2``).

    python benchmarks/pipeline_bench.py [--arch gemma4,qwen2_5_vl] [--size small] [--quick]

For each family: the same offline model (special tokens silenced, so every request runs to
``max_tokens``) served by one ``vlmserve serve`` process, then split over two ranks on loopback.
Measured: tok/s and TTFT at concurrency 1 and 8 (text, and one image per request), the inter-token
gap at c=1 (its difference is the per-step cost of the hop), and each process's memory (RSS, and
the MLX memory each rank reports after loading its slice). Writes ``DIR/pipeline_bench.json``,
``.md`` and ``.png``.

The two ranks start the way ``mlx.launch --backend ring -n 2`` starts them (``MLX_RANK`` and a
ring hostfile of loopback addresses in ``MLX_HOSTFILE``), without the launcher itself: its I/O loop
polls without sleeping and took a whole core (108-120% CPU, measured) of this 2-core machine.

Each process is pinned to cores of its own (``taskset``; ``--no-pin`` to share): one core stands for
one machine, so one process on core 0 is one Mac, two ranks on cores 0 and 1 are two. Unpinned, the
ranks share this machine's two cores and the split only costs: MLX's ring backend spins while it
waits in ``recv`` (a rank waiting 4 s used 2.8 s of CPU), so each rank's wait takes a core from the
rank computing (measured: decode steps at c=8 went from 16 ms to 128 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from loadgen import Target, messages, prompt_text, run_closed_loop, stream_chat, summarize, synthetic_images

from vlmserve.progress import progress
from vlmserve.testing import build_model

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start(model: str, ranks: int, log: Path, pin: bool) -> tuple[list[subprocess.Popen[bytes]], int]:
    """The server's processes, rank 0 first, and its port; ``pin``: rank r on core r alone."""
    port = free_port()
    serve = [sys.executable, "-m", "vlmserve.cli", "--log-level", "info", "serve", "--model", model, "--port", str(port)]
    cmd = serve
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    if ranks == 1:
        cmd = ["taskset", "-c", "0", *serve] if pin else serve
        procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    else:  # as mlx.launch --backend ring -n N does, less its spinning I/O loop
        hostfile = log.with_suffix(".hosts.json")
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        for rank in range(ranks):
            own = {**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            cmd = ["taskset", "-c", str(rank), *serve] if pin else serve
            out = open(log if rank == 0 else log.with_suffix(f".rank{rank}.log"), "w")
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=own, cwd=ROOT))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return procs, port
        except httpx.HTTPError:
            pass
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        p.kill()
    raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def mlx_mib(log: Path) -> dict[str, float]:
    """What each rank reported after materializing its slice (``mx.get_active_memory``)."""
    text = "".join(p.read_text() for p in sorted(log.parent.glob(log.stem + "*.log")))
    found = re.findall(r"pipeline rank (\d+)/\d+: layers .*?weights ([\d.]+) MiB", text)
    return {f"rank {r}": float(m) for r, m in sorted(found)}


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to rank 0: it drains, then stops every rank."""
    procs[0].send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


async def scenario(target: Target, concurrency: int, requests: int, max_tokens: int, image: bool) -> dict[str, Any]:
    images = synthetic_images(requests, size=224) if image else [None] * requests
    async with httpx.AsyncClient(timeout=600) as client:
        factories = [lambda i=i: stream_chat(client, target, messages(prompt_text(48, i), images[i]), max_tokens)
                     for i in range(requests)]
        results, wall = await run_closed_loop(factories, concurrency)
    return summarize(results, wall)


def measure(arch: str, size: str, ranks: int, out: Path, quick: bool, pin: bool) -> dict[str, Any]:
    model = str(build_model(arch, size, ignore_eos=True))
    log = out / f"{arch}-{ranks}rank.log"
    procs, port = start(model, ranks, log, pin)
    target = Target(f"http://127.0.0.1:{port}", model, {"ignore_eos": True})
    max_tokens = 32 if quick else 64
    result: dict[str, Any] = {"arch": arch, "size": size, "ranks": ranks, "pinned": pin, "scenarios": {}}
    try:
        runs = [(c, image) for image in (False, True) for c in (1, 8)]
        with progress(runs, desc=f"{arch}: {ranks} rank(s)", file=sys.stderr) as bar:
            for concurrency, image in bar:
                requests = (2 if quick else 4) * concurrency if concurrency > 1 else (3 if quick else 6)
                name = f"{'image' if image else 'text'} c={concurrency}"
                result["scenarios"][name] = asyncio.run(scenario(target, concurrency, requests, max_tokens, image))
        result["rss_mib"] = {f"rank {r}": rss_mib(p.pid) for r, p in enumerate(procs)}
        result["mlx_mib"] = mlx_mib(log)
    finally:
        stop(procs)
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| family | ranks | scenario | tok/s | TTFT p50 ms | ITL p50 ms |", "|---|---|---|---|---|---|"]
    for r in results:
        for name, s in r["scenarios"].items():
            lines.append(f"| {r['arch']} | {r['ranks']} | {name} | {s['tok_s']} | {s['ttft_ms']['p50']} | "
                         f"{s['itl_ms']['p50']} |")
    lines += ["", "| family | ranks | RSS per process (MiB) | MLX memory after load (MiB) |", "|---|---|---|---|"]
    for r in results:
        rss = ", ".join(f"{k} {v}" for k, v in r["rss_mib"].items())
        mem = ", ".join(f"{k} {v}" for k, v in r["mlx_mib"].items()) or "-"
        lines.append(f"| {r['arch']} | {r['ranks']} | {rss} | {mem} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = sorted({r["arch"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results[0]["scenarios"])
    width = 0.8 / (2 * len(archs))
    for k, arch in enumerate(archs):
        for j, ranks in enumerate((1, 2)):
            run = next((r for r in results if r["arch"] == arch and r["ranks"] == ranks), None)
            if run is None:
                continue
            xs = [i + (2 * k + j) * width for i in range(len(names))]
            label = f"{arch}, {ranks} rank{'s' if ranks > 1 else ''}"
            axes[0].bar(xs, [run["scenarios"][n]["tok_s"] or 0 for n in names], width, label=label)
            axes[1].bar(xs, [run["scenarios"][n]["ttft_ms"]["p50"] or 0 for n in names], width, label=label)
    for ax, title in zip(axes, ("tok/s (higher is better)", "TTFT p50, ms (lower is better)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    pinned = "each process on a core of its own" if results[0]["pinned"] else "every process on both cores"
    fig.suptitle(f"one process against two ranks on loopback ({pinned})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gemma4,qwen2_5_vl")
    parser.add_argument("--size", default="small")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pipeline")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="let every process use every core")
    args = parser.parse_args(argv)
    if args.pin and (os.cpu_count() or 1) < 2:
        parser.error("pinning two ranks to cores of their own takes 2 cores: pass --no-pin")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [measure(arch, args.size, ranks, args.out, args.quick, args.pin)
               for arch in args.arch.split(",") for ranks in (1, 2)]
    (args.out / "pipeline_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "pipeline_bench.md").write_text(table)
    plot(results, args.out / "pipeline_bench.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
