"""Every README example that says what it prints runs, as written, against a real ``vlmserve serve`` on
the demo model, and prints exactly that: a fenced ``python`` or ``bash`` block followed by a paragraph
that starts with "prints `...`". Only the address changes (the test server's port)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
SAYS = re.compile(r"\n*prints `([^`]+)`")


def examples() -> list[tuple[str, str, str]]:
    """(language, code, what it prints) of each block against the server that says what it prints."""
    text, found = README.read_text(), []
    for block in BLOCK.finditer(text):
        says = SAYS.match(text, block.end())
        if block.group(1) in ("python", "bash") and says and "127.0.0.1:8000" in block.group(2):
            found.append((block.group(1), block.group(2), says.group(1)))
    return found


def test_the_readme_has_runnable_examples():
    kinds = {lang for lang, _, _ in examples()}
    assert kinds == {"python", "bash"} and len(examples()) >= 3, examples()


@pytest.mark.parametrize("what, marks", [
    ("a text chat", ('"content": "Hello!"',)),
    ("an image", ("assets/example.png", "image_url")),
    ("a tool call", ("get_weather", "tools")),
    ("structured output", ("response_format",)),
])  # fmt: skip
def test_each_feature_has_a_runnable_example_in_python_and_in_curl(what, marks):
    """A newcomer can paste a chat, an image, a tool call and structured output both ways."""
    for lang in ("python", "bash"):
        assert any(lang == found and all(m in code for m in marks) for found, code, _ in examples()), (what, lang)


def test_no_example_is_a_placeholder():
    """Every name an example uses is defined in it, and no value is left as "..."."""
    for lang, code, _ in examples():
        assert "..." not in code and "my-model" not in code, code
        if lang == "python":
            compile(code, "README example", "exec")  # parses; running it is the next test


@pytest.mark.parametrize("lang, code, said", examples(), ids=[f"{lang}: {code.splitlines()[-1][:40]}"
                                                               for lang, code, _ in examples()])
def test_a_readme_example_prints_what_the_readme_says(demo_server, lang, code, said):
    code = code.replace("http://127.0.0.1:8000", demo_server.url)
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-c", f"set -euo pipefail\n{code}"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == said
