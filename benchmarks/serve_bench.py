"""[main] Load generator for any OpenAI-compatible chat server: throughput, TTFT, liveness, cancellation.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --model NAME [--out DIR] [--quick]

Every scenario streams over plain HTTP (see loadgen.py), is bounded in requests and in time,
and lands in ``DIR/serve_bench.json``, ``DIR/serve_bench.md`` and two PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from loadgen import (
    RequestResult,
    Target,
    messages,
    percentile,
    prompt_text,
    run_closed_loop,
    stream_chat,
    summarize,
    synthetic_images,
)

from vlmserve.progress import Progress, progress

SCENARIO_TIMEOUT_S = 300.0
PROBE_INTERVAL_S = 0.05


@dataclass(slots=True, frozen=True)
class BenchConfig:
    """How much load each scenario sends; ``quick()`` is for development runs."""

    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    per_level: int = 3  # requests per level = per_level * concurrency (at least 4)
    max_tokens: int = 64
    long_tokens: int = 128  # liveness and cancel background streams
    burst: int = 16
    burst_concurrency: int = 4
    slots: int = 8  # the server's batch size: the cancel test fills it
    cancel_repeats: int = 5

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(levels=(1, 2, 4, 8), per_level=2, max_tokens=32, long_tokens=64, burst=8, cancel_repeats=2)


class Bench:
    """One server under test: its client, a progress bar and a stock of distinct images."""

    def __init__(self, target: Target, config: BenchConfig, client: httpx.AsyncClient, bar: Progress) -> None:
        self.target, self.config, self.client, self.bar = target, config, client, bar
        self.images = synthetic_images(256)  # more than a run sends: no image repeats
        self._sent = 0

    def request(self, max_tokens: int, words: int = 12, with_image: bool = True, kind: str = "image",
                cancel_after: int | None = None, watch: RequestResult | None = None) -> Callable[[], Any]:
        """A factory of one streamed request; ``watch`` shows its progress while it runs.

        No two requests share a whole prompt or an image (only the chat template prefix)."""
        self._sent += 1
        image = self.images[self._sent % len(self.images)] if with_image else None
        msgs = messages(prompt_text(words, self._sent), image)
        return lambda: stream_chat(self.client, self.target, msgs, max_tokens, kind, cancel_after, result=watch)

    async def batch(self, factories: list[Callable[[], Any]], concurrency: int) -> tuple[list[RequestResult], float]:
        return await asyncio.wait_for(run_closed_loop(factories, concurrency, lambda: self.bar.update(1)),
                                      SCENARIO_TIMEOUT_S)

    # -- scenarios ------------------------------------------------------------------

    async def warmup(self) -> None:
        await self.batch([self.request(8), self.request(8, with_image=False)], 2)

    async def concurrency(self, level: int) -> dict[str, Any]:
        n = max(4, self.config.per_level * level)
        results, wall = await self.batch([self.request(self.config.max_tokens) for _ in range(n)], level)
        return self._summary(results, wall, self.config.max_tokens)

    async def burst(self) -> dict[str, Any]:
        c = self.config
        results, wall = await self.batch([self.request(64) for _ in range(c.burst)], c.burst_concurrency)
        summary = self._summary(results, wall, 64)
        p50, p90 = summary["ttft_ms"]["p50"], summary["ttft_ms"]["p90"]
        summary["ttft_p90_over_p50"] = round(p90 / p50, 2) if p50 and p90 else None
        return summary

    async def mixed(self) -> dict[str, Any]:
        """Short and long, text-only and image prompts, all sent at once."""
        kinds = {"text-short": (8, False), "text-long": (150, False), "image-short": (8, True), "image-long": (60, True)}
        factories = [self.request(48, words, image, kind) for kind, (words, image) in kinds.items() for _ in range(2)]
        results, wall = await self.batch(factories, len(factories))
        summary = self._summary(results, wall, 48)
        summary["by_kind"] = {k: _ttft_of([r for r in results if r.kind == k]) for k in kinds}
        return summary

    async def liveness(self, path: str) -> dict[str, Any]:
        """Probe ``path`` every 50 ms while ``slots`` long streams run."""
        streams = asyncio.ensure_future(self.batch(
            [self.request(self.config.long_tokens) for _ in range(self.config.slots)], self.config.slots))
        probes: list[float] = []
        failures = 0
        async with httpx.AsyncClient(base_url=self.target.base_url, timeout=5.0) as probe_client:
            while not streams.done():
                start = time.perf_counter()
                try:
                    failures += (await probe_client.get(path)).status_code != 200
                except httpx.HTTPError:
                    failures += 1
                probes.append(time.perf_counter() - start)
                await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - probes[-1]))
        results, wall = await streams
        ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
        return {"path": path, "probes": len(probes), "failures": failures, "probe_ms": {
            "p50": ms(percentile(probes, 50)), "p99": ms(percentile(probes, 99)), "max": ms(max(probes, default=None))},
            "streams": self._summary(results, wall, self.config.long_tokens)}

    async def cancel(self) -> dict[str, Any]:
        """With ``slots - 1`` streams running: a follower's TTFT when one slot is free (control), then
        when the last slot was just freed by a stream disconnected after 3 chunks. Their difference,
        in decode steps, is how long the server took to reuse the cancelled request's slot."""
        c, repeats = self.config, self.config.cancel_repeats
        watched = [RequestResult() for _ in range(c.slots - 1)]
        background = [asyncio.ensure_future(self.request(c.long_tokens * 3, watch=w)()) for w in watched]
        control, cancelled = [], []
        try:
            await asyncio.wait_for(_until(lambda: all(w.chunk_times or w.error for w in watched)), SCENARIO_TIMEOUT_S)
            for _ in range(repeats):
                control.append(await asyncio.wait_for(self._follower(), SCENARIO_TIMEOUT_S))
                victim = await asyncio.wait_for(self.request(c.long_tokens, cancel_after=3)(), SCENARIO_TIMEOUT_S)
                cancelled.append(await asyncio.wait_for(self._follower(), SCENARIO_TIMEOUT_S))
                cancelled[-1].error = cancelled[-1].error or (None if len(victim.chunk_times) >= 3 else "victim: "
                                                              + str(victim.error or "fewer than 3 chunks"))
        finally:
            done = await asyncio.wait_for(asyncio.gather(*background), SCENARIO_TIMEOUT_S)
        self.bar.update(len(background) + 3 * repeats)
        step = percentile([g for r in done for g in r.itls], 50)
        ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
        ttft_control = percentile([r.ttft for r in control if r.ok and r.ttft], 50)
        ttft_cancel = percentile([r.ttft for r in cancelled if r.ok and r.ttft], 50)
        extra = (ttft_cancel - ttft_control) / step if ttft_cancel and ttft_control and step else None
        errors = sorted({r.error for r in control + cancelled if r.error})
        return {"repeats": repeats, "step_ms": ms(step), "ttft_free_slot_ms": ms(ttft_control),
                "ttft_after_cancel_ms": ms(ttft_cancel), "extra_steps": None if extra is None else round(extra, 2),
                "ttfts_after_cancel_ms": [ms(r.ttft) for r in cancelled], "errors": errors[:3],
                "background": self._summary(done, 0.0, c.long_tokens * 3)}

    def _follower(self) -> Any:
        return self.request(8, words=8, with_image=False, kind="follower")()

    def _summary(self, results: list[RequestResult], wall: float, max_tokens: int) -> dict[str, Any]:
        summary = summarize(results, wall)
        summary["short_outputs"] = sum(1 for r in results if r.ok and r.completion_tokens < max_tokens)
        return summary


async def _until(condition: Callable[[], bool], every: float = 0.01) -> None:
    while not condition():
        await asyncio.sleep(every)


def _ttft_of(results: list[RequestResult]) -> dict[str, Any]:
    ttfts = [r.ttft for r in results if r.ok and r.ttft is not None]
    return {"ok": len(ttfts), "of": len(results), "ttft_ms_max": round(max(ttfts) * 1000, 1) if ttfts else None,
            "errors": sorted({r.error for r in results if r.error})[:2]}


async def probe_path(client: httpx.AsyncClient) -> str:
    """``/health`` where the server has it, else ``/v1/models`` (said so in the results)."""
    try:
        if (await client.get("/health")).status_code == 200:
            return "/health"
    except httpx.HTTPError:
        pass
    return "/v1/models"


def total_requests(config: BenchConfig) -> int:
    sweep = sum(max(4, config.per_level * c) for c in config.levels)
    return 2 + sweep + config.burst + 8 + config.slots + config.slots - 1 + 3 * config.cancel_repeats


async def run_all(target: Target, config: BenchConfig, label: str = "server") -> dict[str, Any]:
    """Every scenario against one server; a failed scenario is recorded, and the others still run."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    timeout = httpx.Timeout(120.0, connect=10.0)
    out: dict[str, Any] = {"label": label, "base_url": target.base_url, "model": target.model,
                           "extra_body": target.extra_body, "config": vars_of(config), "scenarios": {}}
    async with httpx.AsyncClient(base_url=target.base_url, limits=limits, timeout=timeout) as client:
        with progress(total=total_requests(config), desc=label, unit="req", file=sys.stderr) as bar:
            bench = Bench(target, config, client, bar)
            out["probe_path"] = await probe_path(client)
            steps: list[tuple[str, Callable[[], Any]]] = [("warmup", bench.warmup)]
            steps += [(f"concurrency/{c}", lambda c=c: bench.concurrency(c)) for c in config.levels]
            steps += [("burst", bench.burst), ("mixed", bench.mixed),
                      ("liveness", lambda: bench.liveness(out["probe_path"])), ("cancel", bench.cancel)]
            for name, scenario in steps:
                bar.set_postfix_str(name)
                out["scenarios"][name] = await _guard(scenario)
    return out


async def _guard(scenario: Callable[[], Any]) -> Any:
    try:
        return await scenario()
    except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the rest
        return {"failed": f"{type(exc).__name__}: {exc}"[:300]}


def vars_of(config: BenchConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the model name the server expects in requests")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter outputs")
    parser.add_argument("--label", default=None, help="the server's name in tables (default: the URL)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vlmserve, vLLM)")
    parser.add_argument("--slots", type=int, default=8, help="the server's batch size; the cancel test fills it")
    args = parser.parse_args(argv)
    import report  # matplotlib is only needed here

    config = BenchConfig.quick() if args.quick else BenchConfig()
    config = BenchConfig(**{**vars_of(config), "slots": args.slots})
    target = Target(args.base_url.rstrip("/"), args.model, {"ignore_eos": True} if args.ignore_eos else {})
    result = asyncio.run(run_all(target, config, args.label or args.base_url))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_bench.json").write_text(json.dumps(result, indent=1))
    table = report.markdown([result])
    (args.out / "serve_bench.md").write_text(table)
    report.plots([result], args.out, prefix="serve_bench")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
