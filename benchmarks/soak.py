"""[main] Soak: ``vlmserve serve`` under mixed load at concurrency 4 for 10 minutes, its RSS over time.

    python benchmarks/soak.py [--duration 600] [--warmup S] [--concurrency 4] [--model DIR] [--out DIR] [--no-plot]
        [--features] [--max-slope MIB_PER_MIN]

Starts the server (the built-in demo model unless --model) and keeps ``concurrency`` requests in
flight until the time is up: image and text prompts, streamed and not, tool calls and tool
results, streams the client drops after a few chunks, max_tokens from 8 to 128 (half with
ignore_eos). Beside them, on their own clocks:

- every ``--huge-every`` seconds, a request with an image of tens of megapixels (a 30 MP PNG);
- every ``--stuck-every`` seconds, a client that stops reading: a raw socket with a 4 KiB receive
  buffer asks for a long stream with 20 top logprobs a token and reads nothing for
  ``--stuck-hold`` seconds. The server (``--stream-stall-timeout``, 5 s here) must release it:
  its ``vlmserve_stalled_requests_total`` has grown by the time the client gives up;
- every half second, ``/health``, timed.

The server's RSS is sampled every few seconds. After the warm-up (default: the first 10% of the
run) the RSS at the start of the rest is compared with its end, each the median of the samples in
a short window: the run fails (exit status 1) if that growth is 10% or more, if any request got a
5xx or failed otherwise (a stuck client the server did not release included), if ``/health``'s
p99 is 50 ms or more, or if the server died. Writes ``soak.json``, the server's log and
``soak.png`` (RSS over time) to DIR.

``--features`` turns every feature on (benchmarks/soak_features.py): three models swapping through a
``--model-dir``, the disk tier, 8-bit KV, ngram speculation; MLX's active and cached memory are sampled
beside the RSS, the slope of each over the run's second half is reported (MiB/min) and plotted, and
``--max-slope`` fails a run whose RSS slope there is that or more.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from compare import free_port, stop, wait_ready
from loadgen import (
    REQUEST_TIMEOUT_S,
    RequestResult,
    Target,
    messages,
    prompt_text,
    stream_chat,
    summarize,
    synthetic_images,
)
from PIL import Image
from soak_features import mlx_memory, server_args
from soak_features import plot as plot_features
from soak_features import summary as memory_summary

from vlmserve.progress import Progress, progress
from vlmserve.testing.demo.dialogues import CITIES, UNITS, WEATHER_TOOL, weather_exchange

try:
    import psutil
except ImportError:  # not a dependency: /proc gives the same number on Linux
    psutil = None

HERE = Path(__file__).resolve().parent
GROWTH_LIMIT_PCT = 10.0
HEALTH_P99_LIMIT_MS = 50.0
STALL_TIMEOUT_S = 5.0  # the server's --stream-stall-timeout in the soak
HUGE_SIDES = (6000, 5000)  # 30 MP
EXTRA_KINDS = ("huge-image", "stuck-stream")  # on their own clocks, beside the mix
MAX_TOKENS = (8, 16, 32, 64, 128)


@dataclass(slots=True, frozen=True)
class Kind:
    """One kind of request in the mix, and how often it comes up."""

    name: str
    weight: int
    image: bool = False
    stream: bool = True
    tools: bool = False
    cancel: bool = False  # the client drops the stream after 1-4 chunks


MIX = (Kind("image-stream", 3, image=True), Kind("text-stream", 2), Kind("image-json", 2, image=True, stream=False),
       Kind("text-json", 1, stream=False), Kind("tool-call-stream", 1, tools=True),
       Kind("tool-call-json", 1, stream=False, tools=True), Kind("tool-result-json", 1, stream=False, tools=True),
       Kind("image-cancel", 1, image=True, cancel=True), Kind("text-cancel", 1, cancel=True))


class Load:
    """The request stream: which kind comes next, its prompt and image, and every result."""

    def __init__(self, client: httpx.AsyncClient, target: Target, seed: int = 0, models: list[str] | None = None) -> None:
        self.client, self.target, self.rng = client, target, random.Random(seed)
        self.models = models or [target.model]  # each request names one at random (--features: they swap)
        self.images = synthetic_images(256)  # a stock that repeats: some vision-cache hits, mostly misses
        self.results: list[RequestResult] = []
        self.sent = 0
        self.finish: Counter[str] = Counter()  # non-streamed finish reasons
        self.health_ms: list[float] = []
        self.huge: list[str] = []  # made on first use: a few, in distinct colours

    async def send_next(self) -> None:
        self.sent += 1
        rng, kind = self.rng, self.rng.choices(MIX, [k.weight for k in MIX])[0]
        max_tokens = rng.choice(MAX_TOKENS)
        extra = {"tools": [WEATHER_TOOL]} if kind.tools else {"ignore_eos": True} if rng.random() < 0.5 else {}
        model = self.rng.choice(self.models)
        target = Target(self.target.base_url, model, {**self.target.extra_body, **extra})
        msgs = self._messages(kind, self.sent)
        if kind.stream:
            cancel_after = rng.randint(1, 4) if kind.cancel else None
            result = await stream_chat(self.client, target, msgs, max_tokens, kind.name, cancel_after)
        else:
            result = await self._complete(target, msgs, max_tokens, kind.name)
        self.results.append(result)

    def _messages(self, kind: Kind, n: int) -> list[dict[str, Any]]:
        if kind.tools:
            city, unit = self.rng.choice(CITIES), self.rng.choice(UNITS)
            question = {"role": "user", "content": f"What's the weather in {city} in {unit}?"}
            if kind.name != "tool-result-json":
                return [question]
            call, result = weather_exchange(city, unit, self.rng.randint(-10, 40))
            for tool_call in call["tool_calls"]:  # OpenAI sends arguments as a JSON string
                tool_call["function"]["arguments"] = json.dumps(tool_call["function"]["arguments"])
            return [question, call, result]
        image = self.images[n % len(self.images)] if kind.image else None
        return messages(prompt_text(self.rng.randint(4, 60), n), image)

    async def _complete(self, target: Target, msgs: list[dict[str, Any]], max_tokens: int, kind: str) -> RequestResult:
        """One non-streamed chat completion, timed and checked like ``stream_chat``'s."""
        result = RequestResult(kind=kind, sent_at=time.perf_counter())
        body = {"model": target.model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0.0,
                **target.extra_body}
        try:
            response = await self.client.post(f"{target.base_url}/v1/chat/completions", json=body,
                                              timeout=REQUEST_TIMEOUT_S)
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {response.text[:300]}"
            else:
                data = response.json()
                result.completion_tokens = int(data["usage"]["completion_tokens"])
                self.finish[data["choices"][0]["finish_reason"]] += 1
                result.ok = True
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        result.latency = time.perf_counter() - result.sent_at
        return result


    async def send_huge(self) -> None:
        """One request with a 30 MP image, not streamed."""
        if not self.huge:
            self.huge = await asyncio.to_thread(huge_images, 4)
        self.sent += 1
        msgs = messages(prompt_text(6, self.sent), self.huge[self.sent % len(self.huge)])
        self.results.append(await self._complete(self.target, msgs, 8, "huge-image"))

    async def send_stuck(self, hold_s: float) -> None:
        """A client that stops reading a long stream; ok once the server has released it."""
        result = RequestResult(kind="stuck-stream", sent_at=time.perf_counter())
        before = await self._stalled()
        body = {"model": self.target.model, "stream": True, "max_tokens": 600, "logprobs": True, "top_logprobs": 20,
                "ignore_eos": True, "messages": [{"role": "user", "content": "Tell me a long story."}]}
        sock = await asyncio.to_thread(_stuck_socket, self.target.base_url, json.dumps(body).encode())
        try:
            deadline = time.monotonic() + hold_s
            while time.monotonic() < deadline and (await self._stalled()) <= before:
                await asyncio.sleep(0.5)
            stalled = await self._stalled()
            result.ok = stalled > before
            result.error = None if result.ok else f"not released after {hold_s:.0f} s of not reading"
        finally:
            sock.close()
        result.latency = time.perf_counter() - result.sent_at
        self.results.append(result)

    async def _stalled(self) -> float:
        try:
            text = (await self.client.get(f"{self.target.base_url}/metrics", timeout=10)).text
        except httpx.TransportError:  # a kept-alive connection closed as it was taken: once more, on a new one
            text = (await self.client.get(f"{self.target.base_url}/metrics", timeout=10)).text
        return sum(float(m.group(1)) for m in re.finditer(r"^vlmserve_stalled_requests_total(?:\{[^}]*\})? (\S+)$",
                                                          text, re.M))

    async def probe_health(self) -> None:
        start = time.perf_counter()
        try:
            response = await self.client.get(f"{self.target.base_url}/health", timeout=10)
        except httpx.TransportError:  # a kept-alive connection the server closed as it was taken: once more, on a new one
            start = time.perf_counter()
            try:
                response = await self.client.get(f"{self.target.base_url}/health", timeout=10)
            except httpx.TransportError as exc:
                self.results.append(RequestResult(kind="health", error=f"{type(exc).__name__}: {exc}"[:300]))
                return
        self.health_ms.append((time.perf_counter() - start) * 1000)
        if response.status_code != 200:
            self.results.append(RequestResult(kind="health", error=f"HTTP {response.status_code}: {response.text}"))


def huge_images(count: int) -> list[str]:
    """``count`` one-colour 30 MP PNGs as data URLs (about 100 KB each)."""
    urls = []
    for i in range(count):
        buf = io.BytesIO()
        Image.new("RGB", HUGE_SIDES, (60 * i % 256, 200, 255 - 50 * i % 256)).save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def _stuck_socket(base_url: str, body: bytes) -> socket.socket:
    """A connection with a 4 KiB receive buffer that has sent a request and will read nothing."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def rss_bytes(pid: int) -> int | None:
    """The process's resident set size (psutil if installed, else /proc); None once it is gone."""
    try:
        if psutil is not None:
            return int(psutil.Process(pid).memory_info().rss)
        found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
        return int(found.group(1)) * 1024 if found else None
    except Exception:  # noqa: BLE001 - OSError, psutil.NoSuchProcess and friends: it is gone
        return None


def threads(pid: int) -> int:
    """The process's threads, native ones included (an MLX stream's thread is one)."""
    found = re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(found.group(1)) if found else 0


async def sample(pid: int, every_s: float, t0: float, samples: list[list[float]], done: asyncio.Event,
                 bar: Progress, load: Load, mlx: list[list[float]] | None = None) -> None:
    """RSS in MiB (the ``_mb`` keys are MiB throughout) every ``every_s`` until ``done``, and MLX's active and
    cached MiB from /metrics into ``mlx`` when given, with the process's thread count; the bar counts seconds."""
    shown = 0
    while not done.is_set() and (rss := rss_bytes(pid)) is not None:
        elapsed = time.monotonic() - t0
        samples.append([round(elapsed, 2), round(rss / 2**20, 1)])
        if mlx is not None and (memory := await mlx_memory(load.client, load.target.base_url)) is not None:
            mlx.append([round(time.monotonic() - t0, 2), *memory, threads(pid)])
        failed = sum(1 for r in load.results if not r.ok)
        bar.set_postfix_str(f"rss {samples[-1][1]:.0f} MB, {len(load.results)} req, {failed} failed")
        bar.update(int(elapsed) - shown)
        shown = int(elapsed)
        try:
            await asyncio.wait_for(done.wait(), every_s)
        except TimeoutError:
            pass


async def soak(target: Target, pid: int, args: argparse.Namespace,
               models: list[str]) -> tuple[Load, list[list[float]], list[list[float]], float]:
    """``concurrency`` lanes, each sending its next request until the time is up, and the sampler: the RSS, and
    MLX's memory (``--features``)."""
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as client:
        load, samples, done = Load(client, target, args.seed, models), [], asyncio.Event()
        mlx: list[list[float]] | None = [] if args.features else None
        start = time.monotonic()
        deadline = start + args.duration

        async def lane() -> None:
            while time.monotonic() < deadline and rss_bytes(pid) is not None:
                await load.send_next()

        async def every(period: float, first: float, send: Callable[[], Awaitable[None]]) -> None:
            await asyncio.sleep(first)
            while time.monotonic() < deadline and rss_bytes(pid) is not None:
                began = time.monotonic()
                await send()
                await asyncio.sleep(max(0.0, period - (time.monotonic() - began)))

        extras = [every(0.5, 0.0, load.probe_health), every(args.huge_every, 1.0, load.send_huge),
                  every(args.stuck_every, 2.0, lambda: load.send_stuck(args.stuck_hold))]

        with progress(total=int(args.duration), desc="soak", unit="s", file=sys.stderr) as bar:
            sampler = asyncio.ensure_future(sample(pid, args.sample_every, start, samples, done, bar, load, mlx))
            await asyncio.gather(*(lane() for _ in range(args.concurrency)), *extras)
            done.set()
            await sampler
        return load, samples, mlx or [], time.monotonic() - start


def rss_summary(samples: list[list[float]], warmup_s: float, window_s: float) -> dict[str, Any]:
    """Start and end (medians over ``window_s``), peak and growth of the samples after the warm-up."""
    after = [(t, mb) for t, mb in samples if t >= warmup_s]
    out: dict[str, Any] = {"warmup_s": warmup_s, "window_s": window_s, "samples_after_warmup": len(after)}
    if len(after) < 2:
        return out | {"growth_pct": None}
    first, last = after[0][0], after[-1][0]
    start = statistics.median(mb for t, mb in after if t <= first + window_s)
    end = statistics.median(mb for t, mb in after if t >= last - window_s)
    peak = max(mb for _, mb in after)
    return out | {"start_mb": start, "peak_mb": peak, "end_mb": end, "first_mb": after[0][1], "last_mb": after[-1][1],
                  "growth_pct": round(100 * (end - start) / start, 2),
                  "peak_over_start_pct": round(100 * (peak - start) / start, 2)}


def request_summary(load: Load, wall_s: float) -> dict[str, Any]:
    results = load.results
    statuses = Counter(int(m.group(1)) for r in results if (m := re.match(r"HTTP (\d{3}):", r.error or "")))
    kinds = [k.name for k in MIX] + list(EXTRA_KINDS)
    by_kind = {k: {"sent": sum(r.kind == k for r in results), "ok": sum(r.ok and r.kind == k for r in results)}
               for k in kinds}
    streams = [r for r in results if r.kind.endswith("-stream")]
    return {"sent": len(results), "completed": sum(r.ok for r in results), "failed": sum(not r.ok for r in results),
            "cancelled": sum(r.ok and r.kind.endswith("-cancel") for r in results),
            "http_5xx": sum(n for code, n in statuses.items() if code >= 500), "http_status_errors": dict(statuses),
            "completion_tokens": sum(r.completion_tokens for r in results if r.ok),
            "errors": sorted({r.error for r in results if r.error})[:5], "by_kind": by_kind,
            "finish_reasons_json": dict(load.finish),
            "streams": {k: v for k, v in summarize(streams, wall_s).items() if k != "ttfts_ms"}}


def health_summary(latencies_ms: list[float]) -> dict[str, Any]:
    if not latencies_ms:
        return {"probes": 0, "p99_ms": None}
    ordered = sorted(latencies_ms)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)  # noqa: E731
    return {"probes": len(ordered), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": round(ordered[-1], 1)}


def verdict(report: dict[str, Any], server_alive: bool) -> list[str]:
    """Why the run failed; empty when it passed."""
    requests, growth = report["requests"], report["rss"]["growth_pct"]
    reasons = [] if server_alive else ["the server died"]
    p99 = report.get("health", {}).get("p99_ms")
    reasons += [f"/health p99 {p99} ms (limit {HEALTH_P99_LIMIT_MS:.0f} ms)"] if p99 and p99 >= HEALTH_P99_LIMIT_MS else []
    reasons += [f"{requests['http_5xx']} requests got a 5xx"] if requests["http_5xx"] else []
    reasons += [f"{requests['failed']} requests failed"] if requests["failed"] else []
    reasons += ["no request completed"] if not requests["completed"] else []
    memory = report.get("memory") or {}
    if memory.get("max_slope") is not None and (memory["rss_slope"] is None or memory["rss_slope"] >= memory["max_slope"]):
        reasons.append(f"RSS slope over the second half {memory['rss_slope']} MiB/min (limit {memory['max_slope']})")
    if growth is None:
        reasons.append("too few RSS samples after the warm-up")
    elif growth >= GROWTH_LIMIT_PCT:
        reasons.append(f"RSS grew {growth}% after the warm-up (limit {GROWTH_LIMIT_PCT}%)")
    return reasons


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rss, times = report["rss"], [t for t, _ in report["rss"]["samples"]]
    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=90)
    ax.plot(times, [mb for _, mb in rss["samples"]], lw=1.2, label="server RSS")
    ax.axvspan(0, rss["warmup_s"], color="0.9", label="warm-up")
    if rss.get("start_mb"):
        ax.axhline(rss["start_mb"], color="0.5", ls="--", lw=0.8, label="start (after warm-up)")
        ax.axhline(rss["start_mb"] * (1 + GROWTH_LIMIT_PCT / 100), color="tab:red", ls=":", lw=0.8, label="+10% limit")
    c = report["config"]
    ax.set(xlabel="seconds", ylabel="RSS (MiB)", title=f"soak: concurrency {c['concurrency']}, growth {rss['growth_pct']}%")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, int, float]:
    port = free_port()
    argv = [sys.executable, "-m", "vlmserve.cli", "serve", "--port", str(port), "--max-batch-size", str(args.max_batch)]
    argv += ["--model", args.model] if args.model else []
    argv += ["--stream-stall-timeout", str(STALL_TIMEOUT_S)]
    argv += server_args(args.out) if args.features else []
    env = dict(os.environ, PYTHONUNBUFFERED="1") | ({"VLMSERVE_NO_OPENBLAS": "1"} if args.no_openblas else {})
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
    if (problem := wait_ready(proc, f"http://127.0.0.1:{port}/ready")) is not None:
        stop(proc)
        raise SystemExit(f"soak: the server {problem}; see {log_path}")
    return proc, port, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    proc, port, ready_s = start_server(args, args.out / "soak-server.log")
    try:
        base_url = f"http://127.0.0.1:{port}"
        listed = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
        model = next(m["id"] for m in listed if m.get("pinned", True))  # --features: the stalled clients' model
        models = [m["id"] for m in listed if not m.get("pinned", True)] or [model]  # --features: those that swap
        idle_rss = rss_bytes(proc.pid)
        load, samples, mlx, wall_s = asyncio.run(soak(Target(base_url, model), proc.pid, args, models))
        alive = proc.poll() is None
    finally:
        stop(proc)
    warmup = args.warmup if args.warmup is not None else 0.1 * args.duration
    window = max(3 * args.sample_every, 0.05 * args.duration)
    machine = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
    report = {"machine": machine, "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "server": {"model": model, "pid": proc.pid, "ready_s": round(ready_s, 1), "exit_status": proc.returncode,
                         "idle_rss_mb": round(idle_rss / 2**20, 1) if idle_rss else None},
              "wall_s": round(wall_s, 1), "requests": request_summary(load, wall_s),
              "health": health_summary(load.health_ms),
              "rss": {"source": "psutil" if psutil else "/proc/PID/status VmRSS", **rss_summary(samples, warmup, window),
                      "samples": samples}}
    if args.features:
        report["memory"] = memory_summary(samples, mlx, wall_s) | {"max_slope": args.max_slope, "mlx_samples": mlx,
                                                                  "models": models}
    report["failures"] = verdict(report, alive)
    report["passed"] = not report["failures"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before RSS counts (default: 10%% of it)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--model", default=None, help="a model directory (default: the built-in demo)")
    parser.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch-size")
    parser.add_argument("--no-openblas", action="store_true", help="set VLMSERVE_NO_OPENBLAS=1 for the server")
    parser.add_argument("--huge-every", type=float, default=15.0, help="seconds between 30 MP image requests")
    parser.add_argument("--stuck-every", type=float, default=30.0, help="seconds between clients that stop reading")
    parser.add_argument("--stuck-hold", type=float, default=25.0,
                        help=f"how long such a client waits to be released (the server's stall timeout: {STALL_TIMEOUT_S:.0f} s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "soak")
    parser.add_argument("--no-plot", action="store_true", help="skip soak.png (matplotlib is in the bench extra)")
    parser.add_argument("--features", action="store_true",
                        help="every feature on: three models swapping, disk tier, --kv-bits 8, ngram speculation")
    parser.add_argument("--max-slope", type=float, default=None,
                        help="fail when the RSS slope over the second half is this many MiB/min or more")
    args = parser.parse_args(argv)
    report = run(args)
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    if not args.no_plot and "memory" in report:
        title = f"soak, every feature on: {report['wall_s'] / 60:.0f} min, concurrency {args.concurrency}"
        plot_features(report["rss"]["samples"], report["memory"]["mlx_samples"], report["memory"], title,
                      args.out / "soak.png")
    elif not args.no_plot:
        plot(report, args.out / "soak.png")
    rss, req, health = report["rss"], report["requests"], report["health"]
    print(f"RSS after warm-up: start {rss.get('start_mb')} MiB, peak {rss.get('peak_mb')} MiB, "
          f"end {rss.get('end_mb')} MiB, growth {rss['growth_pct']}%; {req['completed']}/{req['sent']} requests completed, "
          f"{req['http_5xx']} 5xx; /health p50 {health.get('p50_ms')} ms, p99 {health.get('p99_ms')} ms")
    if "memory" in report:
        m = report["memory"]
        print(f"second half (MiB/min): RSS {m['rss_slope']}, MLX active {m['active_slope']}, MLX cache {m['cache_slope']}")
    print("PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failures"]), f"- results in {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
