"""Audio through the API of a real server, with the openai SDK: ``input_audio`` content parts on chat, and
``POST /v1/audio/transcriptions``. Served text equals mlx-vlm's own greedy decode (run here, on the same prompt
ids and mel features) read back by the tokenizer; limits and models without audio are OpenAI-shaped 400s."""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
import openai
import pytest
from server_utils import ServerProcess, start_server

from vlmserve.api.transcriptions import INSTRUCTION, WINDOW_S
from vlmserve.preprocess.audio import AudioLimits, decode_audio, pcm_wav, windows
from vlmserve.preprocess.prompt import PromptBuilder
from vlmserve.testing import build_model
from vlmserve.testing.reference import reference_greedy

MAX_TOKENS = 6


def tone(hz: float, seconds: float, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.4 * np.sin(2 * np.pi * hz * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) * 21000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def audio_part(clip: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": fmt}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    models = [build_model("gemma4", "micro", variant="audio"), build_model("gemma4", "micro")]
    args = [a for m in models for a in ("--model", str(m))]
    proc = start_server([*args, "--limit-mm-per-prompt", json.dumps({"audio": 2})],
                        tmp_path_factory.mktemp("audio") / "server.log", timeout=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@cache
def _loaded() -> tuple[Any, Any, PromptBuilder]:
    from mlx_vlm import load

    model, processor = load(str(build_model("gemma4", "micro", variant="audio")))
    return model, processor, PromptBuilder.for_processor(processor)


def expected(parts: list[dict[str, Any]], clips: list[np.ndarray], stop_at_eos: bool = False) -> str:
    """mlx-vlm's greedy answer to one user turn of ``parts`` (``{"type": "audio"}`` for each of ``clips``)."""
    model, processor, builder = _loaded()
    prompt = builder.build([{"role": "user", "content": parts}], audio=clips)
    tokens = reference_greedy(model, prompt, MAX_TOKENS)
    if stop_at_eos:
        ends = set(model.config.eos_token_id)
        tokens = tokens[:next((i for i, t in enumerate(tokens) if t in ends), len(tokens))]
    return str(processor.tokenizer.decode(tokens, skip_special_tokens=True))


def _clip(raw: bytes) -> np.ndarray:
    return decode_audio(raw, "wav", "clip", AudioLimits())


def test_chat_with_input_audio_equals_mlx_vlm(client: openai.OpenAI) -> None:
    name = build_model("gemma4", "micro", variant="audio").name
    clips = [tone(300, 1.2), tone(1200, 2.0)]
    for i, sent in enumerate(([clips[0]], [clips[1]], clips)):
        parts = [{"type": "text", "text": "What do you hear?"}, *(audio_part(c) for c in sent)]
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": parts}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        wanted = expected([parts[0], *({"type": "audio"} for _ in sent)], [_clip(c) for c in sent])
        assert r.choices[0].message.content == wanted, f"case {i}"


@pytest.mark.parametrize("case, model, parts, words", [
    ("no audio tower", "plain", [audio_part(tone(300, 0.5))], "no audio tower"),
    ("three clips", "audio", [audio_part(tone(300, 0.5))] * 3, "3 audio clips is over the limit of 2"),
    ("too long", "audio", [audio_part(tone(300, 31.0))], "30-second limit"),
    ("not base64", "audio", [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}], "base64"),
    ("ogg", "audio", [audio_part(tone(300, 0.5), "ogg")], "format 'ogg' is not supported"),
    ("not audio", "audio", [audio_part(b"\0" * 400)], "cannot decode"),
])
def test_bad_audio_is_a_400_naming_why(client: openai.OpenAI, case: str, model: str, parts: list[Any],
                                       words: str) -> None:
    name = build_model("gemma4", "micro", variant="audio" if model == "audio" else "").name
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=name, max_tokens=2,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}])
    assert words in str(error.value), case


def _transcript(clip: np.ndarray, language: str | None = None) -> str:
    instruction = INSTRUCTION.format(language=f"{language} into {language} text" if language else
                                     "its original language")
    return expected([{"type": "text", "text": instruction}, {"type": "audio"}], [clip], stop_at_eos=True).strip()


def test_transcriptions_through_the_openai_sdk(client: openai.OpenAI) -> None:
    name = build_model("gemma4", "micro", variant="audio").name
    raw = tone(500, 3.0)
    r = client.audio.transcriptions.create(model=name, file=("note.wav", raw), extra_body={"max_tokens": MAX_TOKENS})
    assert r.text == _transcript(_clip(raw)) != ""
    text = client.audio.transcriptions.create(model=name, file=("note.wav", raw), response_format="text",
                                              language="en", extra_body={"max_tokens": MAX_TOKENS})
    assert text == _transcript(_clip(raw), "en")


def test_a_long_file_is_transcribed_in_fixed_windows(client: openai.OpenAI) -> None:
    name = build_model("gemma4", "micro", variant="audio").name
    raw = tone(700, 2 * WINDOW_S + 5.0)
    r = client.audio.transcriptions.create(model=name, file=("long.wav", raw), extra_body={"max_tokens": MAX_TOKENS})
    samples = decode_audio(raw, "wav", "file", AudioLimits(max_seconds=600))
    parts = [_transcript(_clip(pcm_wav(w, 16_000))) for w in windows(samples, 16_000, WINDOW_S)]
    assert len(parts) == 3
    assert r.text == " ".join(p for p in parts if p)


def test_transcription_refusals(client: openai.OpenAI) -> None:
    plain = build_model("gemma4", "micro").name
    with pytest.raises(openai.BadRequestError, match="no audio tower"):
        client.audio.transcriptions.create(model=plain, file=("a.wav", tone(300, 0.5)))
    name = build_model("gemma4", "micro", variant="audio").name
    with pytest.raises(openai.BadRequestError, match="not a mp3, wav file"):
        client.audio.transcriptions.create(model=name, file=("a.ogg", tone(300, 0.5)))


def test_the_readme_example_prints_what_it_says(server: ServerProcess, tmp_path: Any) -> None:
    """docs/embeddings-rerank-audio.md's "Audio" example, against this server (port 8002 and a published name there)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "embeddings-rerank-audio.md").read_text()
    section = page.split("## Audio: ", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```python\n(.*?)^```\n", section, re.S | re.M)
    assert block is not None
    said = re.compile(r"\n*prints `([^`]+)`").match(section, block.end())
    assert said is not None
    code = block[1].replace("http://127.0.0.1:8002", server.url)
    code = code.replace("gemma-4-E2B-it", build_model("gemma4", "micro", variant="audio").name)
    (tmp_path / "speech.wav").write_bytes(tone(440, 1.5))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == said[1]


def test_responses_take_input_audio_as_chat_does(client: openai.OpenAI) -> None:
    name = build_model("gemma4", "micro", variant="audio").name
    clip = tone(300, 1.2)
    r = client.responses.create(model=name, max_output_tokens=MAX_TOKENS, temperature=0,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "What do you hear?"},
                                                                    audio_part(clip)]}],
                                extra_body={"ignore_eos": True})
    parts = [{"type": "text", "text": "What do you hear?"}, audio_part(clip)]
    chat = client.chat.completions.create(model=name, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": parts}])
    assert r.output_text == chat.choices[0].message.content
