"""[main] Models on demand (issue 47): load and unload times and the server's memory over rounds of swaps.

    python benchmarks/model_dir_bench.py [--rounds 6] [--out benchmarks/results/model-dir]

A ``--model-dir`` of three models, served with ``--max-loaded-models 2``: the real-weights SmolVLM of
``real_weights.py`` (163 M parameters, float32: 623 MiB of weights) under three names (hard links, so the
folders are real folders of the DIR, as a user's copies would be). One request each to the first two, then
``--rounds`` rounds of the three in turn: every request past the first two loads its model, and unloads the
least recently used first. Measured: each load (``vlmserve_model_load_seconds``: load and warm-up) and
unload (the server's log), each cold request's latency against a warm one's, and the server's RSS
(``/proc``) after the first two loads and after each round. Writes ``model_dir.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from compare import free_port, machine
from real_weights import build_smolvlm_smollm2

from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
NAMES = ("smolvlm-a", "smolvlm-b", "smolvlm-c")


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


def ask(url: str, model: str) -> float:
    started = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600,
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    r.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "model-dir")
    args = parser.parse_args()
    source = build_smolvlm_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        for name in NAMES:
            (root / name).mkdir(parents=True)
            for f in source.iterdir():
                os.link(f, root / name / f.name)
        port = free_port()
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "vlmserve.cli", "serve", "--model-dir", str(root), "--port",
                                     str(port), "--max-loaded-models", "2", "--idle-unload-s", "0"],
                                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            result = run(url, proc.pid, args.rounds, log_path)
        finally:
            proc.terminate()
            proc.wait(30)
    result["machine"] = machine(dict(os.environ))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_dir.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"results in {args.out}")


def run(url: str, pid: int, rounds: int, log_path: Path) -> dict:
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"server not ready:\n{log_path.read_text()}")
        time.sleep(0.2)
    idle = rss_mib(pid)
    cold = [ask(url, NAMES[0]), ask(url, NAMES[1])]
    warm = [ask(url, NAMES[1]) for _ in range(3)]
    base = rss_mib(pid)
    rss = []
    for _ in progress(range(rounds), desc="model_dir_bench", unit="round"):
        cold += [ask(url, name) for name in NAMES]
        rss.append(rss_mib(pid))
    log = log_path.read_text()
    loads = [float(s) for s in re.findall(r"loaded on demand in ([\d.]+) s", log)]
    unloads = [float(s) for s in re.findall(r"unloaded in ([\d.]+) s", log)]
    return {"rss_idle_mib": idle, "rss_after_two_loads_mib": base, "rss_after_each_round_mib": rss,
            "rss_ratio_last": rss[-1] / base, "rss_ratio_max": max(rss) / base, "load_s": loads, "unload_s": unloads,
            "cold_request_s": cold, "warm_request_s": warm, "weights_mib": _weights(log)}


def _weights(log: str) -> float:
    found = re.findall(r"loaded on demand in [\d.]+ s \(([\d.]+) MiB of weights\)", log)
    return float(found[0]) if found else 0.0


def table(r: dict) -> str:
    med = statistics.median
    return "\n".join([
        "| | value |", "|---|---|",
        f"| weights per model | {r['weights_mib']:.0f} MiB |",
        f"| load (load + warm-up), median of {len(r['load_s'])} | {med(r['load_s']):.2f} s (max {max(r['load_s']):.2f}) |",
        f"| unload, median of {len(r['unload_s'])} | {med(r['unload_s']):.2f} s (max {max(r['unload_s']):.2f}) |",
        f"| a request that loads its model (and unloads another), median | {med(r['cold_request_s'][2:]):.2f} s |",
        f"| the same request, model loaded | {med(r['warm_request_s']):.2f} s |",
        f"| RSS: idle, after two loads | {r['rss_idle_mib']:.0f} MiB, {r['rss_after_two_loads_mib']:.0f} MiB |",
        f"| RSS after each round | {', '.join(f'{x:.0f}' for x in r['rss_after_each_round_mib'])} MiB |",
        f"| RSS after the last round / after two loads | {r['rss_ratio_last']:.2f}x (max {r['rss_ratio_max']:.2f}x) |",
    ])


if __name__ == "__main__":
    main()
