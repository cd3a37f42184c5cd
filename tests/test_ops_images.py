"""Image memory (issue 31, item 3): images of tens of megapixels are decoded no larger than the model's
processor keeps, under a server-wide budget, with memory given back; text prompts never queue behind
their decoding; --max-image-pixels refuses from the header.

Each drives a real ``vlmserve serve`` on the micro Gemma 4 (its processor keeps 4,096 pixels) over
real sockets, and reads the server's own memory from /proc.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from server_utils import start_server

from vlmserve.preprocess.decode_budget import DecodeBudget

SIDE = 4000  # 16 MP: 48 MB decoded as RGB, about 50 KB as a one-colour PNG
MB = 2**20


def _png(side: int, colour: tuple[int, int, int] = (200, 40, 40)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model: str, urls: list[str], max_tokens: int = 2) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]}


def _memory(pid: int) -> tuple[int, int]:
    """The process's (resident, peak resident) bytes."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


@pytest.fixture(scope="module")
def image_server(gemma4_micro, tmp_path_factory):
    log = tmp_path_factory.mktemp("images") / "server.log"
    server = start_server(["--model", str(gemma4_micro), "--max-image-pixels", "2e7"], log)
    yield server
    server.stop()


def test_sixteen_large_images_at_once_stay_within_a_few_decodes_and_memory_goes_back(image_server, gemma4_micro):
    """4 requests of 4 images of 16 MP each, at once. Decoded whole, converted and preprocessed, as
    before, one such image cost about 11 bytes a pixel (176 MB) and the 4 pool threads held 4 at once,
    most of it kept afterwards; now at most two decode at once, each shrunk to the processor's
    limit as it decodes, and the memory is given back."""
    pid = image_server.proc.pid
    url = image_server.url + "/v1/chat/completions"
    httpx.post(url, json=_body(gemma4_micro.name, [_png(64)]), timeout=60).raise_for_status()
    before, _ = _memory(pid)
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak from here on
    except OSError:
        pass  # the peak since the start, which the load and warm-up kept well under this
    urls = [_png(SIDE, (40 * i, 200, 40)) for i in range(4)]
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(
        httpx.post(url, json=_body(gemma4_micro.name, urls), timeout=300).status_code)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 4
    _, peak = _memory(pid)
    assert peak - before < 250 * MB, f"peak {(peak - before) / MB:.0f} MB over {before / MB:.0f} MB"
    deadline = time.monotonic() + 10
    while (retained := _memory(pid)[0] - before) >= 60 * MB and time.monotonic() < deadline:
        time.sleep(0.5)
    assert retained < 60 * MB, f"{retained / MB:.0f} MB still held"


def test_a_text_request_does_not_queue_behind_image_decoding(image_server, gemma4_micro):
    """12 requests of 4 large images fill the image lane; a text request sent after them is answered
    before most of them (it waited behind them in one shared pool before)."""
    url = image_server.url + "/v1/chat/completions"
    urls = [_png(SIDE, (10 * i, 10, 200)) for i in range(4)]
    done: list[str] = []
    lock = threading.Lock()

    def send(name: str, body: dict) -> None:
        reply = httpx.post(url, json=body, timeout=300)
        with lock:
            done.append(f"{name}:{reply.status_code}")

    images = [threading.Thread(target=send, args=("image", _body(gemma4_micro.name, urls))) for _ in range(12)]
    for t in images:
        t.start()
    time.sleep(0.5)  # all 12 are in phase 1 by now
    text = threading.Thread(target=send, args=("text", {"model": gemma4_micro.name, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "Hi"}]}))
    text.start()
    for t in [*images, text]:
        t.join()
    assert sorted(set(done)) == ["image:200", "text:200"]
    images_before_text = done.index("text:200")
    assert images_before_text < 6, f"the text request ended after {images_before_text} of 12 image requests"


def test_an_image_over_max_image_pixels_is_refused_from_its_header(image_server, gemma4_micro):
    reply = httpx.post(image_server.url + "/v1/chat/completions", timeout=60,
                       json=_body(gemma4_micro.name, [_png(5000)]))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "5000x5000 is over the 20000000-pixel limit" in error["message"]


def test_the_decode_budget_never_holds_more_than_it_has():
    """8 threads hold random amounts, some over the whole budget: the sum held never exceeds it,
    an oversized hold gets the budget to itself, and every hold ends (no deadlock)."""
    budget = DecodeBudget(100)
    seen: list[int] = []
    lock = threading.Lock()

    def worker(sizes: list[int]) -> None:
        for size in sizes:
            with budget.hold(size):
                with lock:
                    seen.append(budget.used)
                time.sleep(0.001)

    plans = [[(7 * i + 13 * j) % 160 for j in range(30)] for i in range(8)]
    threads = [threading.Thread(target=worker, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(seen) == 240 and max(seen) <= 100 and budget.used == 0
    assert 100 in seen  # an oversized hold took all of it
