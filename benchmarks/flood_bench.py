"""[main] /health under a flood (issue 46): does the event loop stay light while 300 requests arrive at once?

    python benchmarks/flood_bench.py [--runs 3] [--requests 300] [--max-tokens 24] [--interval 0.025]
        [--probe process|loop] [--loop-lag] [--arch gemma4] [--size micro] [--base CHECKOUT ...] [--only-bases]
        [--out DIR]

Starts ``vlmserve serve`` on a small offline model (``--max-queue`` = the flood, so every request is
admitted), sends one streamed request to warm it, then fires ``--requests`` streamed chat completions at
once (``max_tokens`` 24 each, a short text prompt) and reads every stream to its end. Meanwhile
``/health`` and ``/ready`` are probed in turn every ``--interval`` seconds on one kept-alive connection:
by default from a process of its own, which times the server; with ``--probe loop`` from the flood
client's event loop, as tests/test_ops_server.py does, which also times that client reading 300 streams.
Reported per path, over the probes sent from the flood's first request until its last stream ended: the
probe count, p50/p90/p99/max latency (ms), and the flood's seconds; each probe is kept in the JSON.

Each run starts every server afresh, in turn (this checkout, then each ``--base``), so a neighbour's
load drifts across servers alike. ``--base CHECKOUT`` (repeatable) serves another vlmserve checkout,
e.g. a ``git worktree`` of an earlier commit, with the same Python (``PYTHONPATH``; stall_bench.py does
the same), labelled by its folder and commit (``+``: files changed since); ``--only-bases`` leaves this
checkout out. Writes ``flood.json`` and ``flood.md`` to DIR (default results/flood) and prints the
table; the 1-minute load average is recorded before and after each flood.

``--loop-lag`` says where a slow probe's time went: the server times each pass of its event loop
(benchmarks/loop_lag/sitecustomize.py), in wall time and in the loop thread's CPU time, and each run
reports the passes over 20 ms during the flood, how many of them the loop spent that long working
(CPU), and the loop's CPU seconds in all. Slow in wall time but not in CPU: the loop was runnable and
waited for a core (or the GIL), so answering probes elsewhere in the same process would wait too.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import itertools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from compare import ServerSpec, free_port, serving
from loadgen import percentile
from report import _table
from stall_bench import commit, which_vlmserve

HERE = Path(__file__).resolve().parent
PATHS = ("/health", "/ready")


def probe(url: str, interval: float, started: Any, stop: Any, out: Any) -> None:
    """``--probe process``, in a process of its own: ``/health`` and ``/ready`` in turn until ``stop`` is
    set, each as ``(path, sent at (time.monotonic, one clock for every process), seconds, status)``."""
    samples = []
    gc.collect()
    gc.disable()  # a full collection of this process's imports paused it for 100-200 ms, every ~400 probes
    with httpx.Client(timeout=30) as client:
        for i in itertools.count():
            if stop.is_set():
                break
            if i == 2:
                started.set()
            path = PATHS[i % len(PATHS)]
            sent = time.monotonic()
            status = client.get(url + path).status_code
            samples.append((path, sent, time.monotonic() - sent, status))
            time.sleep(max(0.0, interval - (time.monotonic() - sent)))
    out.send(samples)


async def probe_here(url: str, interval: float, until: asyncio.Future[Any]) -> list[tuple[str, float, float, int]]:
    """``--probe loop``: the same probes from the flood's own event loop, as the test does; they time the
    client's parsing of the streams too."""
    samples = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in itertools.count():
            if until.done():
                break
            path = PATHS[i % len(PATHS)]
            sent = time.monotonic()
            status = (await client.get(url + path)).status_code
            samples.append((path, sent, time.monotonic() - sent, status))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - sent)))
    return samples


async def flood(url: str, model: str, args: argparse.Namespace) -> tuple[float, float, list[int], list[Any]]:
    """``--requests`` streamed chats at once, each read to its end: (start, end) on time.monotonic, the
    statuses, and the probes sent from this loop (``--probe loop``)."""
    limits = httpx.Limits(max_connections=args.requests + 8, max_keepalive_connections=args.requests + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def one(i: int) -> int:
            body = {"model": model, "max_tokens": args.max_tokens, "stream": True,
                    "messages": [{"role": "user", "content": f"story {i}"}]}
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
                async for _ in reply.aiter_bytes():
                    pass
                return reply.status_code

        await one(-1)  # the client's own first-call costs, and the server's, before the clock starts
        start = time.monotonic()
        requests = asyncio.gather(*(one(i) for i in range(args.requests)))
        samples = await probe_here(url, args.interval, requests) if args.probe == "loop" else []
        statuses = await requests
        return start, time.monotonic(), list(statuses), samples


def one_flood(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """A flood with its probes; those sent during it, summarised per path."""
    context = multiprocessing.get_context("spawn")
    started, stop, (receive, send) = context.Event(), context.Event(), context.Pipe(duplex=False)
    prober = context.Process(target=probe, args=(url, args.interval, started, stop, send), daemon=True)
    if args.probe == "process":
        prober.start()
        if not started.wait(60):  # its imports and its connection, before the flood
            raise RuntimeError("the probe process did not start")
    load_before = os.getloadavg()[0]
    start, end, statuses, samples = asyncio.run(flood(url, model, args))
    if args.probe == "process":
        stop.set()
        samples = receive.recv()
        prober.join(10)
    during = [s for s in samples if start <= s[1] <= end]
    result: dict[str, Any] = {"flood_s": round(end - start, 2), "start_monotonic": round(start, 3),
                              "ok": statuses.count(200), "requests": len(statuses),
                              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    for path in PATHS:
        ms = [s[2] * 1000 for s in during if s[0] == path]
        bad = sum(1 for s in during if s[0] == path and s[3] != 200)
        result[path] = {"probes": len(ms), "non_200": bad, **{f"p{q}_ms": _ms(percentile(ms, q)) for q in (50, 90, 99)},
                        "max_ms": _ms(max(ms, default=None))}
    result["probes"] = [(s[0], round(s[1] - start, 3), _ms(s[2] * 1000)) for s in during]  # (path, s into it, ms)
    return result


def _ms(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def specs(model: Path, port: int, requests: int, bases: list[Path], only_bases: bool) -> dict[str, ServerSpec]:
    """This checkout's server (unless ``only_bases``) and each base's, by name; every one admits the whole flood."""
    # -P: ``python -m`` would put the working directory (this checkout) ahead of PYTHONPATH.
    argv = [sys.executable, "-P", "-m", "vlmserve.cli", "serve", "--model", str(model), "--port", str(port),
            "--max-queue", str(requests)]
    vlmserve = ServerSpec("vlmserve", argv, "/ready", {})
    out = {} if only_bases else {"vlmserve": replace(vlmserve, label=label(HERE.parent))}
    for base in bases:
        out[f"base:{base}"] = replace(vlmserve, label=label(base))
    return out


def label(checkout: Path) -> str:
    """The checkout's folder and commit, ``+`` when its files differ from the commit."""
    changed = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True).stdout.strip()
    return f"{checkout.resolve().name} {commit(checkout)}{'+' if changed else ''}"


def run_server(name: str, spec: ServerSpec, model: Path, args: argparse.Namespace, run: int) -> dict[str, Any]:
    """One server started afresh for one flood; a failure is a row, not the end of the benchmark."""
    checkout = HERE.parent if name == "vlmserve" else Path(name.removeprefix("base:")).resolve()
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1", PYTHONPATH=str(checkout))
    imported = which_vlmserve(env)
    lag = args.out / f"loop-lag-{name.replace('/', '_')}-run{run}.json"
    if args.loop_lag:  # after the check: the timer is imported at start-up, from the folder put first
        env.update(PYTHONPATH=f"{HERE / 'loop_lag'}{os.pathsep}{checkout}", VLMSERVE_LOOP_LAG=str(lag))
    if not imported.startswith(str(checkout / "vlmserve") + os.sep):
        return {"failed": f"would import vlmserve from {imported or 'nowhere'}, not {checkout}"}
    port = int(spec.argv[spec.argv.index("--port") + 1])
    log = args.out / f"{spec.label.replace(' ', '-')}-run{run}.log"
    try:
        with serving(spec, port, env, log) as (problem, _):
            if problem is not None:
                return {"failed": f"server {problem}; see {log}"}
            result = one_flood(f"http://127.0.0.1:{port}", str(model), args)
    except Exception as exc:  # noqa: BLE001 - a row that says why
        return {"failed": f"{type(exc).__name__}: {exc}"[:300]}
    if args.loop_lag:  # the server wrote it on its way out
        result["loop"] = loop_passes(json.loads(lag.read_text()), result)
    return result


def loop_passes(passes: list[list[float]], flood: dict[str, Any]) -> dict[str, Any]:
    """The event loop's passes during the flood (perf_counter and monotonic are one clock here): those over
    20 ms in wall time, how many of them worked that long (CPU), the longest of each, and the CPU in all."""
    start = flood["start_monotonic"]
    during = [p for p in passes if start <= p[0] <= start + flood["flood_s"]]
    slow = [p for p in during if p[1] > 20]
    return {"passes_over_20ms": len(slow), "cpu_over_20ms": sum(p[2] > 20 for p in slow),
            "max_wall_ms": max((p[1] for p in during), default=0), "max_cpu_ms": max((p[2] for p in during), default=0),
            "cpu_s": round(sum(p[2] for p in during) / 1000, 2)}


def render(summary: dict[str, Any]) -> str:
    """One row per server and path: each run's numbers in order, then their median."""
    header = ["server", "path", "probes", "p50 ms", "p90 ms", "p99 ms", "max ms", "flood s", "median p99 ms"]
    rows = []
    for server in summary["servers"]:
        runs = [r for r in server["runs"] if "failed" not in r]
        if not runs:
            rows.append([server["label"], "", f"failed: {server['runs'][0]['failed'][:80]}", *[""] * 6])
            continue
        for path in PATHS:
            keys = ("probes", "p50_ms", "p90_ms", "p99_ms", "max_ms")
            cells = [" / ".join(str(r[path][k]) for r in runs) for k in keys]
            p99 = statistics.median(r[path]["p99_ms"] for r in runs if r[path]["p99_ms"] is not None)
            rows.append([server["label"], path, *cells, " / ".join(str(r["flood_s"]) for r in runs), f"{p99:.1f}"])
    return _table(header, rows) + "\nEach cell: one value per run, in order.\n" + _loop_lines(summary)


def _loop_lines(summary: dict[str, Any]) -> str:
    lines = [f"- {server['label']} run {i}, the loop during the flood: {r['loop']}"
             for server in summary["servers"] for i, r in enumerate(server["runs"], 1) if "loop" in r]
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def heading(summary: dict[str, Any]) -> str:
    loads = [x for s in summary["servers"] for r in s["runs"] if "loadavg_1m" in r for x in r["loadavg_1m"]]
    load = f"{min(loads)}-{max(loads)}" if loads else "?"
    return (f"{summary['date']}, {summary['cpus']} CPUs, {summary['model']}, {summary['requests']} streamed requests "
            f"at once (max_tokens {summary['max_tokens']}), a probe every {summary['interval'] * 1000:.0f} ms "
            f"from {'a process of its own' if summary['probe'] == 'process' else 'the flood client loop'}, "
            f"{summary['runs']} runs, 1-min load average {load} around the floods (the servers included).\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gemma4")
    parser.add_argument("--size", default="micro")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--interval", type=float, default=0.025, help="seconds from one probe's start to the next")
    parser.add_argument("--probe", choices=["process", "loop"], default="process",
                        help="probe from a process of its own, or from the flood's event loop (as the test does)")
    parser.add_argument("--loop-lag", action="store_true",
                        help="time the server's event-loop passes (wall and CPU) to say where slow probes waited")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--base", type=Path, action="append", default=[], metavar="CHECKOUT",
                        help="another vlmserve checkout to flood in turn (PYTHONPATH); repeatable")
    parser.add_argument("--only-bases", action="store_true", help="flood the --base checkouts, not this one")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "flood")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from vlmserve.testing import build_model

    model = build_model(args.arch, args.size)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = specs(model, free_port(), args.requests, args.base, args.only_bases)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for run in range(1, args.runs + 1):
        for name, spec in chosen.items():
            result = run_server(name, spec, model, args, run)
            runs[name].append(result)
            print(f"run {run} {spec.label}: {json.dumps({k: v for k, v in result.items() if k != 'probes'})}",
                  file=sys.stderr)
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
               "model": model.name, "requests": args.requests, "max_tokens": args.max_tokens,
               "interval": args.interval, "probe": args.probe, "runs": args.runs, "argv": sys.argv[1:],
               "servers": [{"label": spec.label, "runs": runs[name]} for name, spec in chosen.items()]}
    (args.out / "flood.json").write_text(json.dumps(summary, indent=1))
    (args.out / "flood.md").write_text(heading(summary) + "\n" + render(summary))
    print(heading(summary) + "\n" + render(summary))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
