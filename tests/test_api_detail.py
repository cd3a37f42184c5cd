"""OpenAI's ``detail: low`` on image parts (issue 32), against one real ``vlmserve serve`` of micro models
whose processors were widened to see large pictures (the micro ones see 64 px, where low changes nothing).

Low is OpenAI's one 512x512 view: on families where fewer pixels give fewer image tokens the image is
fitted into 512x512 before the processor (Qwen's, Pixtral's), and Gemma 4 takes its smallest soft-token
budget (70) when every image of the request is low. /tokenize counts what a chat request costs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from server_utils import ServerProcess, image_data_url, start_server

from vlmserve.testing import build_model

PICTURE = Image.fromarray(np.random.default_rng(3).integers(0, 255, (768, 1024, 3), dtype=np.uint8))
FITTED = PICTURE.resize((512, 384), Image.Resampling.BICUBIC)  # OpenAI's low view of it


def _widened(arch: str, root: Path, **image_processor: object) -> Path:
    """A copy of the micro model whose processor takes larger pictures (same weights)."""
    dst = root / f"{arch}-wide"
    shutil.copytree(build_model(arch, "micro"), dst)
    config = json.loads((dst / "processor_config.json").read_text())
    config["image_processor"].update(image_processor)
    (dst / "processor_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("detail")
    models = [_widened("qwen2_5_vl", root, size={"longest_edge": 1 << 20, "shortest_edge": 1024}),
              _widened("pixtral", root, size={"longest_edge": 1024}),
              _widened("lfm2_vl", root, max_image_tokens=1024, max_num_patches=4096, tile_size=512,
                       max_pixels_tolerance=2.0),
              _widened("gemma4", root, max_soft_tokens=280), build_model("smolvlm", "micro")]
    args = [a for m in models for a in ("--model", str(m))] + ["--max-model-len", "20000"]
    proc = start_server(args, root / "server.log", timeout=300)
    yield proc
    proc.stop()


def _count(server: ServerProcess, model: str, *parts: tuple[Image.Image, str | None]) -> int:
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image), **({"detail": d} if d else {})}}
               for image, d in parts] + [{"type": "text", "text": "What is this?"}]
    r = httpx.post(server.url + "/tokenize", json={"model": model, "messages": [{"role": "user", "content": content}]},
                   timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


@pytest.mark.parametrize("model", ["qwen2_5_vl-wide", "pixtral-wide", "lfm2_vl-wide"])
def test_low_is_the_picture_fitted_into_512x512(server, model):
    high, low = _count(server, model, (PICTURE, "high")), _count(server, model, (PICTURE, "low"))
    assert _count(server, model, (PICTURE, None)) == _count(server, model, (PICTURE, "auto")) == high
    assert low == _count(server, model, (FITTED, "high")) and low < high / 3, (low, high)
    # per image: a low one beside a high one costs what each costs alone
    assert _count(server, model, (PICTURE, "low"), (PICTURE, "high")) == _count(
        server, model, (FITTED, "high"), (PICTURE, "high"))


def test_gemma4_takes_its_smallest_soft_token_budget_when_every_image_is_low(server):
    model = "gemma4-wide"
    square = PICTURE.crop((0, 0, 768, 768))
    high, low = _count(server, model, (square, "high")), _count(server, model, (square, "low"))
    assert high - low == 256 - 64  # a square: 32x32 patches pooled 2x2 at 280 soft tokens, 16x16 at 70
    mixed = _count(server, model, (square, "low"), (square, "high"))
    assert mixed == 2 * high - _count(server, model)  # one budget per request: the largest asked
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=model, max_tokens=3, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(square), "detail": "low"}},
        {"type": "text", "text": "What is this?"}]}])
    assert r.usage.prompt_tokens == low and r.usage.completion_tokens == 3


def test_a_family_that_sees_one_size_ignores_low(server):
    model = build_model("smolvlm", "micro").name  # the server's name for it: its directory's
    assert _count(server, model, (PICTURE, "low")) == _count(server, model, (PICTURE, "high"))
