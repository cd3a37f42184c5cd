"""The flags and fields people bring from vLLM (issue 32): --served-model-name, --max-num-seqs,
--limit-mm-per-prompt, /v1/models' max_model_len and created, and x-request-id on every response.
One real ``vlmserve serve`` of the micro Gemma 4, the official openai client."""

from __future__ import annotations

import json
import ssl
import time

import httpx
import openai
import pytest
from conftest import scene
from server_utils import image_data_url, start_server

NAMES = ("demo-vlm", "other-name")


@pytest.fixture(scope="module")
def server(gemma4_micro, tmp_path_factory):
    args = ["--model", str(gemma4_micro), "--served-model-name", *NAMES, "--max-num-seqs", "2", "--trust-remote-code",
            "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0})]
    proc = start_server(args, tmp_path_factory.mktemp("familiar") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_served_model_names_replace_the_path(server, client, gemma4_micro):
    (card,) = client.models.list().data
    assert card.id == NAMES[0]
    assert card.model_extra["max_model_len"] > 0 and abs(card.created - time.time()) < 3600
    for name in NAMES:
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.model == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=gemma4_micro.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)


def test_familiar_flags_set_what_ours_do():
    from vlmserve.cli import _parser, serve_config

    config = serve_config(_parser().parse_args(["serve", "--max-num-seqs", "3", "--served-model-name", "a", "b",
                                                "--limit-mm-per-prompt", '{"image": 2}']))
    assert config.engine.max_batch_size == 3 and config.served_names == (("a", "b"),) and config.max_images == 2


def test_limit_mm_per_prompt_counts_images(client):
    picture = {"type": "image_url", "image_url": {"url": image_data_url(scene("circle", (200, 30, 30)))}}
    one = [{"role": "user", "content": [picture, {"type": "text", "text": "what?"}]}]
    assert client.chat.completions.create(model=NAMES[0], messages=one, max_tokens=2).choices
    two = [{"role": "user", "content": [picture, picture, {"type": "text", "text": "what?"}]}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAMES[0], messages=two, max_tokens=2)
    assert "2 images is over the limit of 1" in str(refused.value)


def test_every_response_carries_a_request_id(server):
    mine = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-Id": "trace-42"}, timeout=60,
                      json={"model": NAMES[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "trace-42"
    made = [httpx.get(server.url + "/health"), httpx.get(server.url + "/v1/models/nope"),
            httpx.post(server.url + "/v1/chat/completions", content=b"{not json"),
            httpx.get(server.url + "/health", headers={"X-Request-Id": "bad id with spaces"})]
    assert [r.status_code for r in made] == [200, 404, 400, 200]
    ids = [r.headers["x-request-id"] for r in made]
    assert len(set(ids)) == 4 and all(len(i) == 32 for i in ids)


def test_https_with_a_certificate(gemma4_micro, tmp_path):
    """--ssl-keyfile/--ssl-certfile: the openai client, trusting the self-signed certificate, chats over TLS."""
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = start_server(["--model", str(gemma4_micro), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
                          tmp_path / "server.log", wait_ready=False)
    base, trusted = f"https://127.0.0.1:{server.port}", ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/ready", verify=trusted, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log
            time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=trusted, timeout=60))
        reply = client.chat.completions.create(model=gemma4_micro.name, max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)  # plain HTTP is not served
        assert f"on https://127.0.0.1:{server.port}" in server.log
    finally:
        server.stop()


TEMPLATE = ("{% for m in messages %}<|turn>{{ m.role }}\nCUSTOM {{ m.content if m.content is string else "
            "m.content | map(attribute='text') | join }}<turn|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|turn>model\n{% endif %}")


@pytest.mark.parametrize("as_file", [True, False])
def test_chat_template_replaces_the_models_own(gemma4_micro, tmp_path, as_file):
    """--chat-template, a file or the template itself: the prompt is what it writes."""
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    server = start_server(["--model", str(gemma4_micro), "--chat-template", str(path) if as_file else TEMPLATE],
                          tmp_path / "server.log")
    try:
        messages = [{"role": "user", "content": "hello there"}]
        ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert text.endswith("user\nCUSTOM hello there<turn|>\n<|turn>model\n"), text
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.chat.completions.create(model=gemma4_micro.name, messages=messages, max_tokens=2).choices
    finally:
        server.stop()


@pytest.mark.parametrize("args, says", [
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--ssl-keyfile", "/nonexistent.pem"], "go together"),
    (["--limit-mm-per-prompt", '{"speech": 1}'], "--limit-mm-per-prompt"),
    (["--limit-mm-per-prompt", "image=4"], "not JSON"),
    (["--served-model-name", "a", "--served-model-name", "b"], "once per --model"),
])
def test_bad_familiar_flags_are_one_line_usage_errors(args, says, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vlmserve", "serve", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr
