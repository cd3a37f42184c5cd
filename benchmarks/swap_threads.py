"""[main] Native threads and RSS of a --model-dir server over many swaps (issue 60, worker thread reuse).

    python benchmarks/swap_threads.py [--rounds 20] [--size micro]

Three models, ``--max-loaded-models 1``: every request loads its model and unloads the last. Prints the
server's native thread count (/proc/PID/task) and RSS after each round of three swaps.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_utils import start_server  # noqa: E402
from test_model_dir import model_dir  # noqa: E402


def sample(pid: int) -> tuple[int, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024
    return len(os.listdir(f"/proc/{pid}/task")), rss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--size", default="micro")
    args = parser.parse_args()
    archs = ("gemma4", "qwen2_5_vl", "smolvlm" if args.size == "micro" else "qwen2_vl")
    with tempfile.TemporaryDirectory() as tmp:
        root = model_dir(Path(tmp) / "m", archs, args.size)
        srv = start_server(["--model-dir", str(root), "--max-loaded-models", "1", "--idle-unload-s", "0"],
                           Path(tmp) / "server.log")
        try:
            print("idle", *sample(srv.proc.pid))
            for r in range(args.rounds):
                for name in archs:
                    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
                    assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300).status_code == 200
                threads, rss = sample(srv.proc.pid)
                print(f"round {r + 1} swaps {3 * (r + 1)} threads {threads} rss_mib {rss:.0f}", flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
