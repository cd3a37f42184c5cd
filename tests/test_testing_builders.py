"""Tests for vlmserve.testing: offline model builders that mlx_vlm.load loads for real."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vlmserve.testing import ARCHS, build_model, model_cache_dir

MB = 1_000_000


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private shared cache for this session, so tests never touch ~/.cache."""
    path = tmp_path_factory.mktemp("model-cache")
    old = os.environ.get("VLMSERVE_MODEL_CACHE")
    os.environ["VLMSERVE_MODEL_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["VLMSERVE_MODEL_CACHE"]
    else:
        os.environ["VLMSERVE_MODEL_CACHE"] = old


@pytest.fixture(scope="session", params=ARCHS)
def micro(request: pytest.FixtureRequest) -> Path:
    return build_model(request.param, "micro")


@pytest.fixture(scope="session")
def loaded(micro: Path) -> tuple[Any, Any]:
    from mlx_vlm import load

    return load(str(micro))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def red_square() -> Image.Image:
    return Image.new("RGB", (96, 96), (220, 30, 30))


def noise() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_of(processor: Any, image: Image.Image | None, text: str = "Describe it.") -> Any:
    """The prompt as vlmserve builds it from a chat (its own phase 1, through the real template)."""
    from vlmserve.preprocess.prompt import PromptBuilder

    images = [image] if image is not None else []
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    system = {"role": "system", "content": "Be brief."}  # Mistral 3's template writes a long dated one without
    return PromptBuilder.for_processor(processor).build([system, {"role": "user", "content": parts}], images)


def greedy(model: Any, processor: Any, image: Image.Image | None, max_tokens: int = 12) -> list[int]:
    """mlx-vlm's own greedy decode (the step function ``mlx_vlm.generate`` runs) on that prompt."""
    from vlmserve.testing.reference import reference_greedy

    return reference_greedy(model, prompt_of(processor, image), max_tokens)


def test_unknown_arch_or_size_raises() -> None:
    with pytest.raises(ValueError, match="unknown arch 'llama9'"):
        build_model("llama9")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        build_model("gemma4", "huge")


def test_cache_dir_follows_env(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_cache_dir() == model_cache
    monkeypatch.delenv("VLMSERVE_MODEL_CACHE")
    assert model_cache_dir() == Path.home() / ".cache" / "vlmserve" / "models"


def test_micro_is_under_one_megabyte(micro: Path) -> None:
    assert (micro / "model.safetensors").stat().st_size < MB
    assert json.loads((micro / "vlmserve_build.json").read_text())["dtype"] == "float32"


def test_builds_are_byte_identical(micro: Path, tmp_path: Path) -> None:
    arch = json.loads((micro / "vlmserve_build.json").read_text())["key"]["arch"]
    again = build_model(arch, "micro", out=tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(again / name) == sha256(micro / name), name


def test_other_seed_gives_other_weights(tmp_path: Path) -> None:
    other = build_model("gemma4", "micro", out=tmp_path / "seed1", seed=1)
    plain = build_model("gemma4", "micro")
    assert sha256(other / "model.safetensors") != sha256(plain / "model.safetensors")


def test_cache_hit_returns_without_rebuilding(micro: Path) -> None:
    arch = json.loads((micro / "vlmserve_build.json").read_text())["key"]["arch"]
    mtime = (micro / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert build_model(arch, "micro") == micro
    assert time.perf_counter() - start < 0.5
    assert (micro / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in micro.parent.iterdir() if p.name.endswith(".tmp")]  # no leftovers


def test_out_dir_is_reused_and_force_rebuilds(tmp_path: Path) -> None:
    out = build_model("gemma4", out=tmp_path / "m")
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_model("gemma4", out=out) == out and weights.stat().st_mtime_ns == mtime
    inode = weights.stat().st_ino
    build_model("gemma4", out=out, force=True)
    assert weights.stat().st_ino != inode


def test_refuses_to_replace_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_model("gemma4", out=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("arch", ARCHS)
def test_small_has_5_to_20_million_parameters(arch: str) -> None:
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    from vlmserve.testing.build import load_recipe

    path = build_model(arch, "small")
    info = json.loads((path / "vlmserve_build.json").read_text())
    assert 5_000_000 <= info["parameters"] <= 20_000_000
    model, _ = load(str(path))
    dtypes = {str(v.dtype) for _, v in tree_flatten(model.parameters())}
    assert dtypes == {f"mlx.core.{load_recipe(arch, 'small').dims.dtype}"}  # bf16, or the real fp16 (LLaVA-NeXT)


def test_loads_and_generates_text(loaded: tuple[Any, Any]) -> None:
    model, processor = loaded
    tokens = greedy(model, processor, red_square())
    assert processor.tokenizer.decode(tokens).strip()
    assert len(set(tokens)) > 3  # not collapsed into repeating one token


def test_output_depends_on_the_image(loaded: tuple[Any, Any]) -> None:
    model, processor = loaded
    assert greedy(model, processor, red_square()) != greedy(model, processor, noise())


def test_prompt_has_one_bos_and_expanded_image_tokens(loaded: tuple[Any, Any], micro: Path) -> None:
    """One BOS where the family has one (template or tokenizer writes it, never both), and the
    recipe's count of image tokens for a square image."""
    from vlmserve.testing.build import load_recipe

    model, processor = loaded
    tokenizer = processor.tokenizer
    ids = prompt_of(processor, red_square()).input_ids
    bos = tokenizer.bos_token_id if tokenizer.bos_token else None  # Qwen has none
    assert ids.count(bos) == (0 if bos is None else 1)
    config = json.loads((micro / "config.json").read_text())
    image_id = config.get("image_token_id", config.get("image_token_index"))
    arch = json.loads((micro / "vlmserve_build.json").read_text())["key"]["arch"]
    assert ids.count(image_id) == load_recipe(arch, "micro").dims.image_tokens


def test_ignore_eos_runs_to_max_tokens(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_vlm import load

    path = build_model("gemma4", out=tmp_path / "noeos", ignore_eos=True)
    model, processor = load(str(path))
    key = "language_model.model.embed_tokens.weight"
    embed = model.language_model.model.embed_tokens.weight
    plain = mx.load(str(build_model("gemma4") / "model.safetensors"))[key]
    n_special = 24  # gemma4.SPECIAL_TOKENS
    assert mx.all(embed[:n_special] == 0).item()
    assert mx.array_equal(embed[n_special:], plain[n_special:]).item()  # only those rows change
    for image in (red_square(), noise(), None):
        tokens = greedy(model, processor, image, max_tokens=40)
        assert len(tokens) == 40 and min(tokens) >= n_special


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather.",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string", "description": "City"}},
                "required": ["location"],
            },
        },
    }
]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"location": "Tokyo"}},
}


def gemma4_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_model("gemma4")))


def test_gemma4_template_renders_tools_and_calls() -> None:
    from mlx_vlm.tools.parsers.gemma4 import parse_tool_call
    from mlx_vlm.tools.registry import _infer_tool_parser

    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image"},
                {"type": "text", "text": "Weather?"},
            ],
        },
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    tokenizer = gemma4_tokenizer()
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<bos><|turn>system\nBe brief."
        '<|tool>declaration:get_weather{description:<|"|>Get the weather.<|"|>,'
        'parameters:{properties:{location:{description:<|"|>City<|"|>,type:<|"|>STRING<|"|>}},'
        'required:[<|"|>location<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
        "<|turn>user\nLook:<|image|>Weather?<turn|>\n"
        "<|turn>model\n"
        '<|tool_call>call:get_weather{location:<|"|>Tokyo<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>Sunny<|"|>}<tool_response|>'
        "It is sunny.<turn|>\n"
        "<|turn>user\nThanks<turn|>\n<|turn>model\n"
    )
    call = text[text.index("<|tool_call>") : text.index("<tool_call|>") + len("<tool_call|>")]
    assert json.loads(parse_tool_call(call)["arguments"]) == {"location": "Tokyo"}
    assert _infer_tool_parser(tokenizer.chat_template) == "gemma4"


def test_gemma4_template_awaits_tool_results() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
    ]
    text = gemma4_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    call = '<|tool_call>call:get_weather{location:<|"|>Tokyo<|"|>}<tool_call|>'
    assert text.endswith(f"<|turn>model\n{call}<|tool_response>")  # no new turn: results next


def test_special_tokens_have_low_ids_and_match_config() -> None:
    tokenizer = gemma4_tokenizer()
    config = json.loads((build_model("gemma4") / "config.json").read_text())
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<eos>", "<bos>", "<|image|>"]) == [0, 1, 2, 7]
    assert tokenizer.image_token_id == config["image_token_id"]
    eos = tokenizer.convert_tokens_to_ids(["<eos>", "<turn|>", "<|tool_response>"])
    assert config["eos_token_id"] == eos
    assert max(tokenizer.all_special_ids) < 24


def test_gemma3_template_is_gemma3_style() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_model("gemma3")))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_tool_tuning_trains_on_the_chats_the_api_hands_the_template() -> None:
    """tool_tuning writes its chats in the template's form (the builders stay below the API); they must be
    what the API's own conversion makes of the OpenAI-shaped chats, or the tuned models learn another prompt."""
    from vlmserve.api.messages import to_chat_input
    from vlmserve.api.schemas import ChatCompletionRequest
    from vlmserve.preprocess.media import MediaPolicy
    from vlmserve.testing import tool_tuning as tt

    def converted(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        body = {"model": "m", "messages": messages, "tools": [tt.WEATHER_TOOL]}
        return to_chat_input(ChatCompletionRequest.model_validate(body), MediaPolicy(max_images=0)).messages

    call_turn = {"role": "assistant", "content": None, "tool_calls": [tt.CALL]}
    assert converted([*tt.ASK, call_turn]) == [*tt.ASK, tt.TEMPLATE_CALL_TURN]
    assert converted(tt.AFTER_CALL) == tt.TEMPLATE_AFTER_CALL
