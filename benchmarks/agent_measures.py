"""[main] agent_session.py's measures besides the replayed sessions: the 30 tools' grammar (in process, and as
the server sees it) and how many sessions the default prefix cache, and its disk tier, keep warm."""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_clients import Client
from agent_workload import Session, chat_tools, messages_request

from vlmserve.progress import Progress


def forced_tool(client: Client, s: Session, repeats: int = 3) -> dict[str, Any]:
    """The last prompt again (cached), 2 tokens: with tool_choice any (the grammar compiled, then cached ``repeats``
    times) and without (``repeats`` times); medians of the whole requests."""
    def timed(**extra: Any) -> float:
        r = client.messages(messages_request(s, s.turns), max_tokens=2, **extra)
        if r.error or r.total_s is None:
            raise RuntimeError(f"a forced tool call failed: {r.error}")
        return r.total_s

    first = timed(tool_choice={"type": "any"})
    again = [timed(tool_choice={"type": "any"}) for _ in range(repeats)]
    plain = [timed() for _ in range(repeats)]
    return {"forced_first_s": first, "forced_again_s": statistics.median(again), "unforced_s": statistics.median(plain),
            "repeats": repeats}


def grammar(path: Path, s: Session, runs: int) -> dict[str, Any]:
    """In process: compile times of the 30 tools' forced-call grammar, medians of ``runs``."""
    from transformers import AutoTokenizer

    from vlmserve.preprocess.guided import GuideCompiler, GuideSpec

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    spec = GuideSpec("tool_call", {"format": "hermes", "tools": chat_tools(s)})
    times: dict[str, list[float]] = {"tokenizer_s": [], "cold_s": [], "cached_s": [], "first_mask_s": []}
    for _ in range(runs):
        compiler = GuideCompiler(tokenizer, frozenset(eos))
        marks = [time.perf_counter()]
        compiler.compile(GuideSpec("regex", "a"))  # builds the llguidance tokenizer (and a trivial grammar)
        marks.append(time.perf_counter())
        guide = compiler.compile(spec)
        marks.append(time.perf_counter())
        compiler.compile(spec)
        marks.append(time.perf_counter())
        guide.template.deep_copy().compute_bitmask()
        marks.append(time.perf_counter())
        for key, a, z in zip(times, marks, marks[1:]):
            times[key].append(z - a)
    out: dict[str, Any] = {k: round(statistics.median(v), 5) for k, v in times.items()}
    return {**out, "runs": runs, "tools": len(s.tools), "schema_chars": len(json.dumps(chat_tools(s)))}


def kept_warm(b: Any, path: Path, count: Any, cold: Callable[[], Client], bar: Progress) -> dict[str, Any]:
    """Sessions at turn ``--warm-turn`` until the default prefix cache evicts the first; then round-robin
    over those it holds (memory) and over all (one more: each read back from ``--prefix-cache-dir``).
    ``b`` is agent_session's ``Bench``: its servers and sessions."""
    turn, sessions, loads = b.args.warm_turn, [], []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(dir=b.args.out) as cache_dir:
        # no warm-up: its prompt would be one more entry, and every entry here must be a session's
        server = b.serve(stack, "warm-disk", path, ["--prefix-cache-dir", cache_dir], warm=False)
        resend = lambda i: server.messages(messages_request(sessions[i], turn, cache_control=False),  # noqa: E731
                                           max_tokens=1).to_json()
        while len(sessions) < b.args.max_warm_sessions:
            sessions.append(b.session(count, 100 + len(sessions)))
            bar.set_postfix_str(f"warm: session {len(sessions)}")
            loads.append(resend(len(sessions) - 1))
            if server.metrics().get("prefix_cache_entries", 0) < len(sessions):
                break  # the first session was evicted: the store holds one fewer than were sent
        m = server.metrics()
        held = int(m.get("prefix_cache_entries", 0))
        settle(Path(cache_dir))
        files = len(list(Path(cache_dir).rglob("*.kv")))  # what the store evicted (/metrics: as of the last step)
        in_memory = [resend(i) for i in range(len(sessions) - held, len(sessions))]
        before, one_more = server.metrics(), []
        for i in range(len(sessions)):  # each resumed once its file is written: a session thinks between turns
            settle(Path(cache_dir))
            one_more.append(resend(i))
        after = server.metrics()
    coldest = cold().messages(messages_request(sessions[0], turn, cache_control=False), max_tokens=1).to_json()
    tokens = sum(r["prompt_tokens"] or 0 for r in loads[len(loads) - held:])
    return {"turn": turn, "sent": len(sessions), "held": held, "disk_files": files, "loads": loads,
            "round_robin_held": in_memory, "round_robin_one_more": one_more, "cold": coldest, "metrics_after_loads": m,
            "disk_hits": after.get("prefix_cache_disk_hits", 0) - before.get("prefix_cache_disk_hits", 0),
            "bytes_per_token": m.get("prefix_cache_bytes", 0) / tokens if tokens else None}


def settle(directory: Path, quiet_s: float = 1.0, limit_s: float = 60.0) -> None:
    """Until the disk tier's files stop changing (none half-written, the same set for ``quiet_s``). Not its
    /metrics gauge of pending writes: the worker refreshes it on its steps, and an idle server has none."""
    deadline, last, since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        files = sorted(str(f) for f in directory.rglob("*"))  # the files live in a folder per model
        if files != last or any(Path(f).name.startswith(".tmp-") for f in files):
            last, since = files, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)
