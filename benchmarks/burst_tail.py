"""[main] What the last image's tail is made of (issue 60), for ``burst_timeline.py``.

The engine's worker is instrumented in process: when each request reached the scheduler (phase 1 done),
when it was admitted to a batch row, and inside every step the seconds of the decode forward (synchronised
here, so it is not hidden behind the next step's work), of the vision tower and of the prompt pieces.
The last image's life is cut in four segments (phase 1: preprocessing, before the engine sees it; waiting
for a batch row; its prompt, from admission to its first token; its answer, to its last token) and each
segment's seconds are split by what the engine did in them: decode forwards inside prompt-bearing steps,
decode-only steps, vision, prefill, the rest of the steps (planning, sampling, joins) and idle time between
steps. The decode synchronisation costs the pipelining's overlap: the burst runs a little slower than
unmeasured.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

COLUMNS = ("decode in prompt steps", "decode-only steps", "vision", "prefill", "step rest", "idle")


def instrument(core: Any, steps: list[dict[str, Any]], queued: dict[str, float]) -> None:
    """On the worker: time each step's decode, encode and prefill into ``steps[-1]``; note when each
    request reaches the scheduler in ``queued``."""
    runner, scheduler = core.runner, core.scheduler
    add, decode, encode, prefill = scheduler.add, runner.decode, runner._encode_all, runner._prefill_all

    def timed(fn: Any, key: str, sync: bool = False) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args)
            if sync:
                mx.synchronize()
            if steps:
                steps[-1][key] = steps[-1].get(key, 0.0) + time.perf_counter() - start
            return result
        return wrapper

    def added(req: Any) -> None:
        queued[req.request_id] = time.perf_counter()
        add(req)

    scheduler.add = added
    runner.decode = timed(decode, "decode_s", sync=True)
    runner._encode_all = timed(encode, "encode_s")
    runner._prefill_all = timed(prefill, "prefill_s")


def split(step: dict[str, Any]) -> dict[str, float]:
    """One step's seconds by column (idle is between steps, not in them)."""
    plan, total = step["plan"], step.get("s", 0.0)
    prompt = bool(plan.encode or plan.prefill)
    decode, vision, prefill = step.get("decode_s", 0.0), step.get("encode_s", 0.0), step.get("prefill_s", 0.0)
    if not prompt:
        return {"decode-only steps": total}
    rest = max(total - decode - vision - prefill, 0.0)
    return {"decode in prompt steps": decode, "vision": vision, "prefill": prefill, "step rest": rest}


def window(steps: list[dict[str, Any]], a: float, b: float) -> dict[str, float]:
    """Seconds of ``[a, b]`` by column: each step's parts scaled by how much of it lies inside."""
    row = dict.fromkeys(COLUMNS, 0.0)
    busy = 0.0
    for step in steps:
        start = step.get("t0")
        if start is None or "s" not in step:
            continue
        end = start + step["s"]
        inside = max(0.0, min(end, b) - max(start, a))
        if inside <= 0 or step["s"] <= 0:
            continue
        busy += inside
        for key, seconds in split(step).items():
            row[key] += seconds * inside / step["s"]
    row["idle"] = max(b - a - busy, 0.0)
    return row


def last_image_tail(steps: list[dict[str, Any]], life: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The last image (by first token): its segments, each split by column. ``life`` holds, per request,
    its ``sent``, ``queued``, ``admitted``, ``first`` and ``done`` times (perf_counter)."""
    name = max(life, key=lambda r: life[r]["first"])
    t = life[name]
    marks = [("phase 1", t["sent"], t["queued"]), ("waiting for a row", t["queued"], t["admitted"]),
             ("its prompt", t["admitted"], t["first"]), ("its answer", t["first"], t["done"])]
    rows = [{"segment": s, "from_s": a - t["sent"], "to_s": b - t["sent"], **window(steps, a, b)} for s, a, b in marks]
    return {"request": name, "segments": rows}


def admissions(steps: list[dict[str, Any]]) -> dict[str, float]:
    """When each request was admitted: the plan time of the step whose ``new`` names it."""
    return {n.request_id: step["t"] for step in steps for n in step["plan"].new}


def tail_table(tail: dict[str, Any]) -> str:
    lines = [f"Last image ({tail['request']}): seconds of each segment by what the engine ran",
             "| segment | from s | to s | " + " | ".join(COLUMNS) + " |", "|---|---|---|" + "---|" * len(COLUMNS)]
    for row in tail["segments"]:
        lines.append(f"| {row['segment']} | {row['from_s']:.2f} | {row['to_s']:.2f} | "
                     + " | ".join(f"{row[c]:.2f}" for c in COLUMNS) + " |")
    return "\n".join(lines)
