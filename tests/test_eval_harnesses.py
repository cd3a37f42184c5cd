"""lm-evaluation-harness against a real server on the demo model, run as its users run it (``lm-eval run``,
a subprocess), on local tasks; every log-likelihood it records equals mlx-vlm's own float32 forward over
the same token ids, within 1e-4.

- ``local-completions`` with ``tokenizer_backend=huggingface`` (the model directory's tokenizer) and
  with ``tokenizer_backend=remote`` (the server's ``/tokenizer_info``, ``/tokenize``, ``/detokenize``):
  a multiple-choice task whose contexts are chat prompts and whose choices end in "." (the demo's
  greeting, after which it would stop at once: the answer that used to score as certain),
  ``loglikelihood_rolling`` and ``generate_until``;
- ``local-chat-completions`` on ``generate_until``: the server's own greedy answers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from vlmserve.config import DEMO_MODEL_DIR

_BESIDE = Path(sys.executable).parent / "lm-eval"  # the venv's, where its bin is not on PATH
LM_EVAL = str(_BESIDE) if _BESIDE.exists() else shutil.which("lm-eval")
pytestmark = pytest.mark.skipif(LM_EVAL is None, reason="needs lm-eval (pip install -e '.[eval]')")
GREETING = "Hello! Show me a picture and I will describe it."
DOCS = [
    {"question": "hi", "choices": [GREETING, "A red circle.", "Hello."], "answer": 0,
     "text": "A red circle, a blue triangle and a yellow star."},
    {"question": "Say hello.", "choices": ["A green star.", GREETING, "Yes."], "answer": 1,
     "text": "The star is green. The circle is not there."},
    {"question": "What can you do?", "choices": ["No.", "The square is blue.", GREETING], "answer": 2,
     "text": GREETING},
]
TASKS = {
    "shapes_mc": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                  "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]},
    "shapes_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                       "metric_list": [{"metric": "word_perplexity"}]},
    "shapes_gen": {"output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{choices[answer]}}",
                   "generation_kwargs": {"until": ["."], "max_gen_toks": 24, "do_sample": False},
                   "metric_list": [{"metric": "exact_match"}]},
    "shapes_chat": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{choices[answer]}}",
                    "generation_kwargs": {"until": ["<turn|>"], "max_gen_toks": 24, "do_sample": False},
                    "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, tokenizer) -> Path:
    """The local tasks, their documents' contexts rendered with the demo's chat template."""
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "shapes.jsonl"
    docs = [{**d, "context": _chat(tokenizer, d["question"])} for d in DOCS]
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, spec in TASKS.items():
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **spec}
        (folder / f"{name}.yaml").write_text(json.dumps(task))  # YAML reads JSON
    return folder


def _chat(tokenizer: Any, question: str) -> str:
    text: str = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                              add_generation_prompt=True)
    return text


def _lm_eval(tasks: Path, out: Path, model: str, tasks_run: str, **model_args: str) -> dict[str, list[Any]]:
    """``lm-eval run`` as a user runs it; each task's logged samples."""
    args = ",".join(f"{k}={v}" for k, v in {"model": "demo-gemma4", "num_concurrent": "1", "max_retries": "1",
                                             **model_args}.items())
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [LM_EVAL, "run", "--model", model, "--model_args", args, "--tasks", tasks_run,
               "--include_path", str(tasks), "--log_samples", "--output_path", str(out)]
    if model == "local-chat-completions":
        command.append("--apply_chat_template")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    samples: dict[str, list[Any]] = {}
    for path in out.rglob("samples_*.jsonl"):
        name = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def _encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """As lm-eval encodes a (context, continuation) pair for a causal model (no special tokens added)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def _check(samples: dict[str, list[Any]], tokenizer: Any, reference: Any) -> None:
    for sample in samples["shapes_mc"]:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        for i, resp in enumerate(sample["resps"]):
            continuation = sample["arguments"][f"gen_args_{i}"]["arg_1"]
            ctx, cont = _encode_pair(tokenizer, context, continuation)
            want = sum(reference(ctx + cont)[len(ctx):])
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4), (sample["doc_id"], continuation)
    for sample in samples["shapes_rolling"]:
        ids = tokenizer(sample["doc"]["text"], add_special_tokens=False).input_ids
        want = sum(reference([tokenizer.bos_token_id, *ids])[1:])  # one window, after lm-eval's prefix token (BOS)
        assert float(sample["resps"][0][0]) == pytest.approx(want, abs=1e-4), sample["doc_id"]
    greeted = [s for s in samples["shapes_mc"] if s["doc"]["question"] in ("hi", "Say hello.")]
    assert all(s["acc"] == 1.0 for s in greeted)  # its own greeting is the likeliest, and not "certain"
    assert all(float(r[0][0]) < 0 for s in samples["shapes_mc"] for r in s["resps"])
    for sample in samples["shapes_gen"]:
        assert sample["resps"][0][0].strip(), sample  # an answer, cut at the first "."


def test_local_completions_with_the_models_tokenizer(demo_f32_server, tasks, tokenizer, demo_reference, tmp_path):
    samples = _lm_eval(tasks, tmp_path / "out", "local-completions", "shapes_mc,shapes_rolling,shapes_gen",
                       base_url=f"{demo_f32_server.url}/v1/completions", tokenizer_backend="huggingface",
                       tokenizer=str(DEMO_MODEL_DIR))
    _check(samples, tokenizer, demo_reference)


def test_local_completions_with_the_servers_tokenizer(demo_f32_server, tasks, tokenizer, demo_reference, tmp_path):
    samples = _lm_eval(tasks, tmp_path / "out", "local-completions", "shapes_mc,shapes_rolling,shapes_gen",
                       base_url=f"{demo_f32_server.url}/v1/completions", tokenizer_backend="remote")
    _check(samples, tokenizer, demo_reference)


def test_local_chat_completions_generates_the_servers_own_answers(demo_f32_server, tasks, tmp_path):
    samples = _lm_eval(tasks, tmp_path / "out", "local-chat-completions", "shapes_chat",
                       base_url=f"{demo_f32_server.url}/v1/chat/completions", tokenizer_backend="none")
    for sample in samples["shapes_chat"]:
        body = {"model": "demo-gemma4", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "user", "content": sample["doc"]["question"]}]}
        own = httpx.post(f"{demo_f32_server.url}/v1/chat/completions", json=body, timeout=60).json()
        assert sample["resps"][0][0] == own["choices"][0]["message"]["content"], sample["doc_id"]
    greeted = [s["exact_match"] for s in samples["shapes_chat"] if s["doc"]["question"] in ("hi", "Say hello.")]
    assert greeted == [1.0, 1.0]  # scored as lm-eval scores: its greeting, exactly


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
