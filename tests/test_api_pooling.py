"""``/v1/embeddings`` and ``/v1/rerank`` (api/pooling.py) against a real server holding a text embedding model, a
Qwen3-VL embedding model and a Qwen3 reranker (vlmserve/testing/pooling_models.py), through the clients people use:
the openai SDK, LangChain's ``OpenAIEmbeddings``, and httpx as LlamaIndex's, Jina's and Cohere's rerank clients
send it. Embeddings equal mlx-vlm's own forward; batched equal alone; rerank scores equal mlx-vlm's forward of the
model card's prompt; limits and wrong kinds are OpenAI-shaped 400s."""

from __future__ import annotations

import base64
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from openai import NOT_GIVEN, BadRequestError, OpenAI
from PIL import Image
from server_utils import ServerProcess, image_data_url, start_server

from vlmserve.frontend.pooling import DEFAULT_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX
from vlmserve.testing.pooling_models import build_pooling_model

EMBEDDER, VL_EMBEDDER, RERANKER = "Qwen3-Embedding-0.6B", "Qwen3-VL-Embedding-2B", "Qwen3-Reranker-0.6B"
CROSS_ENCODER = "ms-marco-MiniLM-L-6-v2"
MAX_LEN = 400  # --max-model-len: tokens per input
TEXTS = ["The cat sat on the mat.", "def add(a, b):\n    return a + b", "import numpy as np", "x"]
PAGE = Path(__file__).resolve().parents[1] / "docs" / "embeddings-rerank-audio.md"  # its examples run here


def model_folders(root: Path) -> dict[str, Path]:
    """Copies under the published names (a directory answers to its base name)."""
    built = {EMBEDDER: "text_embedder", VL_EMBEDDER: "vl_embedder", RERANKER: "reranker", CROSS_ENCODER: "cross_encoder"}
    folders = {name: root / name for name in built}
    for name, kind in built.items():
        shutil.copytree(build_pooling_model(kind), folders[name])
    return folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return model_folders(tmp_path_factory.mktemp("pooling"))


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    args = [a for f in folders.values() for a in ("--model", str(f))]
    srv = start_server([*args, "--max-model-len", str(MAX_LEN)], tmp_path_factory.mktemp("log") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def reference(folder: Path, texts: list[str]) -> list[np.ndarray]:
    """mlx-vlm's own embeddings server code, one text at a time (``mlx_vlm.server.embeddings._embed``)."""
    from mlx_vlm.embedding_loader import load_embedding_model
    from mlx_vlm.models.pooling import read_pooling_config
    from mlx_vlm.server.embeddings import _embed
    from mlx_vlm.utils import load_processor

    model = load_embedding_model(folder)
    model.pooling_config = read_pooling_config(folder)
    processor = load_processor(folder, add_detokenizer=False)
    return [np.array(_embed(model, processor, [t])[0][0]) for t in texts]


def close(got: list[float] | np.ndarray, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.9999
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_models_lists_each_kind(server: ServerProcess):
    cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    kinds = {Path(name).name: card["kind"] for name, card in cards.items()}
    assert kinds == {EMBEDDER: "embed", VL_EMBEDDER: "embed", RERANKER: "score", CROSS_ENCODER: "score"}


@pytest.mark.parametrize("name", [EMBEDDER, VL_EMBEDDER])
def test_the_openai_sdk_gets_mlx_vlms_embeddings(client: OpenAI, folders: dict[str, Path], name: str):
    """The SDK asks for base64 unless told (and decodes it); base64 asked for by hand is little-endian float32;
    every way gives mlx-vlm's vectors, in order, with usage."""
    want = reference(folders[name], TEXTS)
    for fmt in (NOT_GIVEN, "float", "base64"):
        out = client.embeddings.create(model=name, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in out.data] == list(range(len(TEXTS)))
        for got, expected in zip(out.data, want, strict=True):
            vector = np.frombuffer(base64.b64decode(got.embedding), "<f4") if fmt == "base64" else got.embedding
            close(vector, expected)
        assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS)


def test_requests_together_equal_each_alone(client: OpenAI):
    texts = [f"request {i}: " + "word " * (i * 7) for i in range(12)]
    alone = [client.embeddings.create(model=EMBEDDER, input=t).data[0].embedding for t in texts]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda t: client.embeddings.create(model=EMBEDDER, input=[t, "x"]), texts))
    for got, want in zip(together, alone, strict=True):
        close(got.data[0].embedding, np.array(want))


def test_token_ids_embed_as_their_text(client: OpenAI, folders: dict[str, Path]):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folders[EMBEDDER])(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=EMBEDDER, input=[ids, ids]).data
    by_text = client.embeddings.create(model=EMBEDDER, input=TEXTS[0]).data[0].embedding
    close(by_ids[1].embedding, np.array(by_text))
    single = client.embeddings.create(model=EMBEDDER, input=ids).data  # one list of ints: one input
    assert len(single) == 1


def test_dimensions_truncate_and_renormalize(client: OpenAI):
    full = np.array(client.embeddings.create(model=EMBEDDER, input=TEXTS[1]).data[0].embedding)
    short = np.array(client.embeddings.create(model=EMBEDDER, input=TEXTS[1], dimensions=16).data[0].embedding)
    assert short.shape == (16,) and abs(np.linalg.norm(short) - 1) < 1e-5
    close(short, full[:16] / np.linalg.norm(full[:16]))
    with pytest.raises(BadRequestError, match="dimensions 65 is over the model's 64"):
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=65)


def test_an_image_embeds_as_mlx_vlm_embeds_it(client: OpenAI, folders: dict[str, Path]):
    from mlx_vlm.embedding_loader import load_embedding_model
    from mlx_vlm.server.embeddings import _embed_image
    from mlx_vlm.utils import load_processor

    url = image_data_url(Image.new("RGB", (64, 64), (200, 30, 10)))
    model = load_embedding_model(folders[VL_EMBEDDER])
    want = np.array(_embed_image(model, load_processor(folders[VL_EMBEDDER], add_detokenizer=False), url)[0])
    items = [{"type": "image_url", "image_url": {"url": url}}, "a red square", {"type": "input_image", "image_url": url}]
    out = client.embeddings.create(model=VL_EMBEDDER, input=items, encoding_format="float").data
    close(out[0].embedding, want)
    close(out[2].embedding, want)
    with pytest.raises(BadRequestError, match="input has 9 images; at most 8 per request"):
        client.embeddings.create(model=VL_EMBEDDER, input=[items[0]] * 9)
    with pytest.raises(BadRequestError, match="embeds text only"):
        client.embeddings.create(model=EMBEDDER, input=[{"type": "image_url", "image_url": {"url": url}}])


def test_langchains_openai_embeddings(server: ServerProcess, folders: dict[str, Path]):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length off: it would tokenize with tiktoken (a download) and send token ids
    lc = OpenAIEmbeddings(model=EMBEDDER, base_url=f"{server.url}/v1", api_key="none", check_embedding_ctx_length=False)
    want = reference(folders[EMBEDDER], TEXTS[:2])
    for got, expected in zip(lc.embed_documents(TEXTS[:2]), want, strict=True):
        close(got, expected)
    close(lc.embed_query(TEXTS[0]), want[0])


@pytest.mark.parametrize("body, says", [
    ({"input": []}, "input must not be empty"),
    ({"input": ""}, r"input\[0\] must not be an empty string"),
    ({"input": ["ok"] * 2049}, "input has 2049 items; at most 2048"),
    ({"input": ["ok", "word " * (MAX_LEN + 5)]}, r"input\[1\] has \d+ tokens; model '.*' takes at most 400"),
    ({"input": [[1, 2, 10**9]]}, "outside the model's vocabulary"),
    ({"input": [{"type": "text"}]}, "an item is text, token ids, or an image"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])  # fmt: skip
def test_bad_embedding_requests_are_openai_shaped_400s(server: ServerProcess, body: dict, says: str):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBEDDER, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert re.search(says, json.dumps(r.json()["error"])), r.text
    assert httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBEDDER, "input": "still serving"}).status_code == 200


def test_a_request_to_a_model_of_another_kind_names_its_kind(server: ServerProcess, client: OpenAI):
    with pytest.raises(BadRequestError, match="is an embedding model: it serves /v1/embeddings, not chat"):
        client.chat.completions.create(model=EMBEDDER, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="is a reranker \\(score\\) model: it serves /v1/rerank"):
        client.embeddings.create(model=RERANKER, input="hi")
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": EMBEDDER, "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"


QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity pulls objects toward each other.", "import os", "Beijing"]


def rerank_reference(folder: Path, query: str, docs: list[str], instruction: str = DEFAULT_INSTRUCTION) -> list[float]:
    """mlx-vlm's Qwen3 model, each prompt alone through its full forward: sigmoid(logit_yes - logit_no) at the
    last token of the model card's prompt."""
    from mlx_vlm.utils import load

    model, processor = load(str(folder))
    tokenizer = getattr(processor, "tokenizer", processor)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for doc in docs:
        text = f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}{RERANK_SUFFIX}"
        logits = model(mx.array([tokenizer.encode(text, add_special_tokens=False)])).logits[0, -1]
        scores.append(float(mx.sigmoid(logits[yes] - logits[no])))
    return scores


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_gives_mlx_vlms_scores_in_order(server: ServerProcess, folders: dict[str, Path], path: str):
    """The shape Jina's and Cohere's clients (and LlamaIndex's JinaRerank) send: model, query, documents, top_n."""
    want = rerank_reference(folders[RERANKER], QUERY, DOCS)
    r = httpx.post(f"{server.url}{path}", json={"model": RERANKER, "query": QUERY, "documents": DOCS, "top_n": 3,
                                                "return_documents": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
        assert x["document"] == DOCS[x["index"]]
    assert body["usage"]["prompt_tokens"] > 0 and body["model"] == RERANKER


def test_rerank_takes_cohere_documents_and_an_instruction(server: ServerProcess, folders: dict[str, Path]):
    told = "Judge code relevance."
    want = rerank_reference(folders[RERANKER], QUERY, DOCS[:2], told)
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": RERANKER, "query": QUERY, "instruction": told,
                                                    "documents": [{"text": d} for d in DOCS[:2]]}, timeout=60)
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert all(abs(got[i] - want[i]) < 1e-4 for i in range(2)) and "document" not in r.json()["results"][0]
    bad = httpx.post(f"{server.url}/v1/rerank", json={"model": RERANKER, "query": QUERY, "documents": []})
    assert bad.status_code in (400, 422)


def test_a_sequence_classifier_reranks_as_mlx_vlm_scores_it(server: ServerProcess, folders: dict[str, Path]):
    """A BERT cross-encoder: sigmoid(logit) of each (query, document) pair, equal to mlx-vlm's score_documents."""
    import json as json_

    from mlx_vlm.reranker_loader import load_reranker
    from mlx_vlm.server.reranking import normalize_item, score_documents

    model, processor = load_reranker(folders[CROSS_ENCODER])
    config = json_.loads((folders[CROSS_ENCODER] / "config.json").read_text())
    want, _ = score_documents(model, processor, config, normalize_item(QUERY, "query"),
                              [normalize_item(d, "d") for d in DOCS], None)
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": CROSS_ENCODER, "query": QUERY, "documents": DOCS})
    got = r.json()["results"]
    assert [x["index"] for x in got] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-4 for x in got)
    told = httpx.post(f"{server.url}/v1/rerank", json={"model": CROSS_ENCODER, "query": QUERY, "documents": DOCS,
                                                       "instruction": "Judge."})
    assert told.status_code == 400 and "takes no instruction" in told.json()["error"]["message"]


def test_the_readme_example_prints_what_it_says(server: ServerProcess):
    """docs/embeddings-rerank-audio.md's "Embeddings and rerank" examples, against this server (port 8001 there)."""
    import subprocess
    import sys

    section = PAGE.read_text().split("## Embeddings and rerank", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.finditer(r"^```(python|bash)\n(.*?)^```\n", section, re.S | re.M):
        says = re.compile(r"\n*prints `([^`]+)`").match(section, block.end())
        if says and "127.0.0.1:8001" in block[2]:
            blocks.append((block[1], block[2], says[1]))
    assert len(blocks) == 2
    for lang, code, said in blocks:
        code = code.replace("http://127.0.0.1:8001", server.url)
        argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-c", f"set -euo pipefail\n{code}"]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == said


def test_a_model_dir_serves_chat_embeddings_and_rerank_one_loaded_at_a_time(tmp_path: Path):
    """--model-dir with a chat model, an embedding model and a reranker, --max-loaded-models 1: each kind is
    listed before it loads, and each request swaps its model in."""
    from vlmserve.testing.build import build_model

    root = tmp_path / "models"
    model_folders(root)
    shutil.copytree(build_model("qwen3_vl", "micro"), root / "chat")
    srv = start_server(["--model-dir", str(root), "--max-loaded-models", "1"], tmp_path / "server.log")
    try:
        def cards() -> dict[str, dict]:
            return {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models").json()["data"]}

        assert {k: c["kind"] for k, c in cards().items()} == {
            EMBEDDER: "embed", VL_EMBEDDER: "embed", RERANKER: "score", CROSS_ENCODER: "score", "chat": "generate"}
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        for _ in range(2):
            assert len(client.embeddings.create(model=EMBEDDER, input=["a", "b"]).data) == 2
            assert [k for k, c in cards().items() if c["status"] == "loaded"] == [EMBEDDER]
            chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
            assert chat.choices[0].message.content is not None
            assert [k for k, c in cards().items() if c["status"] == "loaded"] == ["chat"]
            r = httpx.post(f"{srv.url}/v1/rerank", json={"model": RERANKER, "query": "q", "documents": ["a", "b"]},
                           timeout=60)
            assert r.status_code == 200 and len(r.json()["results"]) == 2
            assert [k for k, c in cards().items() if c["status"] == "loaded"] == [RERANKER]
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, kind", [(["--task", "score"], "score"), (["--runner", "pooling"], "embed")])
def test_task_and_runner_say_the_kind_of_a_checkpoint_its_files_do_not(tmp_path: Path, flags: list[str], kind: str):
    """A Qwen3 reranker copied under a plain name reads as a chat model; vLLM's flags say what it serves."""
    plain = tmp_path / "qwen3-plain"
    shutil.copytree(build_pooling_model("reranker"), plain)
    srv = start_server(["--model", str(plain), *flags], tmp_path / "server.log")
    try:
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["kind"] == kind
        path, body = ("/v1/rerank", {"query": "q", "documents": ["a"]}) if kind == "score" else \
            ("/v1/embeddings", {"input": "a"})
        assert httpx.post(f"{srv.url}{path}", json={"model": "qwen3-plain", **body}, timeout=60).status_code == 200
    finally:
        srv.stop()
