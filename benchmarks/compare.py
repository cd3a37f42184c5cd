"""[main] vlmserve side by side with ``python -m mlx_vlm.server`` on the same offline model, plus the raw step.

    python benchmarks/compare.py [--arch gemma4,qwen2_5_vl] [--quick] [--openblas --dtype float32] [--out DIR]
    python benchmarks/compare.py --readme DIR [DIR ...]     # their results into benchmarks/README.md

Builds the small model with ignore_eos=True (every request runs to max_tokens on both servers),
starts each server in turn with the same batch cap, waits until it is ready, runs every
serve_bench scenario against it, stops it by PID, then runs step_bench in a fresh process.
Prints and writes the side-by-side tables (ratios vlmserve / mlx_vlm), the engine's
efficiency against the raw step, and each target with its measured value.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import report
import step_bench
import targets
from loadgen import Target
from serve_bench import BenchConfig, run_all, vars_of

HERE = Path(__file__).resolve().parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0


@dataclass(slots=True, frozen=True)
class ServerSpec:
    """How to start one server, where it says it is ready, and what its requests may carry."""

    label: str
    argv: list[str]
    ready_path: str
    extra_body: dict[str, Any]


def server_specs(model: Path, port: int, max_batch: int) -> list[ServerSpec]:
    py = sys.executable
    return [
        # --dtype model: both servers run the weights on disk (the float32 run gets a float32 copy).
        ServerSpec("vlmserve", [py, "-m", "vlmserve.cli", "serve", "--model", str(model), "--port", str(port),
                                "--max-batch-size", str(max_batch), "--dtype", "model"], "/ready", {"ignore_eos": True}),
        # mlx_vlm.server has no ignore_eos; the ignore_eos-built model makes its outputs full length too.
        ServerSpec("mlx_vlm", [py, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1",
                               "--port", str(port), "--max-num-seqs", str(max_batch), "--log-level", "WARNING"],
                   "/health", {}),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = READY_TIMEOUT_S) -> str | None:
    """None once ``url`` answers 200; else why not (the process exited, or the time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with status {proc.returncode} before it was ready"
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return f"not ready after {timeout:.0f} s"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited in time; only this PID."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def serving(spec: ServerSpec, port: int, env: dict[str, str], log_path: Path) -> Iterator[tuple[str | None, float]]:
    """Run ``spec``'s server (output to ``log_path``) for the block: yields why it is not ready (None
    when it is) and the seconds it took; stops it (this PID only) on the way out."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
        try:
            started = time.perf_counter()
            problem = wait_ready(proc, f"http://127.0.0.1:{port}{spec.ready_path}")
            yield problem, time.perf_counter() - started
        finally:
            stop(proc)


def bench_server(spec: ServerSpec, model: Path, port: int, config: BenchConfig, env: dict[str, str],
                 log_path: Path) -> dict[str, Any]:
    with serving(spec, port, env, log_path) as (problem, ready_s):
        if problem is not None:
            return _failed(spec, config, f"server {problem}; see {log_path}", log_path)
        target = Target(f"http://127.0.0.1:{port}", str(model), spec.extra_body)
        result = asyncio.run(run_all(target, config, spec.label))
        result["ready_s"] = round(ready_s, 1)
        return result


def _failed(spec: ServerSpec, config: BenchConfig, message: str, log_path: Path) -> dict[str, Any]:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
    return {"label": spec.label, "failed": message, "log_tail": tail, "config": vars_of(config), "scenarios": {}}


def run_step_bench(model: Path, quick: bool, max_tokens: int, env: dict[str, str], path: Path) -> dict[str, Any] | None:
    argv = [sys.executable, str(HERE / "step_bench.py"), "--model", str(model), "--json", str(path),
            "--max-tokens", str(max_tokens)]
    done = subprocess.run(argv + (["--quick"] if quick else []), env=env, cwd=HERE, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        print(f"step_bench failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def fastest(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per batch size, the run with the shorter step; the shorter prefills."""
    if a is None or b is None:
        return a or b
    out = {**a, "decode": {}}
    for batch in a["decode"]:
        first, second = a["decode"][batch], b["decode"][batch]
        out["decode"][batch] = first if first["ms_per_step"] <= second["ms_per_step"] else second
    for key in ("prefill_ms_image_prompt", "prefill_ms_long_text", "preprocess_ms_image_prompt"):
        out[key] = min(a[key], b[key])
    for batch, row in out["decode"].items():
        row["workload_tok_s"] = step_bench.workload_tok_s(out["prefill_ms_image_prompt"], row["ms_per_step"], int(batch),
                                                          out["workload_max_tokens"])
    return out


def float32_copy(model: Path, root: Path) -> Path:
    """The same model with float32 weights (OpenBLAS speeds up float32 matmuls, not bf16 ones)."""
    import mlx.core as mx

    dest = root / f"{model.name}-float32"
    if not (dest / "model.safetensors").exists():
        tmp = root / f".{dest.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
        weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in mx.load(str(model / "model.safetensors")).items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def machine(env: dict[str, str]) -> dict[str, Any]:
    import mlx.core as mx

    return {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "mlx": mx.__version__, "device": str(mx.default_device()),
            "openblas_preloaded": OPENBLAS in env.get("LD_PRELOAD", ""),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gemma4,qwen2_5_vl", help="families vlmserve.testing builds, comma-separated")
    parser.add_argument("--size", default="small")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-batch", type=int, default=8, help="both servers' batch cap")
    parser.add_argument("--openblas", action="store_true", help=f"LD_PRELOAD {OPENBLAS} into servers and step_bench")
    parser.add_argument("--servers", default="vlmserve,mlx_vlm", help="which, in this order")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="float32: a converted copy")
    parser.add_argument("--out", type=Path, default=None, help="results root (default benchmarks/results)")
    parser.add_argument("--rerender", action="store_true", help="only redo tables and plots from the results")
    parser.add_argument("--readme", type=Path, nargs="+", default=None, metavar="DIR",
                        help="write these runs' results into benchmarks/README.md instead of running")
    args = parser.parse_args(argv)
    if args.readme:
        return write_readme(args.readme)
    # Without --openblas, vlmserve must not restart itself under an installed OpenBLAS either.
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1")
    if args.openblas:
        if not Path(OPENBLAS).exists():
            return _usage(f"{OPENBLAS} is missing (apt-get install libopenblas0-pthread)")
        env["LD_PRELOAD"] = OPENBLAS
    for arch in args.arch.split(","):
        name = f"compare-{arch}{'-openblas' if args.openblas else ''}{'-f32' if args.dtype == 'float32' else ''}"
        name += "-quick" if args.quick else ""
        out = (args.out or HERE / "results").resolve() / name  # step_bench runs with cwd=benchmarks/
        out.mkdir(parents=True, exist_ok=True)
        if args.rerender:
            summary = json.loads((out / "compare.json").read_text())
            summary["targets"] = targets.evaluate(summary["servers"], summary["step"])
        else:
            summary = run_compare(arch, args, env, out)
        (out / "compare.json").write_text(json.dumps(summary, indent=1))
        text = render(summary)
        (out / "compare.md").write_text(text)
        report.plots([r for r in summary["servers"] if r["scenarios"]], out, prefix="compare", step=summary["step"])
        print(text)
        print(f"results in {out}")
    return 0


def run_compare(arch: str, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict[str, Any]:
    """Each server in the order given, then the raw step; the summary compare.json holds."""
    from vlmserve.testing import build_model

    model = build_model(arch, args.size, ignore_eos=True)
    if args.dtype == "float32":
        model = float32_copy(model, HERE / "results" / "models")
    config = BenchConfig.quick() if args.quick else BenchConfig()
    config = BenchConfig(**{**vars_of(config), "slots": args.max_batch})
    load_before = round(os.getloadavg()[0], 2)  # another job on the machine shows here
    specs = {spec.label: spec for spec in server_specs(model, free_port(), args.max_batch)}
    # The raw step before and after the servers, the faster of the two per batch size: a raw
    # limit measured while something else ran on the machine would flatter the servers.
    before = run_step_bench(model, args.quick, config.max_tokens, env, out / "step_bench_before.json")
    results = []
    for label in args.servers.split(","):
        spec = specs[label]
        port = int(spec.argv[spec.argv.index("--port") + 1])
        results.append(bench_server(spec, model, port, config, env, out / f"{label}.log"))
    after = run_step_bench(model, args.quick, config.max_tokens, env, out / "step_bench_after.json")
    step = fastest(before, after)
    return {"machine": {**machine(env), "loadavg_1m_at_start": load_before}, "arch": arch, "size": args.size,
            "dtype": args.dtype, "model": str(model), "servers": results, "step": step,
            "targets": targets.evaluate(results, step)}


def render(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    head = (f"## {summary['arch']}/{summary['size']} {summary['dtype']} - {m['date']}, {m['cpus']} CPUs, "
            f"mlx {m['mlx']} ({m['device']}), OpenBLAS preloaded: {'yes' if m['openblas_preloaded'] else 'no'}, "
            f"1-min load average {m['loadavg_1m_at_start']} at start\n\n")
    ran = [r for r in summary["servers"] if r["scenarios"]]
    failed = "".join(f"**{r['label']} failed**: {r['failed']}\n\n```\n" + "\n".join(r["log_tail"]) + "\n```\n\n"
                     for r in summary["servers"] if not r["scenarios"])
    step = summary["step"]
    step_md = ("### Raw step (step_bench)\n\n" + step_bench.markdown(step) + "\n") if step else ""
    return head + failed + (report.markdown(ran, step) if ran else "") + "\n" + step_md + targets.markdown(summary["targets"])


README_SECTION = "## Latest results"


def write_readme(dirs: list[Path]) -> int:
    """Replace the README's "Latest results" section (up to the next ``## `` heading; the sections of
    other benchmarks stay) by these runs: each one's tables, targets and throughput plot."""
    readme = HERE / "README.md"
    text = readme.read_text()
    if README_SECTION in text:
        start = text.index(README_SECTION)
        end = text.find("\n## ", start + len(README_SECTION))
        head, tail = text[:start], ("\n" + text[end + 1:]) if end >= 0 else ""
    else:
        head, tail = text.rstrip() + "\n\n", ""
    parts = [README_SECTION + "\n\n" + README_INTRO]
    for directory in dirs:
        summary = json.loads((directory / "compare.json").read_text())
        plot = f"throughput_{directory.name.removeprefix('compare-')}.png"
        shutil.copy(directory / "compare_throughput.png", HERE / plot)
        parts.append(render(summary).replace("## ", "### ", 1).replace("\n### ", "\n#### ") + f"\n![throughput]({plot})\n")
    readme.write_text(head + "\n".join(parts) + tail)
    print(f"wrote {len(dirs)} runs into {readme}")
    return 0


README_INTRO = (
    "Each block is one `compare.py` run on the development machine (Linux x86_64, 2 shared CPU cores, mlx on its "
    "CPU backend): both servers and the raw step back to back, on a small model built with `ignore_eos=True`, "
    "64-token outputs. Read ratios within one run; the load average at the start is in each heading.\n"
)


def _usage(message: str) -> int:
    print(f"compare: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
