"""[main] stall_bench's results as text and a plot: the stall table, the c=8 mixed-traffic table with
ratios against mlx_vlm.server, the README block, and several runs merged into one."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import _table

HERE = Path(__file__).resolve().parent
PLOT = "stall_gaps.png"
SECTION = ("<!-- stall_bench:start -->", "<!-- stall_bench:end -->")
REAL = "smolvlm_real"  # the real-weights SmolVLM cell (real_weights.py)
PEER = "mlx_vlm.server"  # what the ratios divide by
STALL_KEYS = ("stall_ratio", "longest_gap_ms", "median_gap_ms", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
              "last_done_s", "images_with_stream")


def _mixed(run: dict[str, Any], key: str) -> Any:
    return (run.get("mixed") or {}).get(key)


def _c8_tok_s(run: dict[str, Any]) -> str | None:
    """The mixed run's tok/s, with how many of its requests failed (and why) if any did."""
    mixed = run.get("mixed") or {}
    if "failed" in mixed:
        return f"failed: {mixed['failed'][:60]}"
    failed = mixed.get("requests", 0) - mixed.get("ok", 0)
    errors = f" ({failed}/{mixed['requests']} failed: {'; '.join(mixed.get('errors', []))[:60]})" if failed else ""
    tok_s = mixed.get("tok_s")
    return None if tok_s is None and not errors else f"{'–' if tok_s is None else tok_s}{errors}"


def _c8_ttft_p90_s(run: dict[str, Any]) -> float | None:
    ms = (_mixed(run, "ttft_ms") or {}).get("p90")
    return round(ms / 1000, 2) if ms is not None else None


# One number per run; the ratio columns divide a server's by mlx_vlm.server's of the same run.
MEASURES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "image TTFT p50": lambda r: r.get("ttft_p50_s"), "image TTFT max": lambda r: r.get("ttft_max_s"),
    "last image done": lambda r: r.get("last_done_s"),
    "c=8 tok/s": lambda r: _mixed(r, "tok_s"), "c=8 TTFT p90": _c8_ttft_p90_s,
}


def cell_name(cell: dict[str, Any]) -> str:
    if cell["arch"] == REAL:
        return "real-weights SmolVLM float32 (stock BLAS)"
    return f"{cell['arch']} {cell['dtype']}{' + OpenBLAS' if cell['machine']['openblas_preloaded'] else ''}"


def _failure(server: dict[str, Any]) -> str | None:
    """Why a server has no results at all (it did not start, or every run failed)."""
    if "failed" in server:
        return server["failed"]
    runs = server.get("runs", [])
    if runs and all("failed" in r and "mixed" not in r for r in runs):
        return runs[0]["failed"]
    return None


def _per_run(values: list[Any]) -> str:
    return " / ".join("–" if v is None else str(v) for v in values)


def stall_table(summary: dict[str, Any]) -> str:
    header = ["model", "server", "stall ratio", "longest gap ms", "median gap ms", "image TTFT p50 s",
              "image TTFT p90 s", "image TTFT max s", "last image done s", "images started while the stream ran"]
    rows = []
    for cell in summary["cells"]:
        for s in cell["servers"]:
            runs = [r for r in s.get("runs", []) if "failed" not in r]
            failures = [s["failed"]] if "failed" in s else [r["failed"] for r in s.get("runs", []) if "failed" in r]
            cells = [" / ".join(dict.fromkeys(str(r[k]) for r in runs)) if k == STALL_KEYS[-1]
                     else _per_run([r.get(k) for r in runs]) for k in STALL_KEYS]
            rows.append([cell_name(cell), s["label"], *cells] if runs else
                        [cell_name(cell), s["label"], f"failed: {failures[0][:80]}", *[""] * (len(STALL_KEYS) - 1)])
    return _table(header, rows)


def mixed_table(summary: dict[str, Any]) -> str:
    header = ["model", "server", "c=8 mixed tok/s", "c=8 mixed TTFT p90 s",
              *(f"{m} vs {PEER}" for m in MEASURES)]
    rows = []
    for cell in summary["cells"]:
        peer = next((s for s in cell["servers"] if s["label"] == PEER), None)
        for s in cell["servers"]:
            if (why := _failure(s)) is not None:
                rows.append([cell_name(cell), s["label"], f"failed: {why[:80]}", *[""] * (len(header) - 3)])
                continue
            runs = s.get("runs", [])
            own = [_per_run([_c8_tok_s(r) for r in runs]), _per_run([_c8_ttft_p90_s(r) for r in runs])]
            ratios = ["" if s is peer else _per_run(ratios_of(s, peer, m) if peer else []) or "–" for m in MEASURES]
            rows.append([cell_name(cell), s["label"], *own, *ratios])
    return _table(header, rows)


def ratios_of(server: dict[str, Any], peer: dict[str, Any], measure: str) -> list[str | None]:
    """``server``'s value over the peer's, run by run (the same burst of pictures, the same prompts)."""
    get, out = MEASURES[measure], []
    for mine, theirs in zip(server.get("runs", []), peer.get("runs", [])):
        a, b = get(mine), get(theirs)
        out.append(f"{a / b:.2f}x" if a is not None and b else None)
    return out


def render(summary: dict[str, Any]) -> str:
    return (stall_table(summary) + "\nEach cell: one value per run (fresh pictures each run), in order; the last "
            "column once if equal.\n\nc=8 mixed traffic (serve_bench's mixed scenario, before the stall runs, on the "
            f"same server process), and ratios to {PEER}'s in the same run (TTFT: under 1 is faster; tok/s: "
            "over 1 is faster):\n\n" + mixed_table(summary))


def heading(summary: dict[str, Any]) -> str:
    m, loads, again = summary["cells"][0]["machine"], load_averages(summary), summary.get("invocations", 1)
    runs = f"{summary['runs']} runs per server" + (f" ({again} invocations, each server started afresh in each)"
                                                   if again > 1 else " (one server process)")
    archs = {c["arch"] for c in summary["cells"]}
    models = "; ".join(([] if archs == {REAL} else ["small models built with `ignore_eos=True`"]) + (
        ["the real-weights SmolVLM (SmolLM2-135M's text tower, 163 M parameters) with its special tokens' output "
         "rows zeroed, float32 on the stock wheel"] if REAL in archs else []))
    return (f"{m['date']}, {m['cpus']} CPUs, mlx {m['mlx']} ({m['device']}), {models}, {runs}, 1-min load "
            f"average {min(loads)}-{max(loads)} at the cells' starts and ends (the servers under test included), "
            f"{summary['wall_s'] / 60:.1f} minutes in all.\n")


def load_averages(summary: dict[str, Any]) -> list[float]:
    """The 1-minute load averages taken at each cell's start and end."""
    return summary.get("loads") or [x for c in summary["cells"]
                                    for x in (c["loadavg_1m_at_start"], c["machine"]["loadavg_1m_at_end"])]


def plot(cells: list[dict[str, Any]], path: Path, images: int, size: int) -> None:
    """One panel per model and dtype: each server's gaps in its first run, over time since the images were sent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.6 * rows), dpi=90, squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.axis("off")
    for ax, cell in zip(axes.flat, cells):
        firsts = [(s["label"], next((r for r in s.get("runs", []) if "gaps" in r), None)) for s in cell["servers"]]
        for label, run in firsts:
            waited = run is not None and run["images_with_stream"].startswith("0/")
            gaps = run["gaps"] if run else []
            ax.plot([t for t, _ in gaps], [g for _, g in gaps], ".-", ms=3, lw=0.8,
                    label=label + (" (images wait for the stream to end)" if waited else ""))
        # A server that holds the images until the stream ends stretches the axis with a quiet stream.
        alongside = [r["burst_s"] for _, r in firsts if r and not r["images_with_stream"].startswith("0/")]
        if alongside:
            ax.set_xlim(-0.2, 1.3 * max(alongside))
        ax.set(xlabel="seconds since the images were sent", ylabel="gap between stream chunks, ms", yscale="log",
               title=cell_name(cell))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"A stream's gaps while {images} fresh {size}px image prompts arrive (run 1)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of the benchmark as one: each server's runs in order, the machine of the first."""
    first = summaries[0]
    cells = [{**c, "servers": [dict(s) for s in c["servers"]]} for c in first["cells"]]
    for other in summaries[1:]:
        for cell, again in zip(cells, other["cells"]):
            assert (cell["arch"], cell["dtype"]) == (again["arch"], again["dtype"]), "merge runs of one grid"
            for server, more in zip(cell["servers"], again["servers"]):
                assert server["label"] == more["label"], "merge runs of the same servers"
                server["runs"] = server.get("runs", []) + more.get("runs", [])
    return {**first, "cells": cells, "runs": sum(s["runs"] for s in summaries),
            "loads": [x for s in summaries for x in load_averages(s)],
            "wall_s": sum(s["wall_s"] for s in summaries), "invocations": len(summaries)}


def write_readme(summary: dict[str, Any], out: Path) -> None:
    """Replace the README's stall_bench block (between its markers) with these results and plot."""
    shutil.copy(out / PLOT, HERE / PLOT)
    block = f"{SECTION[0]}\n{heading(summary)}\n{render(summary)}\n![stall]({PLOT})\n{SECTION[1]}"
    readme = HERE / "README.md"
    body = readme.read_text()
    if SECTION[0] in body:
        before, rest = body.split(SECTION[0], 1)
        body = before + block + rest.split(SECTION[1], 1)[1]
    else:
        body = body.rstrip() + "\n\n## The stall: a stream while image prompts arrive (stall_bench)\n\n" + block + "\n"
    readme.write_text(body)
    print(f"wrote the stall_bench block into {readme}")
