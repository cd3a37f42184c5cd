"""[loop] The load generator's pieces: synthetic images, one streamed chat request over SSE, statistics.

Talks plain HTTP with httpx (no OpenAI client) so that it measures any OpenAI-compatible
server the same way, and parses the SSE stream itself to time every chunk.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from PIL import Image, ImageDraw

REQUEST_TIMEOUT_S = 120.0
WORDS = ("red", "square", "circle", "river", "stone", "window", "garden", "signal", "orbit", "paper")


def synthetic_pil_images(count: int, size: int = 96, seed: int = 0) -> list[Image.Image]:
    """``count`` distinct images (shapes on a coloured ground): no server can reuse a vision cache."""
    rng = random.Random(seed)
    images = []
    for _ in range(count):
        image = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x0, y0 = rng.randrange(size - 8), rng.randrange(size - 8)
            box = (x0, y0, x0 + rng.randrange(8, size // 2), y0 + rng.randrange(8, size // 2))
            colour = tuple(rng.randrange(256) for _ in range(3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
        images.append(image)
    return images


def synthetic_images(count: int, size: int = 96, seed: int = 0) -> list[str]:
    """The same images as base64 PNG data URLs."""
    urls = []
    for image in synthetic_pil_images(count, size, seed):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def prompt_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return "Describe this: " + " ".join(rng.choice(WORDS) for _ in range(words))


def messages(text: str, image_url: str | None = None) -> list[dict[str, Any]]:
    if image_url is None:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@dataclass(slots=True)
class RequestResult:
    """What one streamed request measured; times in seconds from when it was sent."""

    kind: str = ""
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    sent_at: float = 0.0  # perf_counter when sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("chunk_times")
        out["chunks"] = len(self.chunk_times)
        return out


@dataclass(slots=True, frozen=True)
class Target:
    """The server under test and what its API accepts."""

    base_url: str
    model: str
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. ignore_eos where supported
    timeout_s: float = REQUEST_TIMEOUT_S  # one request's limit where the caller names none (slow models)


async def stream_chat(
    client: httpx.AsyncClient, target: Target, msgs: list[dict[str, Any]], max_tokens: int,
    kind: str = "", cancel_after: int | None = None, timeout: float | None = None,
    result: RequestResult | None = None,
) -> RequestResult:
    """POST one streaming chat completion; ``cancel_after`` chunks closes the connection early.

    Pass ``result`` to watch the stream's progress while it runs; ``timeout`` defaults to the target's.
    """
    timeout = target.timeout_s if timeout is None else timeout
    result = result or RequestResult()
    result.kind, result.sent_at = kind, time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, target, msgs, max_tokens, result, cancel_after), timeout)
        result.ok = result.error is None
    except TimeoutError:
        result.error = f"timed out after {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.latency = time.perf_counter() - result.sent_at
    if result.ok and not result.completion_tokens:
        result.completion_tokens = len(result.chunk_times)  # no usage chunk: count content chunks
    return result


async def _stream(client: httpx.AsyncClient, target: Target, msgs: list[dict[str, Any]], max_tokens: int,
                  result: RequestResult, cancel_after: int | None) -> None:
    body = {"model": target.model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, **target.extra_body}
    async with client.stream("POST", f"{target.base_url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {text[:300]}"
            return
        async for line in _sse_lines(response):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            _on_chunk(json.loads(data), result)
            if cancel_after is not None and len(result.chunk_times) >= cancel_after:
                return  # leaving the context manager closes the connection: a client disconnect


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, split at LF (and CRLF) only: a server may send U+2028 or U+0085 raw inside
    its JSON, where httpx's aiter_lines, which splits as str.splitlines does, cuts an event in two."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


def _on_chunk(chunk: dict[str, Any], result: RequestResult) -> None:
    now = time.perf_counter() - result.sent_at
    if "error" in chunk:
        result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        # a token that completes no character still carries its logprob where they were asked
        if delta.get("content") or delta.get("tool_calls") or (choice.get("logprobs") or {}).get("content"):
            if result.ttft is None:
                result.ttft = now
            result.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens"):
        result.completion_tokens = int(usage["completion_tokens"])


# -- statistics ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Aggregate tok/s over the wall time, TTFT / latency / inter-token percentiles (ms)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok if r.latency is not None]
    itls = [gap for r in ok for gap in r.itls]
    tokens = sum(r.completion_tokens for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731 - a local formatter
    return {
        "requests": len(results), "ok": len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
        "wall_s": round(wall_s, 3), "completion_tokens": tokens,
        "tok_s": round(tokens / wall_s, 1) if wall_s > 0 and ok else None,
        "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p90": ms(percentile(ttfts, 90)), "max": ms(max(ttfts, default=None))},
        "latency_ms": {"p50": ms(percentile(latencies, 50)), "p90": ms(percentile(latencies, 90))},
        "itl_ms": {"p50": ms(percentile(itls, 50)), "p90": ms(percentile(itls, 90)),
                   "mean": ms(sum(itls) / len(itls) if itls else None)},
        "ttfts_ms": [ms(t) for t in ttfts],
    }


async def run_closed_loop(coros: Sequence[Any], concurrency: int, on_done: Any = None) -> tuple[list[Any], float]:
    """Run request factories with at most ``concurrency`` in flight; returns results and wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(factory: Any) -> Any:
        async with gate:
            result = await factory()
        if on_done is not None:
            on_done()
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(f) for f in coros))
    return list(results), time.perf_counter() - start
