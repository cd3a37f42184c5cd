"""[main] Markdown tables and PNG plots from serve_bench results (one server, or several side by side).

``step`` (step_bench's JSON) adds the raw batched decode step and each server's efficiency
against it; with exactly two servers every table gets a ratio column (first / second).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def _get(d: Any, *keys: Any) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else _fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _levels(results: Sequence[Result]) -> list[int]:
    names = {k for r in results for k in r["scenarios"] if k.startswith("concurrency/")}
    return sorted(int(k.split("/")[1]) for k in names)


def _triple(s: Any, key: str) -> str:
    return "/".join(_fmt(_get(s, key, q)) for q in ("p50", "p90", "max"))


def _errors(s: Any) -> str:
    if _get(s, "failed"):
        return f"FAILED: {s['failed'][:80]}"
    errs = _get(s, "errors") or []
    bad = (_get(s, "requests") or 0) - (_get(s, "ok") or 0)
    return f"{bad} failed: {errs[0][:80]}" if bad and errs else ""


def whole(s: Any) -> Any:
    """The scenario if every request in it succeeded, else None: partial numbers get no ratios."""
    return s if isinstance(s, dict) and not s.get("failed") and s.get("ok") == s.get("requests") else None


def _tok_s(s: Any) -> Any:
    if s is None or whole(s) is not None:
        return _get(s, "tok_s")
    return f"{_fmt(_get(s, 'tok_s'))} ({_get(s, 'ok') or 0}/{_get(s, 'requests') or '?'} ok)"


def sweep_table(results: Sequence[Result]) -> str:
    pair = len(results) == 2
    header = ["conc"]
    for r in results:
        header += [f"{r['label']} tok/s", f"{r['label']} TTFT p50/p90/max ms", f"{r['label']} latency p50/p90 ms",
                   f"{r['label']} ITL p50 ms"]
    header += ["tok/s ratio", "TTFT p90 ratio"] if pair else []
    rows = []
    for c in _levels(results):
        s = [r["scenarios"].get(f"concurrency/{c}") for r in results]
        row: list[Any] = [c]
        w = [whole(one) for one in s]
        for one in s:
            lat = "/".join(_fmt(_get(one, "latency_ms", q)) for q in ("p50", "p90"))
            row += [_tok_s(one), _triple(one, "ttft_ms") + (" " + _errors(one) if _errors(one) else ""),
                    lat, _get(one, "itl_ms", "p50")]
        if pair:
            row += [_ratio(_get(w[0], "tok_s"), _get(w[1], "tok_s")),
                    _ratio(_get(w[0], "ttft_ms", "p90"), _get(w[1], "ttft_ms", "p90"))]
        rows.append(row)
    return _table(header, rows)


def efficiency_table(results: Sequence[Result], step: Result) -> str:
    """Server tok/s at concurrency B over the raw decode step's tok/s at batch B."""
    header = ["B", "raw ms/step", "raw decode tok/s", "raw tok/s with prefill"]
    for r in results:
        header += [f"{r['label']} tok/s", f"{r['label']} eff", f"{r['label']} eff with prefill", f"{r['label']} decode eff"]
    rows = []
    for c in _levels(results):
        raw = _get(step, "decode", str(c))
        row: list[Any] = [c, _get(raw, "ms_per_step"), _get(raw, "tok_s"), _get(raw, "workload_tok_s")]
        for r in results:
            s = whole(r["scenarios"].get(f"concurrency/{c}"))
            slots = min(c, r["config"]["slots"])
            itl = _get(s, "itl_ms", "mean")
            decode_tok_s = slots * 1000 / itl if itl else None  # every running row gets a token per step
            row += [_get(s, "tok_s"), _ratio(_get(s, "tok_s"), _get(raw, "tok_s")),
                    _ratio(_get(s, "tok_s"), _get(raw, "workload_tok_s")), _ratio(decode_tok_s, _get(raw, "tok_s"))]
        rows.append(row)
    return _table(header, rows).replace("x |", " |")


def scenario_table(results: Sequence[Result]) -> str:
    """Burst, mixed traffic, liveness and cancel: one row per measure, one column per server."""
    def column(r: Result) -> dict[str, Any]:
        sc = r["scenarios"]
        b, m, live, cancel = sc.get("burst"), sc.get("mixed"), sc.get("liveness"), sc.get("cancel")
        out: dict[str, Any] = {
            "burst TTFT p50/p90/max ms": _triple(b, "ttft_ms") + (" " + _errors(b) if _errors(b) else ""),
            "burst TTFT p90/p50": _get(b, "ttft_p90_over_p50"),
            "mixed tok/s": _tok_s(m),
            "mixed TTFT p50/p90/max ms": _triple(m, "ttft_ms") + (" " + _errors(m) if _errors(m) else ""),
        }
        for kind, v in (_get(m, "by_kind") or {}).items():
            out[f"mixed {kind}: ok, TTFT max ms"] = f"{v['ok']}/{v['of']}, {_fmt(v['ttft_ms_max'])}"
        out[f"liveness probe p99/max ms ({_get(live, 'path')})"] = "/".join(
            _fmt(_get(live, "probe_ms", q)) for q in ("p99", "max")) + (f" FAILED: {live['failed']}" if _get(live, "failed") else "")
        out["liveness probes (failed)"] = f"{_get(live, 'probes')} ({_get(live, 'failures')})"
        out["liveness streams tok/s"] = _tok_s(_get(live, "streams"))
        out["cancel: decode step ms (batch full)"] = _get(cancel, "step_ms")
        out["cancel: follower TTFT ms, one slot free"] = _get(cancel, "ttft_free_slot_ms")
        out["cancel: follower TTFT ms, slot just cancelled"] = _get(cancel, "ttft_after_cancel_ms")
        out["cancel: extra steps to reuse the slot"] = _get(cancel, "extra_steps")
        if _get(cancel, "failed") or _get(cancel, "errors"):
            out["cancel: error"] = _get(cancel, "failed") or _get(cancel, "errors")[0][:100]
        return out

    columns = [column(r) for r in results]
    keys = list(dict.fromkeys(k for c in columns for k in c))
    header = ["measure", *(r["label"] for r in results)] + (["ratio"] if len(results) == 2 else [])
    rows = []
    for key in keys:
        row = [key, *(c.get(key) for c in columns)]
        if len(results) == 2:
            a, b = columns[0].get(key), columns[1].get(key)
            row.append(_ratio(a, b) if isinstance(a, (int, float)) else "")
        rows.append(row)
    return _table(header, rows)


def markdown(results: Sequence[Result], step: Result | None = None) -> str:
    parts = ["### Concurrency sweep (equal output lengths)\n", sweep_table(results)]
    if step is not None:
        parts += ["\n### Engine efficiency (server tok/s at concurrency B / raw decode step tok/s at batch B)\n",
                  efficiency_table(results, step)]
    parts += ["\n### Burst, mixed traffic, liveness, cancel\n", scenario_table(results)]
    return "\n".join(parts)


def plots(results: Sequence[Result], out: Path, prefix: str, step: Result | None = None) -> list[Path]:
    """Throughput vs concurrency, and the TTFT distribution per level; small PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = _levels(results)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for r in results:
        ax.plot(levels, [_get(r["scenarios"], f"concurrency/{c}", "tok_s") or 0 for c in levels], "o-", label=r["label"])
    if step is not None:
        ax.plot(levels, [_get(step, "decode", str(c), "tok_s") or 0 for c in levels], "k--", label="raw decode step")
    ax.set(xscale="log", xlabel="concurrency", ylabel="aggregate tok/s", title="Throughput vs concurrency")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths = [out / f"{prefix}_throughput.png"]
    fig.tight_layout()
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.6), dpi=90)
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        data = [_get(r["scenarios"], f"concurrency/{c}", "ttfts_ms") or [0] for c in levels]
        pos = [j + (i - (len(results) - 1) / 2) * width for j in range(len(levels))]
        box = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True, showfliers=True)
        for patch in box["boxes"]:
            patch.set_facecolor(f"C{i}")
        ax.plot([], [], "s", color=f"C{i}", label=r["label"])
    ax.set_xticks(range(len(levels)), [str(c) for c in levels])
    ax.set(xlabel="concurrency", ylabel="TTFT ms", yscale="log", title="TTFT distribution")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    paths.append(out / f"{prefix}_ttft.png")
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close(fig)
    return paths
