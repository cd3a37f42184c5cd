"""Speculative decoding through a real server and the openai client: ``--speculative-config`` and
OpenAI's ``prediction`` on the demo model give the same answer as without, with the prediction's
usage and vLLM's spec_decode counters; configurations that cannot run are refused at start-up."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
PICTURE = base64.b64encode((ROOT / "assets" / "example.png").read_bytes()).decode()
CAPTION = "A red circle, a blue triangle and a yellow star."


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    from server_utils import start_server

    # adaptive false: every draft is verified, whatever this machine's measured costs say (the tests must not vary)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "adaptive": False})
    server = start_server(["--speculative-config", config], tmp_path_factory.mktemp("logs") / "spec.log")
    yield server
    server.stop()


def _caption(client: openai.OpenAI, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model="demo-gemma4", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PICTURE}"}},
            {"type": "text", "text": "Describe this image."}]}], **extra)


def test_a_prediction_gives_the_same_answer_and_its_usage(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    plain = _caption(client)
    close = _caption(client, prediction={"type": "content", "content": "A red circle, a green triangle and a yellow star."})
    assert plain.choices[0].message.content == close.choices[0].message.content == CAPTION
    details = close.usage.completion_tokens_details
    # OpenAI's sense: of the prediction's tokens, those the answer kept and the rest ("green" at least)
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert close.usage.completion_tokens == plain.usage.completion_tokens


def test_a_streamed_prediction_and_the_spec_decode_counters(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(_caption(client, stream=True, stream_options={"include_usage": True},
                           prediction={"type": "content", "content": [{"type": "text", "text": CAPTION}]}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == CAPTION
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    metrics = httpx.get(spec_server.url + "/metrics").text
    counters = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode") and "position" not in line}
    assert counters["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < counters["vllm:spec_decode_num_accepted_tokens_total"] <= counters["vllm:spec_decode_num_draft_tokens_total"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo-gemma4",position="0"}' in metrics
    assert "speculative decoding with ngram drafts (up to 4 tokens, lookup 2-4), drafting whatever it costs" \
        in spec_server.log


def test_completions_take_a_prediction_too(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = httpx.post(spec_server.url + "/tokenize", json={  # a chat prompt, as token ids
        "model": "demo-gemma4", "messages": [{"role": "user", "content": "Describe a red circle."}]}).json()["tokens"]
    args = dict(model="demo-gemma4", prompt=ids, max_tokens=30, temperature=0)
    plain = client.completions.create(**args)
    prediction = {"type": "content", "content": plain.choices[0].text}
    guessed = client.completions.create(**args, extra_body={"prediction": prediction})
    assert guessed.choices[0].text == plain.choices[0].text == "Hello! Show me a picture and I will describe it."
    details = guessed.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and plain.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_a_bad_prediction_is_a_400(spec_server):
    r = httpx.post(spec_server.url + "/v1/chat/completions", json={
        "model": "demo-gemma4", "messages": [{"role": "user", "content": "hi"}],
        "prediction": {"type": "image", "content": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prediction")


@pytest.mark.parametrize(("args", "says"), [
    (["--speculative-config", '{"method": "medusa", "model": "/models/drafter"}'], "not supported yet"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}'], "num_speculative_tokens"),
    (["--speculative-config", "{nope"], "not JSON"),
    (["--draft-model", "/models/drafter", "--draft-kind", "eagle"], "not supported yet"),
    (["--draft-kind", "mtp"], "need --draft-model"),
])
def test_what_cannot_run_is_refused_at_start_up_in_one_line(args, says):
    done = subprocess.run([sys.executable, "-m", "vlmserve.cli", "serve", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.fixture(scope="module")
def drafter_server(tmp_path_factory):
    from server_utils import start_server

    # the demo model's own drafter, by name; every step drafts, whatever this machine's costs say
    config = json.dumps({"method": "mtp", "model": "demo-gemma4-assistant", "num_speculative_tokens": 3,
                         "adaptive": False})
    server = start_server(["--speculative-config", config], tmp_path_factory.mktemp("logs") / "drafter.log")
    yield server
    server.stop()


def test_the_demo_drafter_gives_the_same_caption_and_most_of_its_drafts_are_accepted(drafter_server):
    client = openai.OpenAI(base_url=drafter_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert _caption(client).choices[0].message.content == CAPTION
    streamed = list(_caption(client, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == CAPTION
    metrics = httpx.get(drafter_server.url + "/metrics").text
    counters = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode") and "position" not in line}
    drafted, accepted = counters["vllm:spec_decode_num_draft_tokens_total"], counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and accepted / drafted > 0.5, (accepted, drafted)  # a caption is what it was trained on
    assert "speculative decoding with the drafter" in drafter_server.log and "demo-gemma4-assistant" in drafter_server.log


def test_a_dflash_drafter_by_mlx_vlm_servers_flags_gives_the_same_answer(tmp_path_factory):
    """``--draft-model DIR --draft-kind dflash`` (mlx_vlm.server's spelling) on a Qwen3.5 target: the answer is
    the one the same server gives a request that never drafts (a penalty rules drafts out), and it drafted."""
    from server_utils import start_server

    from vlmserve.testing import build_model
    from vlmserve.testing.qwen3_5 import build_dflash

    target = build_model("qwen3_5", "micro")
    drafter = build_dflash(target, tmp_path_factory.getbasetemp() / "qwen3_5-dflash")
    server = start_server(["--model", str(target), "--draft-model", str(drafter), "--draft-kind", "dflash"],
                          tmp_path_factory.mktemp("logs") / "dflash.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = {"model": str(target), "max_tokens": 16, "temperature": 0,
               "messages": [{"role": "user", "content": "one two three, one two three, again: one two"}]}
        drafted = client.chat.completions.create(**ask).choices[0].message.content
        plain = client.chat.completions.create(**ask, presence_penalty=1e-9).choices[0].message.content
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert drafted == plain
    assert "speculative decoding with the drafter" in server.log and "(dflash, " in server.log
    drafts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafts and drafts[0] > 0
