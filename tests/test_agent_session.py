"""benchmarks/agent_session.py: the replayed session's shape by hand, then three turns of Claude Code's and
Codex's shapes with screenshots against real servers (its ``qwen`` part at a tiny --scale)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import agent_workload as workload  # noqa: E402 - lives in benchmarks/, which is not a package


def words(text: str) -> int:
    return len(text.split())


def test_a_session_grows_a_round_a_turn_with_screenshots_early_middle_and_late() -> None:
    s = workload.build_session(words, first=3000, last=7000, turns=40, screenshots=True)
    assert s.turns == 40 and len(s.tools) == 30
    assert [i for i, r in enumerate(s.rounds, 1) if r.screenshot is not None] == [4, 20, 34]
    tools = sum(words(json.dumps(t)) for t in s.tools)
    assert 0.6 * 3000 < tools < 3000 < tools + words(s.system) < 3300  # mostly tools, as Claude Code's
    rounds = sum(words(r.result) + words(r.thought) + words(json.dumps(r.arguments)) for r in s.rounds)
    assert 0.85 * 4000 < rounds + 39 * workload.ROUND_MARKERS < 1.15 * 4000
    assert workload.build_session(words, 3000, 7000, seed=1).system == s.system  # sessions share it
    assert workload.build_session(words, 3000, 7000, seed=1, rotate=7).tools[0]["name"] == "bash"


def test_the_request_shapes() -> None:
    s = workload.build_session(words, first=3000, last=7000, turns=40, screenshots=True)
    a, b = workload.messages_request(s, 5), workload.messages_request(s, 5)
    assert a["system"][0]["text"] != b["system"][0]["text"]  # a new cch every request
    assert a["system"][0]["text"].startswith("x-anthropic-billing-header: ")
    assert a["system"][1]["cache_control"] == {"type": "ephemeral"}
    assert [m["role"] for m in a["messages"]] == ["user"] + ["assistant", "user"] * 4
    result = a["messages"][-1]["content"][0]
    assert result["type"] == "tool_result" and [p["type"] for p in result["content"]] == ["text", "image"]
    r = workload.responses_request(s, 5, "session-1")
    assert (r["prompt_cache_key"], r["store"], r["instructions"]) == ("session-1", False, s.system)
    assert [i["type"] for i in r["input"]] == ["message"] + ["reasoning", "function_call", "function_call_output"] * 4
    assert [p["type"] for p in r["input"][-1]["output"]] == ["input_text", "input_image"]


def test_three_turns_of_both_shapes_with_screenshots_against_real_servers(tmp_path: Path) -> None:
    argv = [sys.executable, str(BENCHMARKS / "agent_session.py"), "--parts", "qwen", "--turns", "3", "--scale", "0.01",
            "--cold-turns", "", "--no-openblas", "--no-plot", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "agent_session.json").read_text())
    for run in result["qwen"]["sessions"]:
        rows = run["rows"]
        assert [(r["turn"], r["images"], r["error"]) for r in rows] == [(1, 0, None), (2, 1, None), (3, 2, None)]
        for prev, row in zip(rows, rows[1:]):  # the screenshot turns reuse the whole previous prompt
            assert row["cached_tokens"] >= 0.95 * prev["prompt_tokens"], rows
        assert rows[0]["cold_from"] == "itself" and rows[0]["cold_ttft_s"] == rows[0]["ttft_s"]
        assert 0 < rows[2]["ttft_s"] <= rows[2]["total_s"]
        assert "cold_from" not in rows[2]  # no --cold-turns: no cold server either
    table = (tmp_path / "agent_session.md").read_text()
    assert "| turn | images | prompt tokens |" in table and "| ~" in table  # later turns' cold TTFT from the fit
    assert not (tmp_path / "qwen-cold.log").exists()
