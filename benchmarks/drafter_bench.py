"""[main] A drafter model through two servers: vlmserve and mlx_vlm.server, each with and without
``--draft-model``, on the same model and drafter (the demo model and its trained assistant, or any
Gemma 4 and its assistant), over HTTP with the ``openai`` client.

Each server runs ``--rounds`` rounds of ``c`` concurrent greedy requests for each concurrency: the
demo's picture, "Return the shapes as JSON." (a ~60-token answer). Reported: completion tokens/s, the
ratio with the drafter to without on the same server, and whether the answers stayed the same.
Float32 weights want OpenBLAS: the program restarts itself under it when it is installed, and the
servers inherit it.

    python benchmarks/drafter_bench.py [--model DIR] [--drafter DIR] [--concurrency 1,4] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import openai
from compare import ServerSpec, free_port, serving

from vlmserve.blas import find_openblas, openblas_preloaded
from vlmserve.config import DEMO_DRAFTER_DIR, DEMO_MODEL_DIR
from vlmserve.progress import progress

ROOT = Path(__file__).resolve().parent.parent
PICTURE = base64.b64encode((ROOT / "assets" / "example.png").read_bytes()).decode()


def specs(model: Path, drafter: Path, port: int, k: int) -> list[ServerSpec]:
    py = sys.executable
    ours = [py, "-m", "vlmserve.cli", "serve", "--model", str(model), "--port", str(port), "--dtype", "model"]
    peer = [py, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "WARNING"]
    draft = ["--draft-model", str(drafter), "--draft-kind", "mtp", "--draft-block-size", str(k + 1)]
    return [ServerSpec("vlmserve", ours, "/ready", {}), ServerSpec("vlmserve+drafter", ours + draft, "/ready", {}),
            ServerSpec("mlx_vlm", peer, "/health", {}), ServerSpec("mlx_vlm+drafter", peer + draft, "/health", {})]


async def _ask(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> tuple[str, int]:
    r = await client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PICTURE}"}},
                                     {"type": "text", "text": "Return the shapes as JSON."}]}])
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.completion_tokens


async def _server(url: str, model: str, levels: list[int], rounds: int, max_tokens: int) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    await _ask(client, model, max_tokens)  # warm-up
    cells: dict[str, Any] = {}
    for c in levels:
        start, answers, tokens = time.perf_counter(), [], 0
        for _ in range(rounds):
            for text, n in await asyncio.gather(*(_ask(client, model, max_tokens) for _ in range(c))):
                answers.append(text)
                tokens += n
        cells[str(c)] = {"tok_s": round(tokens / (time.perf_counter() - start), 1), "answers": sorted(set(answers))}
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--drafter", type=Path, default=DEMO_DRAFTER_DIR)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step (--draft-block-size k + 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    library = find_openblas()
    if library is not None and not openblas_preloaded() and not os.environ.get("VLMSERVE_NO_OPENBLAS"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": library})
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    port = free_port()
    with progress(specs(args.model, args.drafter, port, args.k), desc="servers") as bar:
        for spec in bar:
            log = args.out / f"drafter_bench-{spec.label}.log"
            with serving(spec, port, dict(os.environ), log) as (problem, _):
                if problem is not None:
                    results[spec.label] = {"failed": problem, "log": str(log)}
                    continue
                try:
                    results[spec.label] = asyncio.run(_server(f"http://127.0.0.1:{port}", str(args.model), levels,
                                                              args.rounds, args.max_tokens))
                except Exception as exc:  # noqa: BLE001 - a server that fails a request is reported, not fatal
                    results[spec.label] = {"failed": f"{type(exc).__name__}: {exc}", "log": str(log)}
    print(f"model {args.model.name}, drafter {args.drafter.name}, k {args.k}, "
          f"BLAS: {'OpenBLAS' if openblas_preloaded() else 'reference'}")
    print("| server | c | tok/s | tok/s with drafter | ratio | same answers |")
    print("|---|---|---|---|---|---|")
    for name in ("vlmserve", "mlx_vlm"):
        plain, drafted = results.get(name, {}), results.get(f"{name}+drafter", {})
        for c in map(str, levels):
            a, b = plain.get(c), drafted.get(c)
            if a is None or b is None:
                print(f"| {name} | {c} | {plain.get('failed', '-') if a is None else a['tok_s']} | "
                      f"{drafted.get('failed', '-') if b is None else b['tok_s']} | - | - |")
                continue
            print(f"| {name} | {c} | {a['tok_s']} | {b['tok_s']} | {b['tok_s'] / a['tok_s']:.2f}x | "
                  f"{a['answers'] == b['answers']} |")
    (args.out / "drafter_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
