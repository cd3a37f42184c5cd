"""engine/pooling.py: which checkpoints are pooling models, and the runner: sequences that arrive together run in
one padded forward, each equal to mlx-vlm's own forward alone."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from vlmserve.engine.pooling import (
    MAX_ROWS,
    PoolingRunner,
    PoolJob,
    _forget_positions,
    kind_of,
    load_pooling,
    tokenizer_of,
)
from vlmserve.testing.pooling_models import build_pooling_model

TEXTS = ["hello", "def f(x):\n    return x * 2", "import os", "a longer sentence about the sea and the sky, " * 3,
         "x", "class A:\n    pass", "for i in range(10): print(i)", "yes", "no", "while True: break"]


def _jobs(loaded, texts, results):
    tokenizer = tokenizer_of(loaded.processor)
    return [PoolJob(tuple(tokenizer(t)["input_ids"]), finish=lambda r, i=i: results.__setitem__(i, r))
            for i, t in enumerate(texts)]


def _drain(runner):
    while runner.has_work():
        runner.step()


@pytest.mark.parametrize("kind", ["text_embedder", "vl_embedder"])
def test_sequences_that_arrive_together_run_in_one_forward_each_as_mlx_vlm_alone(kind):
    folder = build_pooling_model(kind)
    loaded = load_pooling(str(folder), "embed", None)
    runner = PoolingRunner(loaded)
    results: dict[int, list[float]] = {}
    runner.add(_jobs(loaded, TEXTS, results))
    _drain(runner)
    assert runner.batches == 1 and runner.rows == len(TEXTS)
    tokenizer = tokenizer_of(loaded.processor)
    for i, text in enumerate(TEXTS):  # mlx-vlm's forward, one sequence, no padding
        ids = tokenizer(text)["input_ids"]
        _forget_positions(loaded.model)  # else mlx-vlm's Qwen3-VL embedder reuses the batch's positions and fails
        alone = np.array(loaded.model(mx.array([ids]), attention_mask=mx.ones((1, len(ids)))).text_embeds[0])
        got = np.array(results[i])
        assert float(got @ alone / np.linalg.norm(got) / np.linalg.norm(alone)) >= 0.9999
        np.testing.assert_allclose(got, alone, atol=1e-4)


def test_a_step_takes_at_most_max_rows_and_the_rest_wait_for_the_next():
    loaded = load_pooling(str(build_pooling_model("text_embedder")), "embed", None)
    runner = PoolingRunner(loaded)
    results: dict[int, object] = {}
    runner.add(_jobs(loaded, ["a"] * (MAX_ROWS + 3), results))
    runner.step()
    assert runner.rows == MAX_ROWS and len(results) == MAX_ROWS and len(runner.waiting) == 3
    runner.fail_all("stopping")
    assert all(isinstance(results[i], RuntimeError) for i in range(MAX_ROWS, MAX_ROWS + 3))


def test_the_kind_is_read_from_the_files_or_said(tmp_path):
    assert kind_of(build_pooling_model("text_embedder")) == "embed"  # sentence-transformers' modules.json
    assert kind_of(build_pooling_model("vl_embedder")) == "embed"  # model_type qwen3_vl_embedding
    assert kind_of(build_pooling_model("reranker")) == "score"  # a causal LM named as a reranker
    plain = tmp_path / "Qwen3-0.6B"
    shutil.copytree(build_pooling_model("reranker"), plain)
    assert kind_of(plain) == "generate"
    assert kind_of(plain, "score") == "score" and kind_of(plain, "pooling") == "embed"
    assert kind_of(build_pooling_model("reranker"), "pooling") == "score"
    classifier = tmp_path / "bge"
    classifier.mkdir()
    (classifier / "config.json").write_text(json.dumps({"model_type": "xlm-roberta",
                                                        "architectures": ["XLMRobertaForSequenceClassification"]}))
    assert kind_of(classifier) == "score"
    assert kind_of(tmp_path / "missing") == "generate"
