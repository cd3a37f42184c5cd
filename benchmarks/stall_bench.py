"""[main] The stall (issues 30 and 46): does a running stream freeze when fresh image prompts arrive, and
what does each server give at c=8 under mixed traffic?

vlmserve, mlx_vlm.server and vllm-mlx, one at a time, on the same models.

    python benchmarks/stall_bench.py [--arch gemma4,qwen2_5_vl,smolvlm_real] [--dtype bfloat16] [--runs 2]
        [--servers vlmserve,base,mlx_vlm,vllm_mlx] [--base CHECKOUT ...] [--max-batch N] [--quick] [--out DIR]
    python benchmarks/stall_bench.py --readme [DIR ...]     # results (their runs side by side) into the README

The default grid is issue 46's: the small gemma4 and qwen2_5_vl in bfloat16, and ``smolvlm_real``, the
real-weights SmolVLM of ``real_weights.py`` (SmolLM2-135M's text tower, 163 M parameters), always float32 on
the stock wheel (no OpenBLAS, no copy; ``--dtype`` does not apply to it). ``--dtype float32`` on a small model
serves a float32 copy with OpenBLAS preloaded (shared/FACTS.md), as before.

Every answer runs to its ``max_tokens`` on every server, without a request parameter (mlx_vlm.server and
vllm-mlx have no ``ignore_eos``): the small models are built with ``ignore_eos=True``, and the real model is
served as ``real_weights.ignore_eos_copy``, which zeroes every special token's ``lm_head`` row as
``ignore_eos=True`` does (logit 0, under the real vocabulary's best). vlmserve also gets ``ignore_eos``.

Each server process, after warm-up (a 224 px image request and a text one, then serve_bench's own), first
runs serve_bench's **mixed** scenario once per run (compare.py's "mixed" rows: 8 requests at once, text and
96 px image prompts, short and long, 48 tokens each; output tok/s and TTFT over the 8), then the stall
scenario once per run. The mixed runs go first so that no stream cancelled by a stall run can still be
decoding in them.

The stall: one text stream decodes (2000 tokens asked). Once it streams steadily, 8 image prompts arrive at
once, each with a 224x224 picture no server has seen (no cache can skip the vision tower), 48 output tokens
each. The stream is closed when the last of them ends. Measured:
- the **stall ratio**: the stream's longest gap between chunks over its median gap, both over the gaps
  that end during the burst (from when the images were sent until the last one ended): a bigger batch
  makes every step longer; one step far longer than the others is a freeze;
- per token: the stream asks for logprobs, so a token that completes no character (a byte token) is a chunk too;
- the longest gap, the image prompts' TTFT p50, p90 and max, the last image's whole answer (``last_done_s``:
  when the last of them ended), and how many of them got their first token
  while the stream still ran (a server that holds them until the stream ends never freezes it);
- vlmserve's own ``/metrics`` series (``vlmserve_*``, histograms as sum and count) after each burst.
vllm-mlx runs from its own venv (``--vllm-mlx``; ``pip install vllm-mlx==0.6.0 "mlx[cpu]"``). ``--base
CHECKOUT`` (repeatable; ``base`` in ``--servers``) serves another vlmserve checkout, e.g. a ``git worktree``
of an earlier commit, with the same Python (``PYTHONPATH``), labelled by its commit.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from compare import OPENBLAS, ServerSpec, float32_copy, free_port, machine, server_specs, serving
from loadgen import (
    RequestResult,
    Target,
    messages,
    percentile,
    prompt_text,
    run_closed_loop,
    stream_chat,
    synthetic_images,
)
from serve_bench import Bench, BenchConfig
from stall_report import PLOT, REAL, heading, merge, plot, render, write_readme

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
IMAGES, IMAGE_TOKENS, IMAGE_SIZE = 8, 48, 224
STREAM_TOKENS = 2000  # outlasts every burst here many times over; vllm-mlx holds the images until it ends
STEADY_CHUNKS = 12  # the stream's chunks before the images are sent
# One request's and one mixed run's limit: vllm-mlx's images wait for the whole stream, 2000 tokens of the
# real model at a few tok/s on a busy machine, whose c=8 mixed run takes minutes (serve_bench's limits: 2 and 5).
TIMEOUT_S = 1500
VLLM_MLX = HERE / "results" / "venvs" / "vllm-mlx"


def specs(model: Path, port: int, vllm_mlx: Path, bases: list[Path], max_batch: int) -> dict[str, ServerSpec]:
    """Every server this run may start, by name; a base checkout's name is ``base:PATH``."""
    vlmserve, mlx_vlm = server_specs(model, port, max(max_batch, 1))
    if max_batch <= 0:  # each server's own default: vlmserve's (a checkout's own), mlx_vlm.server's unbounded
        vlmserve, mlx_vlm = _without(vlmserve, "--max-batch-size"), _without(mlx_vlm, "--max-num-seqs")
    # -P: ``python -m`` would put the working directory (this checkout) ahead of PYTHONPATH.
    vlmserve = replace(vlmserve, argv=[vlmserve.argv[0], "-P", *vlmserve.argv[1:]])
    out = {"vlmserve": vlmserve, "mlx_vlm": replace(mlx_vlm, label="mlx_vlm.server"),
           "vllm_mlx": ServerSpec("vllm-mlx", [str(vllm_mlx / "bin" / "vllm-mlx"), "serve", str(model), "--mllm",
                                               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)],
                                  "/v1/models", {})}
    for base in bases:
        out[f"base:{base}"] = replace(vlmserve, label=f"vlmserve {commit(base)}")
    return out


def _without(spec: ServerSpec, flag: str) -> ServerSpec:
    """``spec`` without ``flag`` and its value."""
    i = spec.argv.index(flag)
    return replace(spec, argv=[*spec.argv[:i], *spec.argv[i + 2:]])


def commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or checkout.name


def which_vlmserve(env: dict[str, str]) -> str:
    """The vlmserve package a server started with ``env`` imports (checked, not assumed)."""
    argv = [sys.executable, "-P", "-c", "import vlmserve; print(vlmserve.__file__)"]
    return subprocess.run(argv, env=env, cwd=HERE.parent, capture_output=True, text=True).stdout.strip()


class MixedBench(Bench):
    """serve_bench's scenarios, each bounded by ``TIMEOUT_S``."""

    async def batch(self, factories: list[Any], concurrency: int) -> tuple[list[RequestResult], float]:
        return await asyncio.wait_for(run_closed_loop(factories, concurrency), TIMEOUT_S)


async def scenarios(target: Target, runs: int, metrics: bool) -> list[dict[str, Any]]:
    """Against one ready server: warm-up, ``runs`` mixed-traffic runs, then ``runs`` stall runs (fresh
    pictures each); run i's record is the stall's measures with the i-th mixed run under ``mixed``."""
    limits = httpx.Limits(max_connections=IMAGES + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, connect=10.0), limits=limits) as client:
        await _warm(client, target, seed=0)
        # One Bench for every mixed run: its counter gives each request its own prompt and picture.
        bench = MixedBench(target, BenchConfig(), client, SimpleNamespace())  # type: ignore[arg-type]  # no bar
        await bench.warmup()
        mixed = [await _guarded(bench.mixed()) for _ in range(runs)]
        out = []
        for seed, traffic in zip(range(1, runs + 1), mixed, strict=True):
            run = {**await burst(client, target, seed), "mixed": traffic}
            if metrics:
                run["metrics"] = await _guarded(metrics_snapshot(client, target))
            out.append(run)
    return out


async def _guarded(scenario: Any) -> Any:
    try:
        return await scenario
    except Exception as exc:  # noqa: BLE001 - a failed scenario is recorded, the others still run
        return {"failed": f"{type(exc).__name__}: {exc}"[:300]}


async def burst(client: httpx.AsyncClient, target: Target, seed: int) -> dict[str, Any]:
    """The stall scenario: a stream, then fresh image prompts at once."""
    await _warm(client, target, seed)
    stream = RequestResult()
    # logprobs: every token is a chunk, also one that completes no character (a byte token), so the gaps are
    # per token (a server that ignores the field sends what it sends)
    per_token = replace(target, extra_body={**target.extra_body, "logprobs": True})
    task = asyncio.create_task(stream_chat(client, per_token, messages(prompt_text(12, seed)), STREAM_TOKENS,
                                           "stream", result=stream))
    while len(stream.chunk_times) < STEADY_CHUNKS and not task.done():
        await asyncio.sleep(0.01)
    urls = synthetic_images(IMAGES, size=IMAGE_SIZE, seed=seed * 1000 + 7)
    shots = await asyncio.gather(*(stream_chat(client, target, messages(prompt_text(12, i), url), IMAGE_TOKENS, "image")
                                 for i, url in enumerate(urls)))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return measure(stream, list(shots))


async def _warm(client: httpx.AsyncClient, target: Target, seed: int) -> None:
    """One image and one text request first, so that nobody's first-call costs land in the burst."""
    url = synthetic_images(1, size=IMAGE_SIZE, seed=seed * 1000 + 999)[0]
    for msgs in (messages("Warm up.", url), messages("Warm up.")):
        result = await stream_chat(client, target, msgs, 4, "warm-up")
        if not result.ok:
            raise RuntimeError(f"warm-up failed: {result.error}")


async def metrics_snapshot(client: httpx.AsyncClient, target: Target) -> dict[str, float]:
    """vlmserve's own series from ``/metrics``: counters, gauges, and each histogram's sum and count; the
    ``model`` label dropped (one model per server)."""
    response = await client.get(f"{target.base_url}/metrics", timeout=10.0)
    response.raise_for_status()
    out = {}
    for line in response.text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("vlmserve_") and not any(s in name for s in ("_bucket{", "_created{", "_created ")):
            out[re.sub(r'model="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return out


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
            "ttft_p90_s": _round(percentile(ttfts, 90)), "ttft_max_s": _round(max(ttfts, default=None)),
            "images_with_stream": f"{alongside}/{len(shots)}",
            "images_short": sum(s.ok and s.completion_tokens < IMAGE_TOKENS for s in shots),  # ended before max_tokens
            "burst_s": round(end - start, 2), "last_done_s": round(end - start, 2),
            "last_first_s": _round(max(ttfts, default=None)), "stream_end_s": round(times[-1] - start, 2),
            "images_failed": [s.error for s in shots if not s.ok][:3], "stream_error": stream.error,
            "gaps": [(round(t, 3), round(g * 1000, 1)) for t, g in gaps]}


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


def run_server(spec: ServerSpec, model: Path, env: dict[str, str], runs: int, log: Path) -> dict[str, Any]:
    """Start one server, run the scenarios ``runs`` times each, stop it. A server that fails is a row
    of the table, not the end of the benchmark."""
    port = int(spec.argv[spec.argv.index("--port") + 1])
    try:
        with serving(spec, port, env, log) as (problem, ready_s):
            if problem is not None:
                return {"label": spec.label, "failed": f"server {problem}; see {log}"}
            target = Target(f"http://127.0.0.1:{port}", str(model), spec.extra_body, TIMEOUT_S)
            results = asyncio.run(scenarios(target, runs, metrics=spec.label.startswith("vlmserve")))
    except Exception as exc:  # noqa: BLE001 - a row that says why
        return {"label": spec.label, "failed": f"{type(exc).__name__}: {exc}"[:300]}
    return {"label": spec.label, "ready_s": round(ready_s, 1), "runs": results}


def grid(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(arch, dtype) cells in order; the real-weights SmolVLM once, in float32."""
    dtypes = args.dtype.split(",")
    return [(a, d) for a in args.arch.split(",") for d in (["float32"] if a == REAL else dtypes)]


def cell_model(arch: str, dtype: str, env: dict[str, str]) -> Path:
    """The model a cell serves, every answer running to max_tokens; ``env`` gets OpenBLAS where it is used."""
    if arch == REAL:  # float32 as built, the stock wheel's BLAS
        from real_weights import build_smolvlm_smollm2, ignore_eos_copy

        return ignore_eos_copy(build_smolvlm_smollm2())
    from vlmserve.testing import build_model

    model = build_model(arch, "small", ignore_eos=True)
    if dtype == "float32":
        model, env["LD_PRELOAD"] = float32_copy(model, HERE / "results" / "models"), OPENBLAS
    return model


def run_cell(arch: str, dtype: str, args: argparse.Namespace, bar: Any) -> dict[str, Any]:
    """One model in one dtype, every chosen server in turn."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1")
    model = cell_model(arch, dtype, env)
    chosen = specs(model, free_port(), args.vllm_mlx, args.base, args.max_batch)
    load_at_start, servers = os.getloadavg()[0], []
    for name in server_names(args):
        bar.set_postfix_str(f"{arch} {dtype} {chosen[name].label}")
        servers.append(one_server(chosen[name], name, model, env, args, f"{arch}-{dtype}"))
        bar.update()
    return {"arch": arch, "dtype": dtype, "model": str(model), "loadavg_1m_at_start": round(load_at_start, 2),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "max_batch": args.max_batch,
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=f"gemma4,qwen2_5_vl,{REAL}",
                        help=f"small models vlmserve.testing builds, and {REAL} (the real-weights SmolVLM)")
    parser.add_argument("--dtype", default="bfloat16", help="for the small models, e.g. bfloat16,float32 (float32: a "
                                                          f"converted copy with OpenBLAS preloaded); {REAL}: float32")
    parser.add_argument("--servers", default="vlmserve,mlx_vlm,vllm_mlx", help="of vlmserve, base, mlx_vlm, vllm_mlx")
    parser.add_argument("--base", type=Path, action="append", default=[], metavar="CHECKOUT",
                        help="a vlmserve checkout served as 'base' (PYTHONPATH); repeatable")
    parser.add_argument("--vllm-mlx", type=Path, default=VLLM_MLX, help="the venv vllm-mlx is installed in")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=0,
                        help="every server's batch cap; 0 (default): each its own (vlmserve's "
                             f"{EngineConfig().max_batch_size} below its KV budget, a --base checkout's own, "
                             "mlx_vlm.server's unbounded)")
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
    if any(a != REAL and d == "float32" for a, d in grid(args)) and not Path(OPENBLAS).exists():
        parser.error(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.readme is not None:
        dirs = args.readme or [args.out]
        write_readme(merge([json.loads((d / "stall.json").read_text()) for d in dirs]), dirs[0])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    cells_to_run = grid(args)
    started = time.perf_counter()
    with progress(total=len(cells_to_run) * len(server_names(args)), desc="stall_bench", unit="server",
                  file=sys.stderr) as bar:
        cells = [run_cell(arch, dtype, args, bar) for arch, dtype in cells_to_run]
    summary = {"cells": cells, "runs": args.runs, "wall_s": round(time.perf_counter() - started, 1),
               "finished": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:]}
    (args.out / "stall.json").write_text(json.dumps(summary, indent=1))
    (args.out / "stall.md").write_text(heading(summary) + "\n" + render(summary))
    plot(cells, args.out / PLOT, IMAGES, IMAGE_SIZE)
    print(heading(summary) + "\n" + render(summary))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
