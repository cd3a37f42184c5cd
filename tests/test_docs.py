"""Every example in README.md and docs/ has a runner, and runs. A fenced ``python``, ``bash``, ``sh`` or ``shell``
block is one of three kinds:

- against the demo server: it calls ``http://127.0.0.1:8000`` and a paragraph starting "prints `...`" follows;
  it runs here, as written, against a real ``vlmserve serve`` on the demo model (only the port changes), and must
  print exactly that;
- ``<!-- run by tests/test_x.py::test_y -->`` before it: that test runs it. The test must exist, and its module
  must read this page (and run the block as written) or use every ``--option`` the block shows;
- ``<!-- not run: WHY -->`` before it: not run, for the reason given. They are counted (``NOT_RUN``).

And the pages build as a site: ``mkdocs build --strict`` fails on a page left out of the nav or a missing anchor.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
SAYS = re.compile(r"\n*prints `([^`]+)`")
RUNNER = re.compile(r"<!-- (run by|not run:) (.+?) -->\n\Z")
RUNNABLE = ("python", "bash", "sh", "shell")
NOT_RUN = 3  # two Macs; lmms-eval and guidellm's torch; the scale-out script that waits for Ctrl-C


@dataclass(frozen=True, slots=True)
class Block:
    page: Path
    lang: str
    code: str
    says: str | None  # what a paragraph after it says it prints
    runner: tuple[str, str] | None  # ("run by", "tests/x.py::test_y, ...") or ("not run:", why)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}: {self.code.strip().splitlines()[-1][:40]}"

    @property
    def on_the_demo_server(self) -> bool:
        return self.runner is None and self.says is not None and "127.0.0.1:8000" in self.code


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if match.group(1) not in RUNNABLE:
                continue
            says = SAYS.match(text, match.end())
            runner = RUNNER.search(text, 0, match.start())
            found.append(Block(page, match.group(1), match.group(2), says and says.group(1),
                               runner and (runner.group(1), runner.group(2))))
    return found


def examples() -> list[Block]:
    return [block for block in blocks() if block.on_the_demo_server]


def run_by(test: str) -> list[Block]:
    """The blocks that name ``test`` (a function of this module) as their runner."""
    return [b for b in blocks() if b.runner and b.runner[0] == "run by" and f"tests/test_docs.py::{test}" in b.runner[1]]


# -- every block has a runner -----------------------------------------------------------------------------------


def test_every_example_has_a_runner():
    orphans = [b.name for b in blocks() if not b.on_the_demo_server and b.runner is None]
    assert not orphans, f"examples no test runs (see tests/test_docs.py's docstring): {orphans}"


def test_the_blocks_not_run_are_few_and_say_why():
    not_run = [b for b in blocks() if b.runner and b.runner[0] == "not run:"]
    assert all(len(b.runner[1]) > 15 for b in not_run if b.runner), not_run
    assert len(not_run) == NOT_RUN, [b.name for b in not_run]


def _options(code: str) -> set[str]:
    lines = [line for line in code.splitlines() if not line.lstrip().startswith("#")]
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", "\n".join(lines)))


def _checked(runner: str, block: Block) -> str | None:
    """What is wrong with ``runner`` as the runner of ``block``, if anything."""
    path, _, test = runner.partition("::")
    if not (ROOT / path).is_file():
        return f"{path}: no such file"
    source = (ROOT / path).read_text()
    if test and test not in {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}:
        return f"{path} has no {test}"
    if path == "tests/test_docs.py" or str(block.page.relative_to(ROOT)) in source:
        return None  # it reads the page and runs the block
    missing = sorted(option for option in _options(block.code) if f'"{option}"' not in source)
    return f"{runner} does not use {missing}" if missing else None


def test_each_named_runner_exists_and_runs_its_block():
    named = [(b, r.strip()) for b in blocks() if b.runner and b.runner[0] == "run by" for r in b.runner[1].split(",")]
    assert len(named) >= 10, named
    problems = [(b.name, problem) for b, runner in named if (problem := _checked(runner, b))]
    assert not problems, problems


# -- the pages ------------------------------------------------------------------------------------------------


def test_the_readme_is_short_and_shows_serving_and_a_call_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    serve = next(i for i, line in enumerate(lines) if line.startswith("vlmserve serve"))
    call = next(i for i, line in enumerate(lines) if "http://127.0.0.1:8000/v1" in line)
    assert serve < 40 and call < 50, (serve, call)  # the first screen


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", BLOCK.sub("", page.read_text()), re.M)}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", BLOCK.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.append((page.name, target))
    assert not broken, broken


def test_mkdocs_builds_the_pages_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "apis" / "index.html").is_file()


# -- the blocks this module runs itself ---------------------------------------------------------------------------


def _commands(code: str, program: str) -> list[list[str]]:
    joined = code.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.startswith(program)]


def test_every_serve_command_parses(tmp_path, monkeypatch):
    """Each ``vlmserve serve`` line shown parses with the server's own parser and checks, as given (`~` a home of
    its own, holding the folders the line names)."""
    from vlmserve import cli

    monkeypatch.setenv("HOME", str(tmp_path))
    lines = [argv for b in run_by("test_every_serve_command_parses") for argv in _commands(b.code, "vlmserve serve")]
    assert len(lines) >= 6, lines
    for argv in lines:
        argv = [os.path.expanduser(arg) for arg in argv[1:]]
        for flag, value in zip(argv, argv[1:]):
            if flag == "--model-dir":
                Path(value).mkdir(parents=True, exist_ok=True)
        config = cli.serve_config(cli._parser().parse_args(argv))
        assert not isinstance(config, str), (argv, config)


def test_the_cli_synopsis_names_real_options(capsys):
    from vlmserve import cli

    lines = [argv for b in run_by("test_the_cli_synopsis_names_real_options") for argv in _commands(b.code, "vlmserve")]
    assert len(lines) >= 4, lines
    for argv in lines:
        with pytest.raises(SystemExit):
            cli._parser().parse_args([argv[1], "--help"])
        told = capsys.readouterr().out
        assert all(option in told for option in _options(" ".join(argv))), (argv, told)


# -- the examples against the demo server -------------------------------------------------------------------------


def test_the_pages_have_runnable_examples():
    kinds = {b.lang for b in examples()}
    assert kinds == {"python", "bash"} and len(examples()) >= 12, [b.name for b in examples()]


@pytest.mark.parametrize("what, marks", [
    ("a text chat", ('"content": "Hello!"',)),
    ("an image", ("assets/example.png", "image_url")),
    ("a tool call", ("get_weather", "tools")),
    ("structured output", ("response_format",)),
])  # fmt: skip
def test_each_feature_has_a_runnable_example_in_python_and_in_curl(what, marks):
    """A newcomer can paste a chat, an image, a tool call and structured output both ways."""
    for lang in ("python", "bash"):
        assert any(b.lang == lang and all(m in b.code for m in marks) for b in examples()), (what, lang)


def test_no_example_is_a_placeholder():
    """Every name an example uses is defined in it, and no value is left as "..."."""
    for b in examples():
        assert "..." not in b.code and "my-model" not in b.code, b.code
        if b.lang == "python":
            compile(b.code, b.name, "exec")  # parses; running it is the next test


@pytest.mark.parametrize("block", examples(), ids=[b.name for b in examples()])
def test_an_example_prints_what_its_page_says(demo_server, block):
    code = block.code.replace("http://127.0.0.1:8000", demo_server.url)
    argv = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-c", f"set -euo pipefail\n{code}"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == block.says
