"""inspect-ai on a local image task against a real server on the demo model, through chat completions and
through the Responses API (its ``openai-api`` provider), as its users run it: ``inspect eval``.

inspect-ai 0.3.285's OpenAI-compatible provider wants openai 3.4 or newer, and instructor (the test
extra's) wants openai below 3: they cannot share one environment. So inspect-ai gets a virtual
environment of its own, made once and kept in the model cache (``~/.cache/vlmserve/venvs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vlmserve.testing import model_cache_dir

ROOT = Path(__file__).resolve().parent.parent
INSPECT = "inspect-ai==0.3.285"
CAPTION = "A red circle, a blue triangle and a yellow star."
TASK = textwrap.dedent(f'''
    import base64
    from pathlib import Path

    from inspect_ai import Task, task
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ChatMessageUser, ContentImage, ContentText
    from inspect_ai.scorer import match
    from inspect_ai.solver import generate


    @task
    def shapes():
        picture = Path({str(ROOT / "assets" / "example.png")!r}).read_bytes()
        url = "data:image/png;base64," + base64.b64encode(picture).decode()
        ask = ChatMessageUser(content=[ContentImage(image=url), ContentText(text="Describe this image.")])
        return Task(dataset=[Sample(input=[ask], target={CAPTION!r})], solver=generate(),
                    scorer=match(location="exact"))
''')


@pytest.fixture(scope="module")
def inspect_bin() -> Path:
    """inspect-ai's own environment (made once, with a progress note), and its ``inspect`` command."""
    venv = model_cache_dir().parent / "venvs" / INSPECT.replace("==", "-")
    command = venv / "bin" / "inspect"
    if not command.exists():
        print(f"making {venv} for {INSPECT} (once, about a minute)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        done = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", INSPECT, "openai>=3.4"],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0 and command.exists(), done.stderr[-2000:]
    return command


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_utils import start_server

    server = start_server([], tmp_path_factory.mktemp("logs") / "inspect.log")
    yield server
    server.stop()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_inspect_ai_scores_an_image_task(inspect_bin, server, tmp_path, api):
    (tmp_path / "shapes.py").write_text(TASK)
    env = {**os.environ, "VLMSERVE_BASE_URL": server.url + "/v1", "VLMSERVE_API_KEY": "unused"}
    extra = ["-M", "responses_api=true"] if api == "responses" else []
    done = subprocess.run([str(inspect_bin), "eval", "shapes.py", "--model", "openai-api/vlmserve/demo-gemma4",
                           *extra, "--temperature", "0", "--log-dir", "logs", "--log-format", "json",
                           "--display", "none"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (log,) = (tmp_path / "logs").glob("*.json")
    result = json.loads(log.read_text())
    assert result["status"] == "success"
    scores = result["results"]["scores"][0]["metrics"]
    assert scores["accuracy"]["value"] == 1.0  # the exact caption
    assert ("vlmserve.requests: resp_" if api == "responses" else "vlmserve.requests: chatcmpl-") in server.log
