"""Progress off a terminal is whole lines (never a carriage return); on a terminal it is tqdm."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from conftest import scene
from tqdm import tqdm

from vlmserve.progress import LineProgress, is_tty, progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(text: str) -> list[str]:
    assert "\r" not in text
    assert text.endswith("\n")
    return text.splitlines()


def test_a_pipe_gets_a_line_at_start_each_quarter_and_the_end() -> None:
    out = io.StringIO()
    with progress(total=8, desc="job", unit="req", file=out, every_s=1e9) as bar:
        assert isinstance(bar, LineProgress)
        for i in range(8):
            bar.set_postfix_str(f"step {i}")
            bar.update(1)
    lines = _lines(out.getvalue())
    assert lines[0] == "job: started, 8 req"
    assert [line.split(",")[0] for line in lines[1:4]] == ["job: 2/8 req (25%)", "job: 4/8 req (50%)", "job: 6/8 req (75%)"]
    assert lines[4].startswith("job: done, 8/8 req (100%) in ") and lines[4].endswith(" s - step 7")
    assert len(lines) == 5


def test_without_a_total_a_line_at_most_every_every_s() -> None:
    clock, out = Clock(), io.StringIO()
    with LineProgress(desc="loading m", file=out, every_s=30, clock=clock) as bar:
        for _ in range(100):
            clock.now += 1
            bar.refresh()
    assert _lines(out.getvalue()) == ["loading m: started", "loading m: 0 it, 30.0 s", "loading m: 0 it, 1 min 00 s",
                                      "loading m: 0 it, 1 min 30 s", "loading m: done in 1 min 40 s"]


def test_iterating_counts_and_a_break_or_an_error_says_stopped() -> None:
    out = io.StringIO()
    assert list(progress(range(3), desc="all", file=out)) == [0, 1, 2]
    for i in progress(range(10), desc="some", file=out):
        if i == 4:
            break
    with pytest.raises(KeyError), progress(total=3, desc="boom", file=out) as bar:
        bar.set_postfix(loss="0.5", tok=12)
        raise KeyError("x")
    lines = _lines(out.getvalue())
    assert lines[-1].startswith("boom: stopped, 0/3 it (0%) in ") and lines[-1].endswith(" - loss=0.5, tok=12")
    assert [line for line in lines if line.startswith("all: done, 3/3 it (100%)")]
    assert [line for line in lines if line.startswith("some: stopped, 4/10 it (40%)")]


def test_write_goes_to_stdout_as_tqdm_does(capsys) -> None:
    bar = progress(total=1, desc="x", file=io.StringIO())
    bar.write("step 1: fine")
    bar.close()
    assert capsys.readouterr().out == "step 1: fine\n"


def test_a_terminal_gets_tqdm() -> None:
    out = FakeTerminal()
    with progress(total=4, desc="job", file=out, leave=False) as bar:
        assert isinstance(bar, tqdm)
        bar.update(4)
    assert "\r" in out.getvalue() and "job" in out.getvalue()
    assert is_tty(out) and not is_tty(io.StringIO()) and not is_tty(object())


def test_build_model_into_a_pipe_prints_lines(tmp_path) -> None:
    argv = [sys.executable, "-m", "vlmserve.cli", "build-model", "--arch", "gemma4", "--out", str(tmp_path / "m"), "--force"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)  # stderr is a pipe
    assert done.returncode == 0, done.stderr
    lines = _lines(done.stderr)
    assert "building gemma4/micro: started, 4 it" in lines
    assert [line for line in lines if line.startswith("building gemma4/micro: done, 4/4 it (100%) in ")]


def test_caption_waiting_for_the_model_prints_lines(gemma4_micro, tmp_path) -> None:
    scene("circle", (220, 30, 30)).save(tmp_path / "red.png")
    argv = [sys.executable, "-m", "vlmserve.cli", "caption", str(tmp_path / "red.png"), "--model", str(gemma4_micro),
            "--max-tokens", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = _lines(done.stderr)
    assert f"loading {gemma4_micro}: started" in lines
    assert [line for line in lines if line.startswith(f"loading {gemma4_micro}: done in ")]

