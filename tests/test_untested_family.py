"""A family no adapter names: served exactly as mlx-vlm serves one request, or refused at start-up in one line.

The architecture: SmolVLM's micro build under its parent's name, ``idefics3`` (mlx-vlm's own Idefics3 classes
and tiling processor), which no adapter names. Its answers, alone and several at once, are mlx-vlm's own prompt
path and greedy decode; a model whose decode would not be is refused. Then every family build tested here,
served as if no adapter named it (the registry without its adapter): each is served exactly or refused.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import scene
from server_utils import start_server

from vlmserve.engine import models
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.loader import ModelLoadError
from vlmserve.engine.models import SUPPORTED_FAMILIES, UNTESTED_OFF, adapter_class
from vlmserve.engine.params import SamplingParams
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.preprocess.prompt import PromptError
from vlmserve.testing import FAMILY_BUILDS, build_family, build_model
from vlmserve.testing.reference import mlx_vlm_answer

TOKENS = 10


def retyped(source: Path, model_type: str, out: Path) -> Path:
    """A copy of a build whose config names another model type (same weights, processor and template)."""
    shutil.copytree(source, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    (out / "vlmserve_build.json").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert adapter_class("idefics3") is None  # untested here: the point of the test
    return retyped(build_model("smolvlm", "micro"), "idefics3", tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def engine(idefics3: Path) -> Iterator[tuple[AsyncEngine, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    started = AsyncEngine(str(idefics3), config=EngineConfig(max_batch_size=8))
    loop.run_until_complete(started.start())
    yield started, loop
    loop.run_until_complete(started.shutdown())
    loop.close()


async def _answer(engine: AsyncEngine, request_id: str, text: str, images: list[Any]) -> list[int]:
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    out: list[int] = []
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    async for step in engine.generate_chat(request_id, [{"role": "user", "content": parts}], images, None, params):
        assert step.error is None, step.error
        out += step.token_ids
    return out


def test_an_untested_family_answers_as_mlx_vlms_own_decode_alone_and_together(engine: Any) -> None:
    served, loop = engine
    assert served.info.adapter == "UntestedAdapter" and served.info.untested == UNTESTED_OFF
    _as_mlx_vlm(served, loop)


def _as_mlx_vlm(served: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
    """Text, one picture and two pictures, alone and all at once, give mlx-vlm's own answers."""
    red, blue = scene("circle", (220, 30, 30)), scene("square", (30, 60, 220), size=80)
    turns = [("What is the capital of France?", []), ("What is in the picture?", [red]),
             ("Which picture is bluer?", [red, blue]), ("Describe it.", [blue])]
    most = served.max_images if served.max_images is not None else 2
    for text, images in (t for t in turns if len(t[1]) > most):  # more than its start-up check could run: refused
        with pytest.raises(PromptError, match=f"takes at most {most} image"):
            loop.run_until_complete(_answer(served, "over", text, images))
    turns = [t for t in turns if len(t[1]) <= most]
    want = [served.worker.call(mlx_vlm_answer, served.loaded, text, images, TOKENS)[1] for text, images in turns]
    alone = [loop.run_until_complete(_answer(served, f"a{i}", *turn)) for i, turn in enumerate(turns)]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(_answer(served, f"b{i}", *turn) for i, turn in enumerate(turns))))

    assert alone == want
    assert loop.run_until_complete(together()) == want
    assert len({tuple(w) for w in want}) == len(want)  # the pictures and words matter


def test_the_server_says_which_adapter_serves_it_and_what_is_off(idefics3: Path, tmp_path: Path) -> None:
    server = start_server(["--model", str(idefics3)], tmp_path / "server.log")
    try:
        (card,) = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        log = server.log
    finally:
        server.stop()
    assert card["adapter"] == "UntestedAdapter" and card["untested"] == list(UNTESTED_OFF)
    assert "3 probes gave mlx-vlm's own prompt ids and greedy choices (up to rounding); decode batching on" in log
    assert "no adapter names this family, so it is served by UntestedAdapter" in log


def test_a_model_whose_prompt_mlx_vlm_builds_otherwise_is_refused_in_one_line(idefics3: Path, tmp_path: Path) -> None:
    """A tokenizer that adds its BOS to every encoding: mlx-vlm's prompt path (which adds special tokens for
    families it does not know to own their markers) writes a second one before the template's, this server's
    prompt does not; equal to mlx-vlm is not possible, so the model is refused (Gemma's double BOS, in a
    family nobody has tried)."""
    model = retyped(idefics3, "idefics3", tmp_path / "model")
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    bos = next(t for t in tokenizer["added_tokens"] if t["content"] == "<|im_start|>")
    tokenizer["post_processor"]["single"].insert(0, {"SpecialToken": {"id": bos["content"], "type_id": 0}})
    tokenizer["post_processor"]["special_tokens"] = {bos["content"]: {
        "id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}}
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(str(model), config=EngineConfig(max_batch_size=8))
    try:
        with pytest.raises(ModelLoadError) as refused:
            loop.run_until_complete(engine.start())
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    line = str(refused.value)
    assert "\n" not in line and "model type 'idefics3' is not served: it is untested here" in line, line
    assert "its prompt ids on a text turn differ from mlx-vlm's own from position 1" in line, line
    assert line.endswith(f"tested families: {', '.join(SUPPORTED_FAMILIES)}")


@pytest.mark.parametrize("build", FAMILY_BUILDS)
def test_every_family_served_as_if_no_adapter_named_it_is_exact_or_refused(build: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The untested path on architectures with every kind of fault it must catch (M-RoPE deltas kept on the
    model, DeepStack, double BOS, templates mlx-vlm renders otherwise, left padding...): with its adapter
    taken out of the registry, each family is refused in one line, or served with mlx-vlm's own answers."""
    arch = build.partition("/")[0]
    monkeypatch.setattr(models, "_ADAPTERS", tuple(a for a in models._ADAPTERS if arch not in a.model_types))
    loop = asyncio.new_event_loop()
    served = AsyncEngine(str(build_family(build)), config=EngineConfig(max_batch_size=8))
    try:
        loop.run_until_complete(served.start())
    except ModelLoadError as refused:
        line = str(refused)
        assert "\n" not in line and f"model type {arch!r} is not served: it is untested here" in line, line
        return
    else:
        assert served.info.adapter == "UntestedAdapter"
        _as_mlx_vlm(served, loop)
    finally:
        loop.run_until_complete(served.shutdown())
        loop.close()
