"""[main] A coding agent's 40-turn session replayed against real vlmserve servers (issue 57): per-turn TTFT and
cached tokens against a cold prefill, the tool grammar's compile time, and how many sessions stay warm.

    python benchmarks/agent_session.py [--scale 0.1] [--turns 40] [--max-tokens 16] [--cold-turns 40]
        [--parts grammar,messages,codex,screens,warm,qwen] [--no-openblas] [--out DIR] [--plot PNG | --no-plot]
    python benchmarks/agent_session.py --rerender [--out DIR]      # the table and plot again

The model is the real-weights SmolVLM (``real_weights.py``: SmolLM2-135M's text tower, float32) in its
ignore-EOS copy, so every turn decodes ``--max-tokens``. ``--scale`` multiplies every length: 1.0 is the
issue's session, 25K -> 60K prompt tokens over 40 turns (a system prompt and 30 tools, one tool call and
result more per turn, ``agent_workload.py``). The default, 0.1 (2.5K -> 6K, 20 minutes here with OpenBLAS),
is about the least a session can be: the 30 tools' compact list is ~2.3K tokens, a round (a call, a line
of its result and the template's markers) ~90. A cold 25K prefill would take 13-30 minutes here (by the
fit below, as busy as the 2 cores were), 60K over an hour.
Past the model's 8,192 positions the servers get a copy whose config allows more: its answers there
mean nothing, the compute is what is measured. Parts:

- ``grammar``: ``GuideCompiler.compile`` of a forced call to one of the 30 tools (Hermes format), in process:
  a fresh compiler (its llguidance tokenizer built first), the grammar cold, again (cached), first mask;
- ``messages``: Claude Code's shape through the ``anthropic`` SDK (a new billing ``cch`` every request,
  ``cache_control`` on the system block), text only, default flags; then the same last prompt with
  ``tool_choice`` any, first and again, as the server sees the grammar;
- ``codex``: Codex's shape through the ``openai`` SDK's Responses (``instructions``, reasoning items,
  ``function_call``/``function_call_output``, ``prompt_cache_key``, ``store: false``), default flags;
- ``screens``: the Messages shape with three screenshots in tool results, ``--mm-prefix-cache``; where the
  family cannot reuse image prompts (SmolVLM) it stops a turn after the first screenshot;
- ``warm``: sessions of the Messages shape (one system prompt and tool list, their own tasks and
  histories) sent one after another until the default prefix cache evicts the first; then round-robin over
  as many as it holds and over one more, with ``--prefix-cache-dir``: memory hits, disk hits, cold;
- ``qwen``: ``screens`` and Codex's shape with screenshots on qwen2_5_vl/small (random weights), a family
  whose image prompts' prefixes are reused.

Cold TTFTs come from a second server with ``--no-prefix-cache`` on the same prompt, at ``--cold-turns`` of each
model's first session; a turn that reused almost nothing (a session's first) is one itself. A cold prefill's
cost is its prompt's length, so every turn's cold TTFT is also read off a fit through the model's samples
(a*n + b*n^2, marked ~). Writes agent_session.json and .md to ``--out``
(benchmarks/results/agent_session/) and the plot to it and to ``--plot`` (benchmarks/agent_session.png).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_clients import Client, Timed
from agent_measures import forced_tool, grammar, kept_warm
from agent_report import plot, render
from agent_workload import RULES, Session, build_session, messages_request, responses_request, screenshot
from compare import OPENBLAS, free_port, machine
from disk_cache_bench import running

from vlmserve.progress import Progress, progress

HERE = Path(__file__).resolve().parent
FIRST, LAST = 25_000, 60_000  # the session at scale 1.0
CODEX = ("You are Codex, a coding agent running in the Codex CLI, a terminal-based assistant. You and the user share "
         "one workspace; you are expected to be precise, safe and helpful.")
Cold = Callable[[], Client]  # the --no-prefix-cache server, started on first use
PARTS = ("grammar", "messages", "codex", "screens", "warm", "qwen")


class Bench:
    """The run's settings: lengths, cold turns, the servers' environment."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1")
        if not args.no_openblas and Path(OPENBLAS).exists():
            self.env["LD_PRELOAD"] = OPENBLAS
        self.first, self.last = int(FIRST * args.scale), int(LAST * args.scale)
        self.cold_turns = {int(t) for t in args.cold_turns.split(",") if t}

    def serve(self, stack: contextlib.ExitStack, label: str, path: Path, flags: list[str], warm: bool = True) -> Client:
        """A vlmserve server until ``stack`` closes (then SIGTERM); ``warm``: after one unrelated request."""
        port, log = free_port(), self.args.out / f"{label}.log"
        log.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "vlmserve", "serve", "--model", str(path), "--port", str(port),
                "--dtype", "float32", *flags]
        info = stack.enter_context(running(argv, "/ready", port, self.env, log))
        if "failed" in info:
            tail = " ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[:400]
            raise RuntimeError(f"{label}: {info['failed']}; log: {tail}")
        client = Client(f"http://127.0.0.1:{port}", str(path), self.args.max_tokens)
        if warm:
            warm_up(client, "--mm-prefix-cache" in flags or "qwen" in label)
        return client

    def cold(self, stack: contextlib.ExitStack, label: str, path: Path) -> Cold:
        """The --no-prefix-cache server, started when first asked for."""
        return functools.cache(lambda: self.serve(stack, label, path, ["--no-prefix-cache", "--vision-cache-mb", "0"]))

    def session(self, count: Any, seed: int, screenshots: bool = False, codex: bool = False) -> Session:
        return build_session(count, self.first, self.last, self.args.turns, seed, screenshots,
                             CODEX if codex else RULES[0], rotate=7 if codex else 0)


def warm_up(client: Client, image: bool) -> None:
    """One unrelated prompt of ~600 tokens (and an image), so that no measured request pays first-use costs."""
    words = " ".join(f"{w} {i}" for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 100))
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Summarize: {words}"}]
    if image:
        data = base64.b64encode(screenshot(999)).decode()
        content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
    r = client.messages({"messages": [{"role": "user", "content": content}]}, max_tokens=2)
    if r.error:
        raise RuntimeError(f"the warm-up failed: {r.error}")


def token_counter(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def long_context_copy(path: Path, positions: int) -> Path:
    """``path`` itself if it holds ``positions``; else a copy (weights linked) whose config allows them."""
    config = json.loads((path / "config.json").read_text())
    if config["text_config"]["max_position_embeddings"] >= positions:
        return path
    dest = path.parent / f"{path.name}-ctx{positions}"
    if not (dest / "config.json").exists():
        dest.mkdir(exist_ok=True)
        for f in path.iterdir():
            if f.name != "config.json" and not (dest / f.name).exists():
                (dest / f.name).symlink_to(f)
        config["text_config"]["max_position_embeddings"] = positions
        (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


def send(client: Client, shape: str, s: Session, turn: int, key: str, **extra: Any) -> Timed:
    if shape == "messages":
        return client.messages(messages_request(s, turn), **extra)
    return client.responses(responses_request(s, turn, key), **extra)


def replay(name: str, shape: str, s: Session, warm: Client, cold: Cold, cold_turns: set[int], bar: Progress,
           turns: int | None = None) -> dict[str, Any]:
    """Each turn on the warm server, and at ``cold_turns`` on the cold one too; a turn that reused almost
    nothing (a session's first) is a cold sample itself."""
    rows: list[dict[str, Any]] = []
    for t in range(1, (turns or s.turns) + 1):
        bar.set_postfix_str(f"{name} turn {t}")
        r = send(warm, shape, s, t, name)
        row = {"turn": t, "images": sum(x.screenshot is not None for x in s.rounds[: t - 1]), **r.to_json()}
        if r.prompt_tokens and (r.cached_tokens or 0) < 0.05 * r.prompt_tokens:
            row["cold_ttft_s"], row["cold_total_s"], row["cold_from"] = r.ttft_s, r.total_s, "itself"
        elif t in cold_turns:
            c = send(cold(), shape, s, t, f"{name}-cold")
            row.update(cold_ttft_s=c.ttft_s, cold_total_s=c.total_s, cold_error=c.error, cold_from="--no-prefix-cache")
        rows.append(row)
        bar.update(1)
    return {"name": name, "shape": shape, "rows": rows}


def smolvlm(b: Bench, parts: set[str], bar: Progress) -> dict[str, Any]:
    """Every part but ``qwen``, on the real-weights SmolVLM."""
    from real_weights import build_smolvlm_smollm2, ignore_eos_copy

    path = long_context_copy(ignore_eos_copy(build_smolvlm_smollm2()), b.last + 2 * b.args.max_tokens + 256)
    count, out = token_counter(path), {"model": str(path), "sessions": []}
    text, codex = b.session(count, 1), b.session(count, 2, codex=True)
    if "grammar" in parts:
        out["grammar"] = grammar(path, text, b.args.grammar_runs)
    with contextlib.ExitStack() as stack:
        cold = b.cold(stack, "cold", path)
        if parts & {"messages", "codex"}:
            with contextlib.ExitStack() as inner:
                warm = b.serve(inner, "default", path, [])
                if "messages" in parts:
                    out["sessions"].append(replay("messages", "messages", text, warm, cold, b.cold_turns, bar))
                    out["forced_tool"] = forced_tool(warm, text)
                if "codex" in parts:
                    out["sessions"].append(replay("codex", "responses", codex, warm, cold, set(), bar))
        if "screens" in parts:
            out["sessions"].append(screens(b, path, count, cold, bar))
        if "warm" in parts:
            out["kept_warm"] = kept_warm(b, path, count, cold, bar)
    return out


def screens(b: Bench, path: Path, count: Any, cold: Cold, bar: Progress) -> dict[str, Any]:
    """The Messages shape with screenshots, --mm-prefix-cache; a turn past the first screenshot where the
    family reuses no image prompt (every later turn is a whole prefill: a minute or more each)."""
    s = b.session(count, 1, screenshots=True)
    with contextlib.ExitStack() as stack:
        warm = b.serve(stack, "mm", path, ["--mm-prefix-cache"])
        off = "--mm-prefix-cache is off" in (b.args.out / "mm.log").read_text(errors="replace")
        first = next(t for t, r in enumerate(s.rounds, 2) if r.screenshot is not None)
        run = replay("screens", "messages", s, warm, cold, set(), bar, turns=first + 1 if off else None)
    bar.update(s.turns - len(run["rows"]))
    return {**run, "mm_prefix_off": off, "first_screenshot_turn": first}


def qwen(b: Bench, bar: Progress) -> dict[str, Any]:
    """Both shapes with screenshots on qwen2_5_vl/small, whose image prompts' prefixes are reused."""
    from vlmserve.testing import build_model

    path = build_model("qwen2_5_vl", "small", ignore_eos=True)
    count, out = token_counter(path), {"model": str(path), "sessions": []}
    with contextlib.ExitStack() as stack:
        cold = b.cold(stack, "qwen-cold", path)
        warm = b.serve(stack, "qwen-mm", path, ["--mm-prefix-cache"])
        for name, shape, s in (("qwen messages+screens", "messages", b.session(count, 3, screenshots=True)),
                               ("qwen codex+screens", "responses", b.session(count, 4, screenshots=True, codex=True))):
            out["sessions"].append(replay(name, shape, s, warm, cold, set() if out["sessions"] else b.cold_turns, bar))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1, help="1.0: 25K -> 60K tokens (default 0.1)")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16, help="a tool call's worth, every turn")
    parser.add_argument("--cold-turns", default="40", help="turns also sent to the --no-prefix-cache server")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {','.join(PARTS)}")
    parser.add_argument("--warm-turn", type=int, default=5, help="the turn the kept-warm sessions are at")
    parser.add_argument("--max-warm-sessions", type=int, default=40)
    parser.add_argument("--grammar-runs", type=int, default=3)
    parser.add_argument("--no-openblas", action="store_true", help=f"do not LD_PRELOAD {OPENBLAS} into the servers")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "agent_session")
    parser.add_argument("--plot", type=Path, default=HERE / "agent_session.png", help="a copy of the plot")
    parser.add_argument("--no-plot", action="store_true", help="no plot (matplotlib comes with the bench extra)")
    parser.add_argument("--rerender", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rerender:
        result = json.loads((args.out / "agent_session.json").read_text())
    else:
        result = run(args)
    text = render(result)
    (args.out / "agent_session.md").write_text(text)
    if not args.no_plot:
        plot(result, args.out / "agent_session.png")
        shutil.copyfile(args.out / "agent_session.png", args.plot)
    print(text)
    print(f"results in {args.out}")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    parts, b, began = set(args.parts.split(",")), Bench(args), time.perf_counter()
    if unknown := parts - set(PARTS):
        raise SystemExit(f"unknown parts: {', '.join(sorted(unknown))}")
    planned = args.turns * (len(parts & {"messages", "codex", "screens"}) + 2 * ("qwen" in parts))
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "first": b.first, "last": b.last}
    with progress(total=planned, desc="agent session", unit="turn", file=sys.stderr) as bar:
        if parts - {"qwen"}:
            result["smolvlm"] = smolvlm(b, parts, bar)
        if "qwen" in parts:
            result["qwen"] = qwen(b, bar)
    result["machine"] = machine(b.env)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    (args.out / "agent_session.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main())
