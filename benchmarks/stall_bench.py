"""[main] The stall (issue 30): does a running stream freeze when fresh image prompts arrive?

vlmserve, mlx_vlm.server and vllm-mlx, one at a time, on the same small offline models.

    python benchmarks/stall_bench.py [--arch gemma4,qwen2_5_vl] [--dtype bfloat16,float32] [--runs 2]
        [--servers vlmserve,base,mlx_vlm,vllm_mlx] [--base CHECKOUT ...] [--quick] [--out DIR]
    python benchmarks/stall_bench.py --readme [DIR ...]     # results (their runs side by side) into the README

One text stream decodes (a long answer; the models are built with ``ignore_eos=True``, so every answer
runs to its ``max_tokens``). Once it streams steadily, 8 image prompts arrive at once, each with a
224x224 picture no server has seen (no cache can skip the vision tower), 48 output tokens each. The
stream is closed when the last of them ends. Measured, one server at a time:
- the **stall ratio**: the stream's longest gap between chunks over its median gap, both over the gaps
  that end during the burst (from when the images were sent until the last one ended): a bigger batch
  makes every step longer; one step far longer than the others is a freeze;
- the longest gap, the image prompts' TTFT p50 and p90, and how many of them got their first token while
  the stream still ran (a server that holds them until the stream ends never freezes it).
float32 loads a float32 copy with OpenBLAS preloaded (shared/FACTS.md). vllm-mlx runs from its own venv
(``--vllm-mlx``; ``pip install vllm-mlx==0.6.0 "mlx[cpu]"``). ``--base CHECKOUT`` (repeatable; ``base`` in
``--servers``) serves another vlmserve checkout, e.g. a ``git worktree`` of an earlier commit, with the
same Python (``PYTHONPATH``), labelled by its commit: before and after an engine change in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from compare import OPENBLAS, ServerSpec, float32_copy, free_port, machine, server_specs, serving
from loadgen import RequestResult, Target, messages, percentile, prompt_text, stream_chat, synthetic_images
from report import _table

from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
MAX_BATCH, IMAGES, IMAGE_TOKENS, IMAGE_SIZE = 16, 8, 48, 224
STREAM_TOKENS = 2000  # outlasts every burst here many times over; vllm-mlx holds the images until it ends
STEADY_CHUNKS = 12  # the stream's chunks before the images are sent
VLLM_MLX = HERE / "results" / "venvs" / "vllm-mlx"
PLOT = "stall_gaps.png"
SECTION = ("<!-- stall_bench:start -->", "<!-- stall_bench:end -->")


def specs(model: Path, port: int, vllm_mlx: Path, bases: list[Path]) -> dict[str, ServerSpec]:
    """Every server this run may start, by name; a base checkout's name is ``base:PATH``."""
    vlmserve, mlx_vlm = server_specs(model, port, MAX_BATCH)
    # -P: ``python -m`` would put the working directory (this checkout) ahead of PYTHONPATH.
    vlmserve = replace(vlmserve, argv=[vlmserve.argv[0], "-P", *vlmserve.argv[1:]])
    out = {"vlmserve": vlmserve, "mlx_vlm": replace(mlx_vlm, label="mlx_vlm.server"),
           "vllm_mlx": ServerSpec("vllm-mlx", [str(vllm_mlx / "bin" / "vllm-mlx"), "serve", str(model), "--mllm",
                                               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)],
                                  "/v1/models", {})}
    for base in bases:
        out[f"base:{base}"] = replace(vlmserve, label=f"vlmserve {commit(base)}")
    return out


def commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or checkout.name


def which_vlmserve(env: dict[str, str]) -> str:
    """The vlmserve package a server started with ``env`` imports (checked, not assumed)."""
    argv = [sys.executable, "-P", "-c", "import vlmserve; print(vlmserve.__file__)"]
    return subprocess.run(argv, env=env, cwd=HERE.parent, capture_output=True, text=True).stdout.strip()


async def burst(target: Target, seed: int) -> dict[str, Any]:
    """The scenario against one ready server: a stream, then fresh image prompts at once."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=IMAGES + 4)) as client:
        await _warm(client, target, seed)
        stream = RequestResult()
        task = asyncio.create_task(stream_chat(client, target, messages(prompt_text(12, seed)), STREAM_TOKENS,
                                               "stream", result=stream, timeout=600))
        while len(stream.chunk_times) < STEADY_CHUNKS and not task.done():
            await asyncio.sleep(0.01)
        urls = synthetic_images(IMAGES, size=IMAGE_SIZE, seed=seed * 1000 + 7)
        shots = await asyncio.gather(*(stream_chat(client, target, messages(prompt_text(12, i), url), IMAGE_TOKENS,
                                                   "image", timeout=600) for i, url in enumerate(urls)))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return measure(stream, list(shots))


async def _warm(client: httpx.AsyncClient, target: Target, seed: int) -> None:
    """One image and one text request first, so that nobody's first-call costs land in the burst."""
    url = synthetic_images(1, size=IMAGE_SIZE, seed=seed * 1000 + 999)[0]
    for msgs in (messages("Warm up.", url), messages("Warm up.")):
        result = await stream_chat(client, target, msgs, 4, "warm-up", timeout=300)
        if not result.ok:
            raise RuntimeError(f"warm-up failed: {result.error}")


def measure(stream: RequestResult, shots: list[RequestResult]) -> dict[str, Any]:
    """The stream's gaps that end during the burst, and the images' first tokens; times in seconds
    from when the images were sent."""
    start = min(s.sent_at for s in shots)
    end = max(s.sent_at + (s.latency or 0) for s in shots)
    times = [stream.sent_at + t for t in stream.chunk_times]
    gaps = [(b - start, b - a) for a, b in zip(times, times[1:]) if start < b <= end]
    if not gaps:
        return {"failed": f"the stream sent nothing during the burst ({stream.error or 'no error'})"}
    values = [g for _, g in gaps]
    median, ttfts = statistics.median(values), [s.ttft for s in shots if s.ttft is not None]
    alongside = sum(s.sent_at + s.ttft < times[-1] for s in shots if s.ttft is not None)
    return {"stall_ratio": round(max(values) / median, 1), "longest_gap_ms": round(max(values) * 1000),
            "median_gap_ms": round(median * 1000, 1), "ttft_p50_s": _round(percentile(ttfts, 50)),
            "ttft_p90_s": _round(percentile(ttfts, 90)), "images_with_stream": f"{alongside}/{len(shots)}",
            "burst_s": round(end - start, 2), "stream_end_s": round(times[-1] - start, 2),
            "images_failed": [s.error for s in shots if not s.ok][:3], "stream_error": stream.error,
            "gaps": [(round(t, 3), round(g * 1000, 1)) for t, g in gaps]}


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


def run_server(spec: ServerSpec, model: Path, env: dict[str, str], runs: int, log: Path) -> dict[str, Any]:
    """Start one server, run the scenario ``runs`` times (fresh pictures each time), stop it. A server
    that fails is a row of the table, not the end of the benchmark."""
    port = int(spec.argv[spec.argv.index("--port") + 1])
    try:
        with serving(spec, port, env, log) as (problem, ready_s):
            if problem is not None:
                return {"label": spec.label, "failed": f"server {problem}; see {log}"}
            target = Target(f"http://127.0.0.1:{port}", str(model), spec.extra_body)
            results = [asyncio.run(burst(target, seed)) for seed in range(1, runs + 1)]
    except Exception as exc:  # noqa: BLE001 - a row that says why
        return {"label": spec.label, "failed": f"{type(exc).__name__}: {exc}"[:300]}
    return {"label": spec.label, "ready_s": round(ready_s, 1), "runs": results}


def run_cell(arch: str, dtype: str, args: argparse.Namespace, bar: Any) -> dict[str, Any]:
    """One model in one dtype, every chosen server in turn."""
    from vlmserve.testing import build_model

    model = build_model(arch, "small", ignore_eos=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1")
    if dtype == "float32":
        model, env["LD_PRELOAD"] = float32_copy(model, HERE / "results" / "models"), OPENBLAS
    chosen, load_at_start, servers = specs(model, free_port(), args.vllm_mlx, args.base), os.getloadavg()[0], []
    for name in server_names(args):
        bar.set_postfix_str(f"{arch} {dtype} {chosen[name].label}")
        servers.append(one_server(chosen[name], name, model, env, args, f"{arch}-{dtype}"))
        bar.update()
    return {"arch": arch, "dtype": dtype, "model": str(model), "loadavg_1m_at_start": round(load_at_start, 2),
            "machine": machine(env), "servers": servers}


def one_server(spec: ServerSpec, name: str, model: Path, env: dict[str, str], args: argparse.Namespace,
               prefix: str) -> dict[str, Any]:
    """Run one server; a vlmserve one only once the package it would import is the one meant."""
    if name in ("mlx_vlm", "vllm_mlx"):
        return run_server(spec, model, env, args.runs, args.out / f"{prefix}-{name}.log")
    checkout = HERE.parent if name == "vlmserve" else Path(name.removeprefix("base:")).resolve()
    env = env if name == "vlmserve" else {**env, "PYTHONPATH": str(checkout)}
    imported = which_vlmserve(env)
    if not imported.startswith(str(checkout / "vlmserve") + os.sep):
        return {"label": spec.label, "failed": f"would import vlmserve from {imported or 'nowhere'}, not {checkout}"}
    tag = "vlmserve" if name == "vlmserve" else f"vlmserve-{commit(checkout)}"
    result = run_server(spec, model, env, args.runs, args.out / f"{prefix}-{tag}.log")
    return {**result, "vlmserve_file": imported, "commit": commit(checkout)}


def server_names(args: argparse.Namespace) -> list[str]:
    """``--servers`` in order, ``base`` standing for every ``--base`` checkout."""
    names = []
    for name in args.servers.split(","):
        names += [f"base:{b}" for b in args.base] if name == "base" else [name]
    return names


def render(summary: dict[str, Any]) -> str:
    header = ["model", "server", "stall ratio", "longest gap ms", "median gap ms", "image TTFT p50 s",
              "image TTFT p90 s", "images started while the stream ran"]
    keys = ("stall_ratio", "longest_gap_ms", "median_gap_ms", "ttft_p50_s", "ttft_p90_s", "images_with_stream")
    rows = []
    for cell in summary["cells"]:
        name = f"{cell['arch']} {cell['dtype']}{' + OpenBLAS' if cell['machine']['openblas_preloaded'] else ''}"
        for s in cell["servers"]:
            runs = [r for r in s.get("runs", []) if "failed" not in r]
            failures = [s["failed"]] if "failed" in s else [r["failed"] for r in s.get("runs", []) if "failed" in r]
            cells = [" / ".join(dict.fromkeys(str(r[k]) for r in runs) if k == keys[-1] else (str(r[k]) for r in runs))
                     for k in keys]
            rows.append([name, s["label"], *cells] if runs else [name, s["label"], f"failed: {failures[0][:80]}",
                                                                   *[""] * (len(keys) - 1)])
    return _table(header, rows) + "\nEach cell: one value per run (fresh pictures each run), in order; the last column once if equal.\n"


def heading(summary: dict[str, Any]) -> str:
    m, loads, again = summary["cells"][0]["machine"], load_averages(summary), summary.get("invocations", 1)
    runs = f"{summary['runs']} runs per server" + (f" ({again} invocations, each server started afresh in each)"
                                                   if again > 1 else " (one server process)")
    return (f"{m['date']}, {m['cpus']} CPUs, mlx {m['mlx']} ({m['device']}), small models built with "
            f"`ignore_eos=True`, {runs}, 1-min load average {min(loads)}-{max(loads)} at the cells' starts and "
            f"ends (the servers under test included), {summary['wall_s'] / 60:.1f} minutes in all.\n")


def load_averages(summary: dict[str, Any]) -> list[float]:
    """The 1-minute load averages taken at each cell's start and end."""
    return summary.get("loads") or [x for c in summary["cells"]
                                    for x in (c["loadavg_1m_at_start"], c["machine"]["loadavg_1m_at_end"])]


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    """One panel per model and dtype: each server's gaps in its first run, over time since the images were sent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.6 * rows), dpi=90, squeeze=False)
    for ax, cell in zip(axes.flat, cells):
        firsts = [(s["label"], next((r for r in s.get("runs", []) if "gaps" in r), None)) for s in cell["servers"]]
        for label, run in firsts:
            waited = run is not None and run["images_with_stream"].startswith("0/")
            gaps = run["gaps"] if run else []
            ax.plot([t for t, _ in gaps], [g for _, g in gaps], ".-", ms=3, lw=0.8,
                    label=label + (" (images wait for the stream to end)" if waited else ""))
        # A server that holds the images until the stream ends stretches the axis with a quiet stream.
        alongside = [r["burst_s"] for _, r in firsts if r and not r["images_with_stream"].startswith("0/")]
        if alongside:
            ax.set_xlim(-0.2, 1.3 * max(alongside))
        blas = " + OpenBLAS" if cell["machine"]["openblas_preloaded"] else ""
        ax.set(xlabel="seconds since the images were sent", ylabel="gap between stream chunks, ms", yscale="log",
               title=f"{cell['arch']} {cell['dtype']}{blas}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"A stream's gaps while {IMAGES} fresh {IMAGE_SIZE}px image prompts arrive (run 1)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of the benchmark as one: each server's runs in order, the machine of the first."""
    first = summaries[0]
    cells = [{**c, "servers": [dict(s) for s in c["servers"]]} for c in first["cells"]]
    for other in summaries[1:]:
        for cell, again in zip(cells, other["cells"]):
            assert (cell["arch"], cell["dtype"]) == (again["arch"], again["dtype"]), "merge runs of one grid"
            for server, more in zip(cell["servers"], again["servers"]):
                assert server["label"] == more["label"], "merge runs of the same servers"
                server["runs"] = server.get("runs", []) + more.get("runs", [])
    return {**first, "cells": cells, "runs": sum(s["runs"] for s in summaries),
            "loads": [x for s in summaries for x in load_averages(s)],
            "wall_s": sum(s["wall_s"] for s in summaries), "invocations": len(summaries)}


def write_readme(summary: dict[str, Any], out: Path) -> None:
    """Replace the README's stall_bench block (between its markers) with these results and plot."""
    shutil.copy(out / PLOT, HERE / PLOT)
    block = f"{SECTION[0]}\n{heading(summary)}\n{render(summary)}\n![stall]({PLOT})\n{SECTION[1]}"
    readme = HERE / "README.md"
    body = readme.read_text()
    if SECTION[0] in body:
        before, rest = body.split(SECTION[0], 1)
        body = before + block + rest.split(SECTION[1], 1)[1]
    else:
        body = body.rstrip() + "\n\n## The stall: a stream while image prompts arrive (stall_bench)\n\n" + block + "\n"
    readme.write_text(body)
    print(f"wrote the stall_bench block into {readme}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gemma4,qwen2_5_vl")
    parser.add_argument("--dtype", default="bfloat16,float32", help="float32: a converted copy with OpenBLAS preloaded")
    parser.add_argument("--servers", default="vlmserve,mlx_vlm,vllm_mlx", help="of vlmserve, base, mlx_vlm, vllm_mlx")
    parser.add_argument("--base", type=Path, action="append", default=[], metavar="CHECKOUT",
                        help="a vlmserve checkout served as 'base' (PYTHONPATH); repeatable")
    parser.add_argument("--vllm-mlx", type=Path, default=VLLM_MLX, help="the venv vllm-mlx is installed in")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the first model and dtype only, one run")
    parser.add_argument("--out", type=Path, default=None, help="default results/stall (results/stall-quick)")
    parser.add_argument("--readme", type=Path, nargs="*", default=None, metavar="DIR",
                        help="only write these results (default --out; several: their runs side by side) into "
                             "benchmarks/README.md, with the first one's plot")
    args = parser.parse_args(argv)
    args.out = args.out or HERE / "results" / ("stall-quick" if args.quick else "stall")
    if args.quick:
        args.arch, args.dtype, args.runs = args.arch.split(",")[0], args.dtype.split(",")[0], 1
    if "base" in args.servers.split(",") and not args.base:
        parser.error("--servers base needs --base CHECKOUT")
    if "float32" in args.dtype.split(",") and not Path(OPENBLAS).exists():
        parser.error(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.readme is not None:
        dirs = args.readme or [args.out]
        write_readme(merge([json.loads((d / "stall.json").read_text()) for d in dirs]), dirs[0])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    grid = [(a, d) for a in args.arch.split(",") for d in args.dtype.split(",")]
    started = time.perf_counter()
    with progress(total=len(grid) * len(server_names(args)), desc="stall_bench", unit="server", file=sys.stderr) as bar:
        cells = [run_cell(arch, dtype, args, bar) for arch, dtype in grid]
    summary = {"cells": cells, "runs": args.runs, "wall_s": round(time.perf_counter() - started, 1),
               "finished": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:]}
    (args.out / "stall.json").write_text(json.dumps(summary, indent=1))
    (args.out / "stall.md").write_text(heading(summary) + "\n" + render(summary))
    plot(cells, args.out / PLOT)
    print(heading(summary) + "\n" + render(summary))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
