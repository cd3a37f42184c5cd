"""benchmarks/embed_bench.py end to end at a tiny size: both real servers, text and image inputs, a table and JSON
whose vectors agree between the servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "embed_bench.py"


def test_both_servers_embed_text_and_images_alike(tmp_path: Path) -> None:
    argv = [sys.executable, str(BENCH), "--batch", "1,3", "--concurrency", "2", "--rounds", "1",
            "--kinds", "text,image", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "embed_bench.json").read_text())
    assert summary["cells"] == ["1x2", "3x2"]
    for kind in ("text", "image"):
        ours, peer = summary["kinds"][kind]["vlmserve"], summary["kinds"][kind]["mlx_vlm"]
        for key in summary["cells"]:
            assert ours[key]["emb_s"] > 0 and ours[key]["requests"] == 2
            assert peer[key]["min_cosine"] >= 0.9999  # the same inputs, the same vectors
    table = (tmp_path / "embed_bench.md").read_text()
    assert table.count("\n| text |") + table.count("\n| image |") == 4
