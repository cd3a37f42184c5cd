"""[main] Image memory: the server's peak and retained RSS for images of tens of megapixels, and a
text request's latency while they decode.

    python benchmarks/image_memory_bench.py [--model DIR] [--base CHECKOUT] [--side 7000] [--out DIR]

Starts ``vlmserve serve`` (the built-in demo model unless --model; ``--base`` serves an older
checkout instead, for before-and-after figures) and sends, one case at a time:

- ``one``: one ``side x side`` one-colour PNG (about 150 KB for 49 MP);
- ``jpeg``: the same as a JPEG;
- ``eight``: 8 such PNGs in one request;
- ``four x eight``: 4 such requests at once, with a plain text request sent while they decode.

For each case: the server's peak RSS over its RSS before the case (Linux's ``VmHWM``, reset before
each case through ``/proc/PID/clear_refs``), its RSS 20 s after the case ended over that same base
(retained), and the statuses. Writes ``image_memory.json`` to DIR.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from compare import free_port, stop, wait_ready
from PIL import Image

from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
SETTLE_S = 20.0


def image_url(side: int, fmt: str) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 40)).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    mime = "png" if fmt == "PNG" else "jpeg"
    return f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def body(urls: list[str]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "default", "max_tokens": 4,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]}


def rss(pid: int) -> tuple[int, int]:
    """(current, peak) resident set size in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def run_case(url: str, pid: int, requests: list[dict[str, Any]], text_probe: bool) -> dict[str, Any]:
    base, _ = rss(pid)
    reset_peak(pid)
    statuses: list[int] = []
    text: dict[str, float] = {}

    def send(payload: dict[str, Any]) -> None:
        statuses.append(httpx.post(url, json=payload, timeout=600).status_code)

    def probe() -> None:
        time.sleep(0.3)  # the image requests are decoding by now
        start = time.perf_counter()
        reply = httpx.post(url, json={"model": "default", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "Hi"}]}, timeout=600)
        text["status"], text["seconds"] = reply.status_code, round(time.perf_counter() - start, 3)

    threads = [threading.Thread(target=send, args=(p,)) for p in requests]
    threads += [threading.Thread(target=probe)] if text_probe else []
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - began
    _, peak = rss(pid)
    time.sleep(SETTLE_S)
    after, _ = rss(pid)
    out = {"statuses": statuses, "seconds": round(took, 2), "base_mb": round(base / 2**20),
           "peak_over_base_mb": round((peak - base) / 2**20), "retained_mb": round((after - base) / 2**20)}
    return out | ({"text_request": text} if text else {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the built-in demo model")
    parser.add_argument("--base", type=Path, default=None, help="serve this vlmserve checkout instead")
    parser.add_argument("--side", type=int, default=7000, help="the images' width and height")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to vlmserve serve")
    args = parser.parse_args(argv)
    port = free_port()
    env = dict(os.environ)
    if args.base:
        env["PYTHONPATH"] = str(args.base.resolve())
    argv_ = [sys.executable, "-P", "-m", "vlmserve", "serve", "--port", str(port), "--log-level", "warning",
             *(["--model", str(args.model)] if args.model else []), *args.serve_arg]
    png, jpeg = image_url(args.side, "PNG"), image_url(args.side, "JPEG")
    cases = {"one": ([body([png])], False), "jpeg": ([body([jpeg])], False), "eight": ([body([png] * 8)], False),
             "four x eight": ([body([png] * 8)] * 4, True)}
    proc = subprocess.Popen(argv_, env=env, cwd=args.base or HERE.parent)
    results: dict[str, Any] = {"side": args.side, "png_kb": round(len(png) * 3 / 4 / 1024),
                               "jpeg_kb": round(len(jpeg) * 3 / 4 / 1024), "base": str(args.base or ""), "cases": {}}
    try:
        why = wait_ready(proc, f"http://127.0.0.1:{port}/ready")
        if why:
            print(f"server {why}", file=sys.stderr)
            return 1
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for name, (requests, probe) in progress(list(cases.items()), desc="cases"):
            results["cases"][name] = run_case(url, proc.pid, requests, probe)
            print(name, results["cases"][name], flush=True)
    finally:
        stop(proc)
    args.out.mkdir(parents=True, exist_ok=True)
    label = "base" if args.base else "head"
    (args.out / f"image_memory_{label}.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
