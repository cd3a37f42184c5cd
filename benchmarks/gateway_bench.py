"""[main] Which gateway, and which policy, in front of several ``vlmserve serve`` replicas.

Two replicas of the demo model on loopback, the second slowed (``--max-batch-size 2``), behind each
gateway under test (``vllm-router`` and ``smg``, both Rust, from PyPI; they must be on PATH or
given with ``--bin-dir``):

- overhead: sequential short requests straight to a replica and through each gateway (p50, p90);
- policies: a burst of longer requests at concurrency 16 through round-robin and the load-aware
  policies (wall time, p50 and p90 latency, requests per replica).

    python benchmarks/gateway_bench.py [--bin-dir DIR] [--out benchmarks/results/gateway]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from compare import free_port, stop, wait_ready

from vlmserve.config import DEFAULT_MODEL_NAME
from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
GATEWAYS = {  # name -> (executable, policies: round-robin first)
    "vllm-router": ("vllm-router", ["round_robin", "power_of_two", "cache_aware"]),
    "smg": ("smg", ["round_robin", "power_of_two", "least_load"]),
}


def _start(argv: list[str], ready_path: str, port: int, log: Path, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    problem = wait_ready(proc, url + ready_path)
    if problem is not None:
        stop(proc)
        raise RuntimeError(f"{argv[0]} {problem}; see {log}")
    return proc, url


def _replica(extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "vlmserve.cli", "serve", "--port", str(port), *extra]
    return _start(argv, "/ready", port, log, {**os.environ, "VLMSERVE_NO_OPENBLAS": "1"})


def _gateway(binary: str, policy: str, workers: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [binary] + (["launch"] if Path(binary).name == "smg" else [])
    argv += ["--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
             "--health-check-endpoint", "/ready", "--prometheus-port", str(free_port())]
    return _start(argv, "/v1/models", port, log)


async def _request(http: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens, "ignore_eos": True}
    start = time.perf_counter()
    r = await http.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - start


async def _alternating(direct: str, gateway: str, n: int) -> tuple[list[float], list[float]]:
    """Short requests, one straight to a replica then one through the gateway, ``n`` times each: the
    two see the same machine load and the same (warm) prefix cache."""
    async with httpx.AsyncClient(timeout=120) as http:
        await _request(http, gateway, 4)  # warm both replicas' prefix caches
        await _request(http, gateway, 4)
        pairs = [(await _request(http, direct, 4), await _request(http, gateway, 4)) for _ in range(n)]
        return [d for d, _ in pairs], [g for _, g in pairs]


async def _burst(url: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def one() -> float:
            async with gate:
                return await _request(http, url, 48)
        start = time.perf_counter()
        latencies = await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - start, list(latencies)


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vlmserve_requests_total{"))


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", type=Path, default=None, help="where vllm-router and smg are (default: PATH)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gateway")
    parser.add_argument("--sequential", type=int, default=40, help="short requests for the overhead")
    parser.add_argument("--burst", type=int, default=48, help="requests per policy, at concurrency 16")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fast, fast_url = _replica([], args.out / "replica-fast.log")
    slow, slow_url = _replica(["--max-batch-size", "2"], args.out / "replica-slow.log")
    results: dict = {"gateways": {}}
    try:
        cells = sum(len(p) for _, p in GATEWAYS.values())
        with progress(total=cells, desc="gateways x policies", file=sys.stderr) as bar:
            for name, (exe, policies) in GATEWAYS.items():
                binary = str(args.bin_dir / exe) if args.bin_dir else exe
                for policy in policies:
                    gw, url = _gateway(binary, policy, [fast_url, slow_url], args.out / f"{name}-{policy}.log")
                    try:
                        cell: dict = {}
                        if policy == "round_robin":
                            direct, through = asyncio.run(_alternating(fast_url, url, args.sequential))
                            cell.update(direct_p50_ms=1000 * statistics.median(direct),
                                        p50_ms=1000 * statistics.median(through), p90_ms=1000 * _pct(through, 90))
                        before = (_served(fast_url), _served(slow_url))
                        wall, latencies = asyncio.run(_burst(url, args.burst, 16))
                        cell.update(burst_wall_s=wall, burst_p50_s=statistics.median(latencies),
                                    burst_p90_s=_pct(latencies, 90),
                                    fast_replica=_served(fast_url) - before[0], slow_replica=_served(slow_url) - before[1])
                        results["gateways"].setdefault(name, {})[policy] = cell
                    finally:
                        stop(gw)
                    bar.update(1)
    finally:
        for proc in (fast, slow):
            stop(proc)
    (args.out / "gateway.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
