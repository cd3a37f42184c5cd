"""``vlmserve caption`` as a user runs it: streamed text, and one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
from dataclasses import field, make_dataclass
from typing import Any

import pytest
from conftest import scene
from PIL import Image


def _caption(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmserve.cli", "caption", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    red = scene("circle", (220, 30, 30))
    red.save(d / "red.png")
    red.save(d / "red.jpg", quality=90)
    red.save(d / "red.webp")
    frames = [scene("square", (30, 60, 220)), scene("triangle", (30, 170, 60))]
    frames[0].save(d / "anim.gif", save_all=True, append_images=frames[1:])
    (d / "notes.txt").write_text("not an image")
    buf = io.BytesIO()
    red.save(buf, format="PNG")
    (d / "truncated.png").write_bytes(buf.getvalue()[:100])
    Image.new("1", (9000, 9000)).save(d / "huge.png")
    return d


@pytest.mark.parametrize("name", ["red.png", "red.jpg", "red.webp", "anim.gif"])
def test_caption_prints_text(gemma4_micro, images, name):
    result = _caption(str(images / name), "--model", str(gemma4_micro), "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and result.stdout.endswith("\n")


def test_same_image_same_caption_and_prompt_matters(gemma4_micro, images):
    a = _caption(str(images / "red.png"), "--model", str(gemma4_micro), "--max-tokens", "8").stdout
    b = _caption(str(images / "red.png"), "--model", str(gemma4_micro), "--max-tokens", "8").stdout
    c = _caption(str(images / "anim.gif"), "--model", str(gemma4_micro), "--max-tokens", "8").stdout
    assert a == b and a != c


@pytest.mark.parametrize("name, says", [
    ("missing.png", "no such file"),
    ("notes.txt", "not an image"),
    ("truncated.png", "truncated or corrupt"),
    ("huge.png", "pixel limit"),
])
def test_bad_images_exit_2_with_one_line(images, name, says):
    result = _caption(str(images / name), "--model", "/nonexistent/never/loaded")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr and "Traceback" not in result.stderr


def test_a_model_that_cannot_load_exits_2(images, tmp_path):
    result = _caption(str(images / "red.png"), "--model", str(tmp_path / "no" / "model"))
    assert result.returncode == 2 and "cannot load model" in result.stderr and "Traceback" not in result.stderr


def _vlmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmserve.cli", *args], capture_output=True, text=True, timeout=60)


def test_version():
    from vlmserve import __version__

    out = _vlmserve("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"vlmserve {__version__}"


@pytest.mark.parametrize("command", ["caption", "serve", "build-model", "train-demo", "eval-demo"])
def test_every_option_shows_its_default_and_its_choices(command):
    from vlmserve.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if a.choices and command in a.choices).choices[command]
    text = _vlmserve(command, "--help").stdout
    for action in sub._actions:
        if not action.option_strings or action.help == "show this help message and exit":
            continue
        shown = " ".join(action.help.split())
        if action.default is not None and action.default is not False and action.default not in ([], "==SUPPRESS=="):
            assert "default" in shown.lower() or f"(default: {action.default})" in " ".join(text.split()), action.dest
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in text, action.dest
    assert "--log-level" in text  # accepted after the command as well as before it


def test_log_level_works_after_the_command(tmp_path):
    before = _vlmserve("--log-level", "debug", "build-model", "--arch", "nope")
    after = _vlmserve("build-model", "--arch", "nope", "--log-level", "debug")
    assert before.returncode == after.returncode == 2 and "invalid choice: 'nope'" in after.stderr
    ok = _vlmserve("build-model", "--log-level", "error", "--out", str(tmp_path / "m"), "--size", "micro")
    assert ok.returncode == 0, ok.stderr


def test_serve_defaults_are_the_config_dataclasses_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each default is written once, in ServeConfig or EngineConfig: the command line reads them."""
    from vlmserve.cli import _parser, serve_config
    from vlmserve.config import CaptionConfig, EngineConfig, ServeConfig

    monkeypatch.delenv("VLMSERVE_API_KEY", raising=False)
    assert serve_config(_parser().parse_args(["serve"])) == ServeConfig()
    caption = _parser().parse_args(["caption", "x.png"])
    assert (caption.prompt, caption.max_tokens, caption.temperature, caption.dtype) == (
        CaptionConfig.__dataclass_fields__["prompt"].default, CaptionConfig.__dataclass_fields__["max_tokens"].default,
        CaptionConfig.__dataclass_fields__["temperature"].default, CaptionConfig.__dataclass_fields__["dtype"].default)
    engine = EngineConfig()
    flags = {"--max-batch-size": engine.max_batch_size, "--max-queue": engine.max_queue,
             "--prefill-chunk": engine.prefill_chunk, "--stream-step-share": engine.stream_step_share,
             "--stream-step-share-max": engine.stream_step_share_max,
             "--encoder-budget": engine.encoder_budget, "--stream-stall-timeout": engine.stall_timeout_s,
             "--default-max-tokens": ServeConfig().default_max_tokens}
    text = " ".join(_help("serve").split())
    for flag, value in flags.items():
        after = text.rsplit(f"{flag} {flag.lstrip('-').upper().replace('-', '_')}", 1)[1]  # the option's help
        assert f"(default: {value})" in after.split(" --", 1)[0], flag


def _changed(cls: type, **defaults: Any) -> type:
    """``cls`` with other defaults: what editing the one place each is written does."""
    return make_dataclass(f"Changed{cls.__name__}", [(k, Any, field(default=v)) for k, v in defaults.items()],
                          bases=(cls,), frozen=True)


def _option_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """The option's lines of ``--help``, as argparse prints them, on one line."""
    formatter = parser._get_formatter()  # noqa: SLF001
    formatter.add_argument(next(a for a in parser._actions if flag in a.option_strings))  # noqa: SLF001
    return " ".join(formatter.format_help().split())


def test_a_default_changed_in_its_dataclass_changes_the_flag_and_its_help(monkeypatch: pytest.MonkeyPatch) -> None:
    from vlmserve import cli
    from vlmserve.config import CaptionConfig, EngineConfig, ServeConfig

    engine = _changed(EngineConfig, max_batch_size=3, max_queue=5, prefill_chunk=96, stream_step_share=1.5,
                      encoder_budget=2, vision_cache_bytes=96 << 20, stall_timeout_s=7.5, dtype="float16")
    serve = _changed(ServeConfig, host="0.0.0.0", port=8123, default_max_tokens=77, max_request_bytes=3 << 20,
                     shutdown_timeout=2.5, log_level="debug", header_timeout_s=3.5, keep_alive_timeout_s=4.5)
    serve = make_dataclass("ChangedServeConfig", [("engine", Any, field(default_factory=engine))], bases=(serve,),
                           frozen=True)
    caption = _changed(CaptionConfig, prompt="What is it?", max_tokens=9, temperature=0.5, dtype="model")

    def build_model(arch: str = "qwen2_vl", size: str = "small", *, seed: int = 7, quant_bits: int = 4) -> None: ...

    for name, value in [("EngineConfig", engine), ("ServeConfig", serve), ("CaptionConfig", caption),
                        ("build_model", build_model)]:
        monkeypatch.setattr(cli, name, value)
    monkeypatch.delenv("VLMSERVE_API_KEY", raising=False)
    parser = cli._parser()  # noqa: SLF001
    assert cli.serve_config(parser.parse_args(["serve"])) == serve()
    shown = {"serve": {"--max-batch-size": 3, "--max-queue": 5, "--prefill-chunk": 96, "--stream-step-share": 1.5,
                       "--encoder-budget": 2, "--vision-cache-mb": 96.0, "--stream-stall-timeout": 7.5,
                       "--dtype": "float16", "--host": "0.0.0.0", "--port": 8123, "--default-max-tokens": 77,
                       "--max-request-mb": 3.0, "--shutdown-timeout": 2.5, "--header-timeout": 3.5,
                       "--keep-alive-timeout": 4.5},
             "caption": {"--prompt": "What is it?", "--max-tokens": 9, "--temperature": 0.5, "--dtype": "model"},
             "build-model": {"--arch": "qwen2_vl", "--size": "small", "--seed": 7, "--quant-bits": 4}}
    commands = next(a for a in parser._actions if isinstance(a.choices, dict)).choices  # noqa: SLF001
    for command, flags in shown.items():
        for flag, value in flags.items():
            assert f"(default: {value})" in _option_help(commands[command], flag), (command, flag)
    args = parser.parse_args(["build-model"])
    assert (args.arch, args.size, args.seed, args.quant_bits) == ("qwen2_vl", "small", 7, 4)
    args = parser.parse_args(["caption", "x.png"])
    assert (args.prompt, args.max_tokens, args.temperature, args.dtype) == ("What is it?", 9, 0.5, "model")
    assert "(default: debug for serve, warning otherwise)" in _option_help(parser, "--log-level")


def _help(command: str) -> str:
    from vlmserve.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a.choices, dict))  # noqa: SLF001
    return sub.choices[command].format_help()


def test_draft_model_is_the_mtp_config_and_the_demo_drafter_goes_by_name():
    from vlmserve.cli import _parser, serve_config
    from vlmserve.config import DEMO_DRAFTER_DIR

    config = serve_config(_parser().parse_args(["serve", "--draft-model", "demo-gemma4-assistant",
                                                "--draft-block-size", "3"]))
    spec = config.engine.speculative
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", str(DEMO_DRAFTER_DIR), 2)
    assert (DEMO_DRAFTER_DIR / "model.safetensors").is_file()  # package data
    same = serve_config(_parser().parse_args(["serve", "--speculative-config",
                                              '{"method": "mtp", "model": "demo-gemma4-assistant"}']))
    assert same.engine.speculative is not None and same.engine.speculative.model == str(DEMO_DRAFTER_DIR)
    both = serve_config(_parser().parse_args(["serve", "--draft-model", "x", "--speculative-config", "{}"]))
    assert isinstance(both, str) and "one of them" in both
