"""benchmarks/README.md and benchmarks/notes/ keep their links: every relative link and image path names a file
that exists, and every #anchor a heading of the page it points into (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PAGES = [BENCHMARKS / "README.md", *sorted((BENCHMARKS / "notes").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code ticks and punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            slug = _slug(match.group(1))
            counts[slug] = counts.get(slug, 0) + 1  # a repeated heading's anchor ends -1, -2...
            found.add(slug if counts[slug] == 1 else f"{slug}-{counts[slug] - 1}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` (outside code blocks) whose file or anchor does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not this test's
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_every_note_is_linked_from_the_readme() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    assert [p.name for p in PAGES[1:] if f"(notes/{p.name})" not in readme] == []


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "plot.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A `tool.py` run (2026-11-27)\n\n![ok](plot.png) ![gone](missing.png)\n"
                    "[ok](#a-toolpy-run-2026-11-27) [bad](#a-tool-run) [up](page.md#top) [web](https://x.org/y)\n"
                    "```bash\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.png", "#a-tool-run"]
