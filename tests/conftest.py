"""Shared fixtures: the offline micro models, a running engine, and request helpers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.testing import build_model

# Every command a test starts runs on the same BLAS (and so serves the same dtype with --dtype
# auto) whether or not this machine has OpenBLAS installed; test_engine_dtype covers float32.
os.environ["VLMSERVE_NO_OPENBLAS"] = "1"


@pytest.fixture(scope="session")
def gemma4_micro() -> Path:
    return build_model("gemma4", "micro")


@pytest.fixture(scope="session")
def gemma3_micro() -> Path:
    return build_model("gemma3", "micro")


@contextlib.asynccontextmanager
async def running_engine(path: Path, **config: Any) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(str(path), config=EngineConfig(**config))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()



def anon_rss_kib() -> int:
    """This process's anonymous resident memory (the heap, MLX's buffers; not mapped files), in KiB."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon"))

@dataclass(slots=True)
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[Any] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def chat(text: str, n_images: int = 0) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


async def collect(engine: AsyncEngine, request_id: str, text: str, images: list[Image.Image] = (),
                  params: SamplingParams = SamplingParams(max_tokens=12)) -> Result:
    """Run one chat request to the end and gather everything it produced."""
    return await gather(engine.generate_chat(request_id, chat(text, len(images)), list(images), None, params))


async def gather(stream: AsyncIterator[Any]) -> Result:
    """Everything one request's stream of outputs produced, to its end."""
    result = Result()
    async for out in stream:
        result.token_ids += out.token_ids
        result.text += out.text
        result.logprobs += out.logprobs
        result.finish_reason, result.error = out.finish_reason, out.error
        result.num_prompt_tokens, result.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
    return result


def scene(kind: str, color: tuple[int, int, int], size: int = 96) -> Image.Image:
    """A distinct synthetic image: one shape on a light background."""
    image = Image.new("RGB", (size, size), (240, 240, 235))
    draw = ImageDraw.Draw(image)
    box = (size // 5, size // 5, 4 * size // 5, 4 * size // 5)
    if kind == "circle":
        draw.ellipse(box, fill=color)
    elif kind == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(size // 2, size // 6), (size // 6, 5 * size // 6), (5 * size // 6, 5 * size // 6)], fill=color)
    return image


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    scene("circle", (220, 30, 30)).save(directory / "red.png")
    return directory


@pytest.fixture(scope="session")
def server(gemma4_micro, media_dir, tmp_path_factory):
    """One real ``vlmserve serve`` for the API tests that do not need their own."""
    from server_utils import start_server

    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = ["--model", str(gemma4_micro), "--allowed-media-dir", str(media_dir), "--allow-remote-images", "--max-model-len", "400",
            "--max-request-mb", "2"]
    proc = start_server(args, log)
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model_name(gemma4_micro) -> str:
    return gemma4_micro.name  # a directory answers to its base name too


@pytest.fixture(scope="session")
def demo_f32_server(tmp_path_factory):
    """The demo model served in float32, for scores compared with ``demo_reference`` (harness tests)."""
    from server_utils import start_server

    server = start_server(["--dtype", "float32"], tmp_path_factory.mktemp("logs") / "demo-f32.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_reference() -> Any:
    """Each token's logprob given those before it (token ids in), from one whole float32 forward of
    mlx-vlm's demo model, on this thread."""
    import mlx.core as mx
    from mlx_vlm import load

    from vlmserve.config import DEMO_MODEL_DIR
    from vlmserve.inputs import PromptInputs
    from vlmserve.testing.reference import reference_prompt_logprobs

    model, _ = load(str(DEMO_MODEL_DIR))
    model.set_dtype(mx.float32)
    return lambda ids: reference_prompt_logprobs(model, PromptInputs(list(ids)))


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """One real ``vlmserve serve`` on the built-in demo model (no --model), for the tests that need
    a model that answers sensibly."""
    from server_utils import start_server

    server = start_server([], tmp_path_factory.mktemp("logs") / "demo-server.log")
    yield server
    server.stop()


@pytest.fixture
def demo_client(demo_server):
    import openai

    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reply_message(arch: str, parser: str, reply: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A model's reply text, as its micro build's token ids, through the real output path one token at a time
    (detokenized skipping special tokens, tool calls parsed by ``parser``): the OpenAI message it ends in."""
    from transformers import AutoTokenizer

    from vlmserve.api.openai_format import ChoiceBuilder
    from vlmserve.engine.request import StepOutput
    from vlmserve.frontend.output import OutputProcessor
    from vlmserve.testing import build_model

    tokenizer = AutoTokenizer.from_pretrained(str(build_model(arch, "micro")))
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    processor = OutputProcessor(tokenizer, skip_special_tokens=True)
    builder = ChoiceBuilder("chatcmpl-x", "m", tokenizer, parser, tools)
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        builder.step(processor.process(StepOutput("r", (token,), finish_reason="stop" if last else None,
                                                  num_prompt_tokens=10)))
    message: dict[str, Any] = builder.response(builder.finish_reason("stop"), False)["choices"][0]["message"]
    return message
