"""[main] The issue's targets, checked against one compare run: each with its measured value and a verdict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from report import _get, whole

OURS, PEER = "vlmserve", "mlx_vlm"


def _by_label(results: Sequence[dict[str, Any]], label: str) -> dict[str, Any]:
    """A server's scenarios in which every request succeeded (a partial one measures nothing)."""
    found = next((r for r in results if r["label"] == label), {"scenarios": {}})
    return {"scenarios": {k: v for k, v in found["scenarios"].items() if k == "liveness" or k == "cancel" or whole(v)}}


def _row(target: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"target": target, "measured": measured, "met": met}


def _all(values: list[Any], ok: Any) -> bool | None:
    return None if not values or any(v is None for v in values) else all(ok(v) for v in values)


def evaluate(results: Sequence[dict[str, Any]], step: dict[str, Any] | None) -> list[dict[str, Any]]:
    ours, peer = _by_label(results, OURS)["scenarios"], _by_label(results, PEER)["scenarios"]
    rows = []

    for key, what in (("tok_s", "the raw decode step (as defined in the issue)"),
                      ("workload_tok_s", "the raw step with each request's prefill counted")):
        effs = []
        for b in (1, 2, 4, 8):
            served, raw = _get(ours, f"concurrency/{b}", "tok_s"), _get(step, "decode", str(b), key)
            effs.append(round(served / raw, 2) if served and raw else None)
        rows.append(_row(f"engine efficiency >= 0.9 of {what} at batch 1, 2, 4, 8",
                         ", ".join(f"B={b}: {e}" for b, e in zip((1, 2, 4, 8), effs)), _all(effs, lambda e: e >= 0.9)))

    a, b = _get(ours, "concurrency/8", "tok_s"), _get(peer, "concurrency/8", "tok_s")
    ratio = round(a / b, 2) if a and b else None
    rows.append(_row("tok/s at concurrency 8 >= 1.2x mlx_vlm.server", f"{a} vs {b} tok/s = {ratio}x",
                     None if ratio is None else ratio >= 1.2))

    pairs = [(_get(ours, f"concurrency/{c}", "ttft_ms", "p90"), _get(peer, f"concurrency/{c}", "ttft_ms", "p90"))
             for c in (4, 8)]
    rows.append(_row("TTFT p90 lower than mlx_vlm.server at concurrency 4 and 8",
                     ", ".join(f"c={c}: {x} vs {y} ms" for c, (x, y) in zip((4, 8), pairs)),
                     _all(pairs, lambda p: p[0] is not None and p[1] is not None and p[0] < p[1])
                     if all(None not in p for p in pairs) else None))

    spread = _get(ours, "burst", "ttft_p90_over_p50")
    rows.append(_row("staggered burst TTFT p90/p50 <= 1.5", f"{spread} (p50/p90 {_get(ours, 'burst', 'ttft_ms', 'p50')}/"
                     f"{_get(ours, 'burst', 'ttft_ms', 'p90')} ms)", None if spread is None else spread <= 1.5))

    probe = _get(ours, "liveness", "probe_ms", "max")
    rows.append(_row("/health max probe latency under load < 50 ms",
                     f"max {probe} ms, p99 {_get(ours, 'liveness', 'probe_ms', 'p99')} ms", None if probe is None else probe < 50))

    extra = _get(ours, "cancel", "extra_steps")
    rows.append(_row("a cancelled request's slot is reused within one decode step",
                     f"{extra} extra steps (TTFT {_get(ours, 'cancel', 'ttft_after_cancel_ms')} ms after a cancel vs "
                     f"{_get(ours, 'cancel', 'ttft_free_slot_ms')} ms with a free slot; step "
                     f"{_get(ours, 'cancel', 'step_ms')} ms)", None if extra is None else extra <= 1.0))
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["### Targets (vlmserve)\n", "| target | measured | met |", "|---|---|---|"]
    verdict = {True: "yes", False: "**no**", None: "n/a"}
    lines += [f"| {r['target']} | {r['measured']} | {verdict[r['met']]} |" for r in rows]
    return "\n".join(lines) + "\n"
