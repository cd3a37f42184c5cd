"""[main] Embeddings/s through two servers (issue 59): vlmserve and ``python -m mlx_vlm.server --embedding-model``.

Two offline models (vlmserve/testing/pooling_models.py): the Qwen3-Embedding-shaped text embedder and the
Qwen3-VL-Embedding-shaped VL embedder. Both are the builder's "micro" size, the only one it makes: random weights,
so the numbers measure each server's request path, batching and padding, not a real model's FLOPs (on 2 cores a
real 0.6B model would take the whole time budget for one column).

For text inputs (text embedder), image inputs and text inputs to the VL embedder (``vl-text``), at ``--batch``
inputs per request and ``--concurrency`` requests in flight (closed loop, ``--rounds`` x c requests per cell):
embeddings/s and request latency p50. Every input is different (no vision-cache hits); the same inputs go to both
servers, and every vector is checked against the other server's (cosine >= 0.9999). A server or cell that fails is
recorded, not fatal (mlx_vlm.server's Qwen3-VL embedder fails text under concurrency; the JSON says how).
Float32 weights want OpenBLAS: the program restarts itself under it when it is installed, and the servers inherit it.

    python benchmarks/embed_bench.py [--batch 1,8,32] [--concurrency 1,8] [--rounds 6] [--quick] \\
        [--kinds text,image,vl-text] [--servers vlmserve,mlx_vlm] [--out benchmarks/results/embed]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from compare import ServerSpec, free_port, serving
from loadgen import percentile, prompt_text, synthetic_images

from vlmserve.blas import find_openblas, openblas_preloaded
from vlmserve.testing.pooling_models import build_pooling_model

ROOT = Path(__file__).resolve().parent.parent
# input kind -> (builder, published name); "vl-text" is text to the VL embedder (queries beside image documents)
MODELS = {"text": ("text_embedder", "Qwen3-Embedding-0.6B"), "image": ("vl_embedder", "Qwen3-VL-Embedding-2B"),
          "vl-text": ("vl_embedder", "Qwen3-VL-Embedding-2B")}
COSINE_MIN = 0.9999
REQUEST_TIMEOUT_S = 300.0
IMAGE_SIZES = (96, 128)


def specs(folder: Path, port: int, max_images: int) -> list[ServerSpec]:
    py = sys.executable
    # vlmserve refuses more than 8 images per request by default (--limit-mm-per-prompt); batch 32 needs 32
    ours = [py, "-m", "vlmserve.cli", "serve", "--model", str(folder), "--port", str(port), "--dtype", "model",
            "--limit-mm-per-prompt", json.dumps({"image": max_images})]
    peer = [py, "-m", "mlx_vlm.server", "--embedding-model", str(folder), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "WARNING"]
    return [ServerSpec("vlmserve", ours, "/ready", {"model": folder.name}),
            ServerSpec("mlx_vlm", peer, "/health", {"model": str(folder)})]


def inputs(kind: str, batch: int, c: int, request: int) -> list[Any]:
    """One request's inputs, the same for every server: texts of 8-31 words, or distinct PNGs of 96x96 and
    128x128 in turn (two patch grids: a server that reuses one image's positions for the next shows it)."""
    seed = (batch * 1000 + c) * 1000 + request * batch
    if kind != "image":
        return [prompt_text(8 + (seed + i) % 24, seed + i) for i in range(batch)]
    urls = [synthetic_images(1, size=IMAGE_SIZES[(seed + i) % 2], seed=seed + i)[0] for i in range(batch)]
    return [{"type": "image_url", "image_url": {"url": url}} for url in urls]


async def _embed(client: httpx.AsyncClient, model: str, items: list[Any]) -> list[list[float]]:
    r = await client.post("/v1/embeddings", json={"model": model, "input": items, "encoding_format": "float"})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


async def _cell(client: httpx.AsyncClient, model: str, kind: str, batch: int, c: int, rounds: int) -> dict[str, Any]:
    """``rounds`` x ``c`` requests, ``c`` in flight: embeddings/s, latency p50, and every vector returned."""
    queue = list(range(rounds * c))
    latencies: list[float] = []
    vectors: dict[int, list[list[float]]] = {}
    payloads = {i: inputs(kind, batch, c, i) for i in queue}  # built before the clock starts

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            t0 = time.perf_counter()
            vectors[i] = await _embed(client, model, payloads[i])
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - start
    p50 = percentile(latencies, 50)
    return {"emb_s": round(rounds * c * batch / wall, 1), "p50_ms": round(1000 * (p50 or 0.0), 1),
            "requests": rounds * c, "vectors": vectors}


async def _server(url: str, model: str, kind: str, batches: list[int], levels: list[int],
                  rounds: int) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        try:
            await _embed(client, model, inputs(kind, 2, 0, 0))  # warm-up: first load, both image sizes
        except Exception as exc:  # noqa: BLE001 - recorded; the cells would fail the same way
            return {"failed": f"{type(exc).__name__}: {exc}"}
        for batch in batches:
            for c in levels:
                try:
                    cells[f"{batch}x{c}"] = await _cell(client, model, kind, batch, c, rounds)
                except Exception as exc:  # noqa: BLE001 - one failing cell is reported, the others still run
                    cells[f"{batch}x{c}"] = {"failed": f"{type(exc).__name__}: {exc}"}
    return cells


def alive(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def min_cosine(a: dict[int, list[list[float]]], b: dict[int, list[list[float]]]) -> float:
    worst = 1.0
    for i, rows in a.items():
        for x, y in zip(rows, b[i], strict=True):
            x_, y_ = np.asarray(x, np.float64), np.asarray(y, np.float64)
            worst = min(worst, float(x_ @ y_ / (np.linalg.norm(x_) * np.linalg.norm(y_) + 1e-30)))
    return worst


def bench_kind(kind: str, args: argparse.Namespace, batches: list[int], levels: list[int]) -> dict[str, Any]:
    builder, name = MODELS[kind]
    folder = args.out / "models" / name  # the published name: vlmserve answers to a directory's base name
    if not folder.is_dir():
        shutil.copytree(build_pooling_model(builder), folder)
    results: dict[str, Any] = {}
    port = free_port()
    for spec in specs(folder, port, max(batches)):
        if spec.label not in args.servers:
            continue
        log = args.out / f"embed_bench-{kind}-{spec.label}.log"
        with serving(spec, port, dict(os.environ), log) as (problem, ready_s):
            if problem is not None:
                results[spec.label] = {"failed": problem, "log": str(log)}
                continue
            print(f"{kind}: {spec.label} ready in {ready_s:.1f} s", flush=True)
            url = f"http://127.0.0.1:{port}"
            results[spec.label] = asyncio.run(_server(url, spec.extra_body["model"], kind, batches, levels,
                                                      args.rounds))
            if not alive(url + spec.ready_path):  # its later cells' connection errors come from this
                results[spec.label]["server"] = f"exited during the run; see {log}"
    return results


def check(results: dict[str, Any]) -> None:
    """Each mlx_vlm cell gets ``min_cosine`` against vlmserve's; the vectors leave the JSON."""
    ours, peer = results.get("vlmserve", {}), results.get("mlx_vlm", {})
    for key, cell in peer.items():
        if isinstance(cell, dict) and "vectors" in cell and "vectors" in ours.get(key, {}):
            cell["min_cosine"] = round(min_cosine(ours[key]["vectors"], cell["vectors"]), 6)
    for server in (ours, peer):
        for cell in server.values():
            if isinstance(cell, dict):
                cell.pop("vectors", None)


def _cell_text(cell: Any) -> str:
    if not isinstance(cell, dict):
        return "-"
    if "failed" in cell:
        return "failed: " + cell["failed"].replace("|", "/").replace("\n", " ")[:80]
    return f"{cell['emb_s']} ({cell['p50_ms']} ms)"


def table(summary: dict[str, Any]) -> str:
    lines = ["| input | batch | c | vlmserve emb/s (p50) | mlx_vlm emb/s (p50) | ratio | min cosine |",
             "|---|---|---|---|---|---|---|"]
    for kind, results in summary["kinds"].items():
        ours, peer = results.get("vlmserve", {}), results.get("mlx_vlm", {})
        for key in summary["cells"]:
            a = ours.get(key, ours if "failed" in ours else None)
            b = peer.get(key, peer if "failed" in peer else None)
            ok = all(isinstance(x, dict) and "emb_s" in x for x in (a, b))
            ratio = f"{a['emb_s'] / b['emb_s']:.2f}x" if ok and b["emb_s"] else "-"
            cos = b.get("min_cosine", "-") if isinstance(b, dict) else "-"
            cos = f"**{cos} (differ)**" if isinstance(cos, float) and cos < COSINE_MIN else cos
            batch, c = key.split("x")
            lines.append(f"| {kind} | {batch} | {c} | {_cell_text(a)} | {_cell_text(b)} | {ratio} | {cos} |")
    deaths = [f"{kind}: {name} {server['server']}" for kind, results in summary["kinds"].items()
              for name, server in results.items() if "server" in server]
    return "\n".join(lines + [""] * bool(deaths) + deaths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,32", help="inputs per request")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=6, help="requests per cell: rounds x concurrency")
    parser.add_argument("--kinds", default="text,image,vl-text")
    parser.add_argument("--servers", default="vlmserve,mlx_vlm")
    parser.add_argument("--quick", action="store_true", help="two rounds per cell (about 1 minute here)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embed")
    args = parser.parse_args()
    library = find_openblas()
    if library is not None and not openblas_preloaded() and not os.environ.get("VLMSERVE_NO_OPENBLAS"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": library})
    if args.quick:
        args.rounds = 2
    batches, levels = [int(b) for b in args.batch.split(",")], [int(c) for c in args.concurrency.split(",")]
    args.servers = args.servers.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "blas": "OpenBLAS" if openblas_preloaded() else "reference", "rounds": args.rounds,
        "load_1m": round(os.getloadavg()[0], 2), "cells": [f"{b}x{c}" for b in batches for c in levels], "kinds": {}}
    for kind in args.kinds.split(","):
        summary["kinds"][kind] = results = bench_kind(kind, args, batches, levels)
        check(results)
    text = table(summary)
    print(f"BLAS: {summary['blas']}, rounds {args.rounds}, load {summary['load_1m']}\n{text}")
    (args.out / "embed_bench.md").write_text(text + "\n")
    (args.out / "embed_bench.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
