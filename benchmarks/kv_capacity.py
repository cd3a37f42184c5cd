"""[main] How much context a fixed KV budget holds, per ``--kv-bits`` (issue 45), measured in-process.

    python benchmarks/kv_capacity.py [--budget-gb 1] [--request 4096] [--bits none,8,4]
        [--models smollm2:float32,smollm2:bfloat16,qwen2_5_vl:bfloat16,gemma4:bfloat16] [--out FILE]

For each model and bit width it starts an ``AsyncEngine`` (``EngineConfig(kv_bits=..., kv_group_size=...,
quantized_kv_start=0, kv_cache_bytes=budget, dtype=...)``), reads the footprint the engine measured from a
real prefilled cache (``engine.kv``: bytes per full-attention position, sliding-window layers and fixed
state) and asks the engine's own budget how much fits: the longest single context (``row_bytes(n) <=
budget``; the model's own context limit is shown beside it, not applied) and how many ``--request``-
position requests fit together (``KVBudget.batch_bytes``). Models: the real-weights SmolVLM/SmolLM2-135M
(``real_weights.py``; head size 64, groups of 64) served in float32 or bfloat16 (``EngineConfig.dtype``),
and ``vlmserve.testing``'s qwen2_5_vl/small and gemma4/small (groups of 32). It restarts itself with
OpenBLAS preloaded when one is installed (float32 start-up is faster). Prints a markdown table and writes
``benchmarks/results/kv_capacity.json`` (and ``.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from report import _table

from vlmserve.blas import find_openblas, openblas_preloaded
from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
GROUP = {"smollm2": 64, "qwen2_5_vl": 32, "gemma4": 32}  # values per scale; must divide the head size
DEFAULT_MODELS = "smollm2:float32,smollm2:bfloat16,qwen2_5_vl:bfloat16,gemma4:bfloat16"


def model_path(name: str) -> Path:
    if name == "smollm2":
        from real_weights import build_smolvlm_smollm2

        return Path(build_smolvlm_smollm2())
    from vlmserve.testing import build_model

    return Path(build_model(name, "small"))


def longest_context(row_bytes: Any, limit: int) -> int:
    """The most positions one row may hold within ``limit`` bytes (``row_bytes`` never decreases)."""
    lo, hi = 0, 1
    while row_bytes(hi) <= limit and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if row_bytes(mid) <= limit else (lo, mid)
    return lo


def requests_that_fit(budget: Any, positions: int) -> int:
    """How many rows of ``positions`` the engine's budget holds together (its own ``batch_bytes``)."""
    n = 0
    while budget.batch_bytes([positions] * (n + 1)) <= budget.limit_bytes:
        n += 1
    return n


async def measure(path: Path, dtype: str, bits: int | None, group: int, budget_bytes: int,
                  request: int) -> dict[str, Any]:
    """One engine's footprint and what fits in its budget."""
    from vlmserve.engine.engine_config import EngineConfig
    from vlmserve.frontend.async_engine import AsyncEngine

    config = EngineConfig(kv_bits=bits, kv_group_size=group, quantized_kv_start=0, kv_cache_bytes=budget_bytes,
                          dtype=dtype, max_batch_size=1)
    engine = AsyncEngine(str(path), config=config)
    await engine.start(warmup=False)  # the footprint comes from a real prefill of its own probe
    try:
        assert engine.kv is not None and engine.loaded is not None
        kv, fp = engine.kv, engine.kv.footprint
        quant = engine.loaded.adapter.kv_quant
        return {"kv_bits": bits, "group_size": group if bits else None, "quantized": quant is not None,
                "kv_quant_off": engine.kv_quant_off, "per_position": fp.per_position,
                "windows": [list(w) for w in fp.windows], "fixed": fp.fixed,
                "row_bytes_per_position": round(fp.row_bytes(request) / request, 1),
                "row_bytes_request": fp.row_bytes(request), "model_max_context": engine.loaded.max_context,
                "longest_context": longest_context(fp.row_bytes, budget_bytes),
                "requests_that_fit": requests_that_fit(kv, request)}
    finally:
        await engine.shutdown()


def text_dims(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return {"layers": text["num_hidden_layers"], "kv_heads": text["num_key_value_heads"], "head_dim": head,
            "sliding_window": text.get("sliding_window")}


def render(summary: dict[str, Any]) -> str:
    budget, request = summary["budget_bytes"], summary["request"]
    header = ["model", "dtype", "kv bits", "group", "KiB/position (full attn)", "KiB/position at "
              f"{request}", "vs full precision", f"longest context in {budget / 2**30:g} GiB",
              "model's max context", f"{request}-token requests that fit"]
    rows = []
    for m in summary["models"]:
        base = next((c for c in m["cells"] if c["kv_bits"] is None), None)
        for c in m["cells"]:
            ratio = (f"{base['row_bytes_request'] / c['row_bytes_request']:.2f}x smaller"
                     if base and c is not base else "-")
            bits = str(c["kv_bits"] or "none") + ("" if c["kv_bits"] is None or c["quantized"] else " (off)")
            rows.append([m["model"], m["dtype"], bits, c["group_size"] or "-", f"{c['per_position'] / 1024:.2f}",
                         f"{c['row_bytes_per_position'] / 1024:.2f}", ratio, f"{c['longest_context']:,}",
                         f"{c['model_max_context']:,}", c["requests_that_fit"]])
    notes = "".join(f"\n- {m['model']}: {m['dims']}" for m in summary["models"])
    return _table(header, rows) + "\nText towers (layers, KV heads, head size, sliding window):" + notes + "\n"


def reexec_with_openblas(argv: list[str]) -> None:
    library = find_openblas()
    if library and not openblas_preloaded() and not os.environ.get("VLMSERVE_NO_OPENBLAS"):
        env = dict(os.environ, LD_PRELOAD=":".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p))
        os.execve(sys.executable, [sys.executable, __file__, *argv], env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=1.0)
    parser.add_argument("--request", type=int, default=4096, help="positions of each request that must fit")
    parser.add_argument("--bits", default="none,8,4")
    parser.add_argument("--models", default=DEFAULT_MODELS, help="NAME:DTYPE, comma-separated (smollm2, qwen2_5_vl, "
                        "gemma4)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kv_capacity.json")
    args = parser.parse_args(argv)
    reexec_with_openblas(argv)
    budget = int(args.budget_gb * 2**30)
    bits_list = [None if b == "none" else int(b) for b in args.bits.split(",")]
    models = [spec.split(":") for spec in args.models.split(",")]
    summary: dict[str, Any] = {"budget_bytes": budget, "request": args.request, "openblas": openblas_preloaded(),
                               "models": []}
    with progress(total=len(models) * len(bits_list), desc="kv capacity", unit="engine", file=sys.stderr) as bar:
        for name, dtype in models:
            path = model_path(name)
            cells = []
            for bits in bits_list:
                bar.set_postfix_str(f"{name} {dtype} kv_bits={bits}")
                cells.append(asyncio.run(measure(path, dtype, bits, GROUP[name], budget, args.request)))
                bar.update(1)
            summary["models"].append({"model": name, "path": str(path), "dtype": dtype, "dims": text_dims(path),
                                      "cells": cells})
    text = render(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    args.out.with_suffix(".md").write_text(text)
    print(text)
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
