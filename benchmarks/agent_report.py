"""[main] agent_session.py's results as markdown (a table per session, summaries, grammar, sessions kept warm)
and a plot (TTFT per turn, warm against cold)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from report import _table

from vlmserve.config import EngineConfig, field_default

HIT = 0.9  # a resent prompt counts as a hit when this much of it was cached
GIB = 1 << 30


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fractions(rows: list[dict[str, Any]]) -> list[float | None]:
    """Each turn's cached tokens over the previous turn's whole prompt (None for the first)."""
    out: list[float | None] = [None]
    for prev, row in zip(rows, rows[1:]):
        ok = prev.get("prompt_tokens") and row.get("cached_tokens") is not None
        out.append(row["cached_tokens"] / prev["prompt_tokens"] if ok else None)
    return out


Fit = tuple[float, float]  # cold TTFT ~ a*n + b*n^2 seconds, n prompt tokens (the layers, then attention)


def cold_fit(runs: list[dict[str, Any]]) -> Fit | None:
    """``(a, b)`` through every measured cold TTFT of one model's sessions (a cold prefill's cost is its
    prompt's length: any session's samples serve all), least squares; linear through one; None without any."""
    import numpy as np

    points = [(r["prompt_tokens"], r["cold_ttft_s"]) for run in runs for r in run["rows"]
              if r.get("cold_ttft_s") and r.get("prompt_tokens")]
    if len({n for n, _ in points}) < 2:
        return (points[0][1] / points[0][0], 0.0) if points else None
    (a, b), *_ = np.linalg.lstsq(np.array([[n, n * n] for n, _ in points], float), np.array([t for _, t in points]))
    return float(a), float(b)


def cold_of(row: dict[str, Any], fit: Fit | None) -> tuple[float | None, bool]:
    """A turn's cold TTFT: measured (True), or from the fit (False)."""
    if row.get("cold_ttft_s"):
        return row["cold_ttft_s"], True
    if fit is None or not row.get("prompt_tokens"):
        return None, False
    return fit[0] * row["prompt_tokens"] + fit[1] * row["prompt_tokens"] ** 2, False


def session_table(run: dict[str, Any], fit: Fit | None) -> str:
    header = ["turn", "images", "prompt tokens", "cached tokens", "cached / previous prompt", "new tokens", "TTFT s",
              "request s", "cold TTFT s", "TTFT / cold"]
    rows = []
    for row, frac in zip(run["rows"], fractions(run["rows"])):
        new = (row["prompt_tokens"] or 0) - (row["cached_tokens"] or 0) if row.get("prompt_tokens") else None
        (cold, measured), ttft = cold_of(row, fit), row.get("ttft_s")
        itself = row.get("cold_from") == "itself"
        ratio = f"{'' if measured else '~'}{ttft / cold:.3f}" if cold and ttft and row["turn"] > 1 else "-"
        shown = "-" if cold is None else (f"{cold:.2f}" if measured else f"~{cold:.1f}")
        rows.append([row["turn"], row["images"], row.get("prompt_tokens"), row.get("cached_tokens"),
                     "-" if frac is None else f"{frac:.3f}", new, _s(ttft), _s(row.get("total_s")),
                     shown + (" (itself)" if itself else ""), ratio])
    return _table(header, rows)


def summary(run: dict[str, Any], fit: Fit | None) -> dict[str, Any]:
    """Issue 57's measures: the warm/cold ratio, the least cached fraction, later turns' time against the first."""
    rows, fracs = run["rows"], fractions(run["rows"])
    later = [r for r in rows[1:] if not r.get("error")]
    ratios = [r["ttft_s"] / r["cold_ttft_s"] for r in later if r.get("cold_ttft_s") and r.get("ttft_s")]
    colds = [(r, cold_of(r, fit)[0]) for r in later]
    all_ratios = [r["ttft_s"] / c for r, c in colds if c and r.get("ttft_s")]
    per_new = [r["ttft_s"] / max(1, r["prompt_tokens"] - r["cached_tokens"]) for r in later
               if r.get("ttft_s") and r.get("prompt_tokens") and r.get("cached_tokens") is not None]
    cold_per = [r["cold_ttft_s"] / r["prompt_tokens"] for r in rows if r.get("cold_ttft_s") and r.get("prompt_tokens")]
    first = rows[0].get("total_s") if rows and rows[0].get("cold_from") == "itself" else None
    median_later = _median([r["total_s"] for r in later if r.get("total_s")])
    least = min((f for f in fracs[1:] if f is not None), default=None)
    return {"turns": len(rows), "errors": sum(1 for r in rows if r.get("error")),
            "median_ttft_over_cold": _median(ratios), "cold_samples": len(ratios), "min_cached_fraction": least,
            "median_ttft_over_fitted_cold": _median(all_ratios), "cold_fit": fit,
            "median_later_request_s": median_later, "first_request_s": first,
            "later_over_first": median_later / first if first and median_later else None,
            "warm_ttft_s_per_new_token": _median(per_new), "cold_ttft_s_per_token": _median(cold_per)}


def summary_lines(run: dict[str, Any], fit: Fit | None) -> str:
    s = summary(run, fit)
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731 - a local formatter
    ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    done = (s["min_cached_fraction"] or 0) >= 0.95 and (s["later_over_first"] or 9) <= 0.3
    lines = [f"- median TTFT / cold TTFT over later turns: {f(s['median_ttft_over_cold'])} where measured "
             f"({s['cold_samples']}), {f(s['median_ttft_over_fitted_cold'])} over all (~: cold TTFT = a*n + b*n^2 "
             f"through the model's measured ones{'' if fit is None else f', a = {1000 * fit[0]:.2f} ms, b = {1e6 * fit[1]:.3f} us'}"
             ")",
             f"- least cached fraction of the previous prompt: {f(s['min_cached_fraction'])}",
             f"- median later request {f(s['median_later_request_s'], 2)} s / first (cold) request "
             f"{f(s['first_request_s'], 2)} s = {f(s['later_over_first'])}; issue 57's bar (>= 0.95 cached, <= 0.3x): "
             f"{'met' if done else 'NOT met'}",
             f"- TTFT per new token, later turns (median): {ms(s['warm_ttft_s_per_new_token'])} ms; cold TTFT per "
             f"prompt token: {ms(s['cold_ttft_s_per_token'])} ms"]
    if s["errors"]:
        lines.append(f"- {s['errors']} turns failed: {next(r['error'] for r in run['rows'] if r.get('error'))}")
    if run.get("mm_prefix_off"):
        lines.append(f"- --mm-prefix-cache is off for this family: the session stopped a turn after the first "
                     f"screenshot (turn {run['first_screenshot_turn']}); every turn from it is a whole prefill")
    return "\n".join(lines) + "\n"


def grammar_lines(g: dict[str, Any] | None, forced: dict[str, Any] | None) -> str:
    lines = []
    if g:
        lines.append(f"- in process, {g['tools']} tools ({g['schema_chars']:,} characters of schema), Hermes format, "
                     f"medians of {g['runs']}: llguidance tokenizer {_ms(g['tokenizer_s'])} ms (once per model), "
                     f"grammar cold {_ms(g['cold_s'])} ms, cached {1000 * g['cached_s']:.3f} ms, "
                     f"first mask {1000 * g['first_mask_s']:.2f} ms")
    if forced:
        lines.append(f"- through the server, the session's last prompt (cached), 2 tokens, tool_choice any: the first "
                     f"request {_ms(forced['forced_first_s'])} ms, later ones {_ms(forced['forced_again_s'])} ms; "
                     f"without tool_choice {_ms(forced['unforced_s'])} ms (medians of {forced['repeats']})")
    return "\n".join(lines) + "\n"


def warm_lines(w: dict[str, Any] | None) -> str:
    if not w:
        return ""
    hit = lambda rs: sum(1 for r in rs if r["prompt_tokens"] and (r["cached_tokens"] or 0) >= HIT * r["prompt_tokens"])  # noqa
    ttft = lambda rs: _ms(_median([r["total_s"] for r in rs if r.get("total_s")]))  # noqa: E731
    held, tokens = w["held"], _median([r["prompt_tokens"] for r in w["loads"] if r["prompt_tokens"]]) or 0
    bpt, entries = w.get("bytes_per_token") or 0, field_default(EngineConfig, "prefix_cache_entries")
    memory, disk = field_default(EngineConfig, "prefix_cache_bytes"), field_default(EngineConfig, "prefix_cache_disk_bytes")
    lines = [f"- sessions at turn {w['turn']} (~{tokens:.0f} tokens, {bpt * tokens / 2**20:.0f} MiB of KV each, "
             f"{bpt / 1024:.1f} KiB a token): the default prefix cache ({memory / GIB:.0f} GiB, {entries} entries) "
             f"held {held} of {w['sent']} sent one after another (evictions: {w.get('disk_files', '?')} written to disk, "
             f"{w['metrics_after_loads'].get('prefix_cache_budget_evictions', 0):.0f} for the KV budget)",
             f"- round-robin over K={held}: {hit(w['round_robin_held'])}/{len(w['round_robin_held'])} hits from memory, "
             f"request {ttft(w['round_robin_held'])} ms (median)",
             f"- round-robin over K={held + 1}: {hit(w['round_robin_one_more'])}/{len(w['round_robin_one_more'])} "
             f"prompts reused, {w['disk_hits']:.0f} of them read from --prefix-cache-dir, request "
             f"{ttft(w['round_robin_one_more'])} ms (median); cold: {ttft([w['cold']])} ms"]
    if bpt:
        per = lambda n: n * bpt  # noqa: E731
        lines.append(f"- at scale 1.0 a session's prompt is 25K -> 60K tokens, {per(25_000) / GIB:.2f} -> "
                     f"{per(60_000) / GIB:.2f} GiB: the default memory store keeps {int(memory // per(25_000))} -> "
                     f"{int(memory // per(60_000))} of them, the default disk tier ({disk / GIB:.0f} GiB) "
                     f"{int(disk // per(25_000))} -> {int(disk // per(60_000))}")
    return "\n".join(lines) + "\n"


def full_scale(result: dict[str, Any]) -> str:
    """The cold prefills at scale 1.0, from the text Messages session's fit (not run: each would take too long)."""
    fit = cold_fit(result.get("smolvlm", {}).get("sessions", []))
    if fit is None or fit[1] <= 0:
        return ""
    est = lambda n: fit[0] * n + fit[1] * n * n  # noqa: E731
    return (f"### Full scale, estimated\n\n- a cold prefill of 25K tokens would take ~{est(25_000) / 60:.0f} min here "
            f"and of 60K ~{est(60_000) / 60:.0f} min (the fit through SmolVLM's cold TTFTs); not run\n")


def render(result: dict[str, Any]) -> str:
    m, smol = result.get("machine", {}), result.get("smolvlm", {})
    runs = [r for model in ("smolvlm", "qwen") for r in result.get(model, {}).get("sessions", [])]
    sizes = ", ".join(f"{r['name']} {r['rows'][0]['prompt_tokens'] or 0:,} -> {r['rows'][-1]['prompt_tokens'] or 0:,}"
                      for r in runs if r["rows"])
    parts = [f"## Agent session (scale {result['args']['scale']}: {result['first']:,} -> {result['last']:,} tokens aimed "
             f"at, {result['args']['turns']} turns, max_tokens {result['args']['max_tokens']})\n",
             f"Prompt tokens, first -> last turn: {sizes}\n",
             f"{m.get('date')}, {m.get('cpus')} CPUs, mlx {m.get('mlx')}, OpenBLAS preloaded: "
             f"{m.get('openblas_preloaded')}, load average at the end {m.get('loadavg_1m_at_end')}; "
             f"the whole run {result.get('wall_s', 0) / 60:.1f} min\n"]
    if smol.get("grammar") or smol.get("forced_tool"):
        parts += ["### Tool grammar\n", grammar_lines(smol.get("grammar"), smol.get("forced_tool"))]
    if smol.get("kept_warm"):
        parts += ["### Sessions kept warm\n", warm_lines(smol["kept_warm"])]
    parts.append(full_scale(result))
    for model in ("smolvlm", "qwen"):
        runs = result.get(model, {}).get("sessions", [])
        fit = cold_fit(runs)
        for run in runs:
            parts += [f"### {run['name']} ({run['shape']}, {Path(result[model]['model']).name})\n",
                      summary_lines(run, fit), "\n", session_table(run, fit)]
    return "\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for model in ("smolvlm", "qwen") for r in result.get(model, {}).get("sessions", [])]
    fits = {id(r): cold_fit(result[model]["sessions"]) for model in ("smolvlm", "qwen") if model in result
            for r in result[model]["sessions"]}
    if not runs:
        return
    cols = min(3, len(runs))
    rows_n = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.6 * cols, 3.2 * rows_n), dpi=90, squeeze=False)
    for ax, run in zip(axes.flat, runs):
        rows, fit = run["rows"], fits[id(run)]
        turns = [r["turn"] for r in rows]
        ax.plot(turns, [r["ttft_s"] or 0 for r in rows], "o-", ms=3, label="TTFT (warm)")
        if fit is not None:
            ax.plot(turns, [cold_of(r, fit)[0] or 0 for r in rows], "--", color="C3", lw=1, label="cold (fit)")
        cold = [r for r in rows if r.get("cold_ttft_s")]
        ax.plot([r["turn"] for r in cold], [r["cold_ttft_s"] for r in cold], "s", color="C3", label="cold TTFT")
        for r in rows[1:]:
            if r["images"] > rows[r["turn"] - 2]["images"]:
                ax.axvline(r["turn"], color="grey", ls=":", lw=1)
        ax.set(xlabel="turn", ylabel="seconds", yscale="log", title=run["name"])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Agent session, scale {result['args']['scale']}: TTFT per turn, warm against a cold prefill "
                 "(dotted: a screenshot)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
