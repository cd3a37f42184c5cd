"""Ollama's ``/api/embed`` and legacy ``/api/embeddings`` (api/ollama_embed.py) against a real server holding the
text embedding model of tests/test_api_pooling.py and a chat model, through the official ``ollama`` client and
raw HTTP: the vectors are /v1/embeddings' (mlx-vlm's forward), scaled to unit length where Ollama scales them;
``truncate`` cuts a long input as the model's tokens allow; a chat model asked for embeddings is Ollama's error."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest
from server_utils import ServerProcess, start_server
from test_api_pooling import EMBEDDER, MAX_LEN, TEXTS, close, model_folders, reference

from vlmserve.testing import build_model


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folders(tmp_path_factory.mktemp("pooling"))[EMBEDDER]


@pytest.fixture(scope="module")
def server(embedder: Path, tmp_path_factory: pytest.TempPathFactory):
    chat = build_model("gemma4", "micro")
    args = ["--model", str(embedder), "--model", str(chat), "--served-model-name", EMBEDDER, "--served-model-name", "chat",
            "--max-model-len", str(MAX_LEN)]
    srv = start_server(args, tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def v1(server: ServerProcess, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBEDDER, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_ollama_client_gets_mlx_vlms_embeddings_at_unit_length(client: ollama.Client, embedder: Path,
                                                                    server: ServerProcess):
    out = client.embed(model=EMBEDDER, input=TEXTS)
    assert out.model == EMBEDDER and len(out.embeddings) == len(TEXTS)
    for got, want in zip(out.embeddings, reference(embedder, TEXTS), strict=True):
        close(got, want / np.linalg.norm(want))
    assert out.prompt_eval_count == v1(server, {"input": TEXTS})["usage"]["prompt_tokens"]
    assert 0 <= out.load_duration <= out.total_duration and out.total_duration > 0
    one = client.embed(model=f"{EMBEDDER}:latest", input=TEXTS[0])  # a string is one input; clients add the tag
    close(one.embeddings[0], np.array(out.embeddings[0]))


def test_dimensions_cut_then_rescale_as_v1_embeddings_does(client: ollama.Client, server: ServerProcess):
    short = client.embed(model=EMBEDDER, input=TEXTS[1], dimensions=16).embeddings[0]
    assert len(short) == 16 and abs(np.linalg.norm(short) - 1) < 1e-5
    close(short, np.array(v1(server, {"input": TEXTS[1], "dimensions": 16})["data"][0]["embedding"]))
    with pytest.raises(ollama.ResponseError, match="dimensions 65 is over the model's 64") as refused:
        client.embed(model=EMBEDDER, input="x", dimensions=65)
    assert refused.value.status_code == 400


def test_truncate_cuts_a_long_input_to_the_models_tokens_else_refuses(client: ollama.Client, embedder: Path,
                                                                     server: ServerProcess):
    """Cut to --max-model-len tokens: the vector of the first ones' ids through /v1/embeddings."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedder)
    long = "word " * (MAX_LEN + 5)
    cut = client.embed(model=EMBEDDER, input=[long, "x"])
    assert cut.prompt_eval_count == MAX_LEN + len(tokenizer("x")["input_ids"])
    ids = tokenizer(long)["input_ids"]
    assert len(ids) > MAX_LEN and ids[-1] not in tokenizer.all_special_ids  # this build's tokenizer adds no end
    want = np.array(v1(server, {"input": [ids[:MAX_LEN]]})["data"][0]["embedding"])
    close(cut.embeddings[0], want / np.linalg.norm(want))
    with pytest.raises(ollama.ResponseError, match=rf"input\[0\] has \d+ tokens; .* at most {MAX_LEN}") as refused:
        client.embed(model=EMBEDDER, input=long, truncate=False)
    assert refused.value.status_code == 400


def test_a_cut_keeps_the_end_token_a_last_token_pooler_reads() -> None:
    from types import SimpleNamespace

    from vlmserve.frontend.pooling import _cut

    tokenizer = SimpleNamespace(all_special_ids=[0, 9])
    assert _cut((5, 6, 7, 8, 9), 3, tokenizer) == (5, 6, 9)  # Qwen3-Embedding pools its <|endoftext|>
    assert _cut((5, 6, 7, 8), 3, tokenizer) == (5, 6, 7)
    assert _cut((5, 6, 9), 3, tokenizer) == (5, 6, 9)


def test_the_legacy_endpoint_answers_the_models_own_vector(client: ollama.Client, embedder: Path):
    got = client.embeddings(model=EMBEDDER, prompt=TEXTS[2]).embedding
    close(got, reference(embedder, [TEXTS[2]])[0])
    assert client.embeddings(model=EMBEDDER, prompt="").embedding == []


def test_raw_http_shapes_and_empty_input_only_loads(server: ServerProcess):
    r = httpx.post(f"{server.url}/api/embed", json={"model": EMBEDDER, "input": "hi", "keep_alive": "5m",
                                                    "options": {"num_ctx": 512}}, timeout=60)
    assert r.status_code == 200 and set(r.json()) == {"model", "embeddings", "total_duration", "load_duration",
                                                      "prompt_eval_count"}
    for empty in ("", []):
        r = httpx.post(f"{server.url}/api/embed", json={"model": EMBEDDER, "input": empty}, timeout=60)
        assert r.status_code == 200 and r.json()["embeddings"] == [] and r.json()["prompt_eval_count"] == 0
    r = httpx.post(f"{server.url}/api/embeddings", json={"model": EMBEDDER, "prompt": "hi"}, timeout=60)
    assert r.status_code == 200 and set(r.json()) == {"embedding"} and len(r.json()["embedding"]) == 64


def test_a_chat_model_asked_for_embeddings_is_ollamas_error(client: ollama.Client, server: ServerProcess):
    for path, body in (("/api/embed", {"input": "hi"}), ("/api/embeddings", {"prompt": "hi"})):
        r = httpx.post(f"{server.url}{path}", json={"model": "chat", **body}, timeout=60)
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        assert "'chat' is a generative (chat) model" in r.json()["error"]
    with pytest.raises(ollama.ResponseError, match="is a generative") as refused:
        client.embed(model="chat", input="hi")
    assert refused.value.status_code == 400
    r = httpx.post(f"{server.url}/api/embed", json={"model": "nope", "input": "hi"}, timeout=60)
    assert r.status_code == 404 and set(r.json()) == {"error"}, r.text
