"""[main] Two outside clients against vlmserve over HTTP: lmms-eval's OpenAI-compatible chat model on
a local image task, and guidellm's benchmark with images, synchronous and then concurrent.

    python benchmarks/harnesses.py [--url http://127.0.0.1:8000] [--only lmms-eval,guidellm]
        [--scenes 12] [--requests 16] [--concurrency 4] [--processor DIR] [--out DIR]

Each client gets its own venv under ~/.cache/vlmserve/venvs/ (made on first use: torch from the
wheel on disk first, then the client, pinned), so its pins never touch vlmserve's. Nothing comes
from the Hub: the task ``demo_shapes`` is a local YAML and JSONL of held-out demo scenes
(``vlmserve.testing.demo``), each asked for a caption and one question, scored by exact match with
the answer the demo model was taught; guidellm reads the same pictures from a local JSONL file
(prompt, image path, 32 output tokens) and the model directory as its tokenizer. Without ``--url``
the demo model is served here on a free port. A run passes when every client exits 0 with 0
errored requests and the server (when started here) rejected none. Results go to
``OUT/harnesses.json`` (and each client's own files to ``OUT/harnesses/``) and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from compare import ServerSpec, free_port, serving

from vlmserve.config import DEMO_MODEL_DIR
from vlmserve.testing.demo.dialogues import CAPTION_PROMPTS, question_text
from vlmserve.testing.demo.evaluate import held_out_scenes
from vlmserve.testing.demo.scenes import sample_question

ROOT = Path(__file__).resolve().parent.parent
VENVS = Path.home() / ".cache" / "vlmserve" / "venvs"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CLIENT_TIMEOUT_S = 900
FAILED_MARK = "[LMMS_EVAL_REQUEST_FAILED"  # what lmms-eval's openai model answers for a request that failed
OUTPUT_TOKENS = 32  # per guidellm request (guidellm sends ignore_eos, so each runs to it)


@dataclass(slots=True, frozen=True)
class Client:
    """One harness: its venv, the pip installs that make it (in order), its command and package."""

    name: str
    installs: tuple[tuple[str, ...], ...]
    command: str

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    @property
    def exe(self) -> Path:
        return self.venv / "bin" / self.command


# torch first, pinned to a release whose wheel is on this machine's disk (2.13.0: the CPU build); left to the
# client's own requirement, pip would download the newest CUDA build. lmms-eval needs torchvision, and
# torchvision 0.29.1 wants torch 2.14.1 (on disk, CUDA); its evaluator imports filelock._api, gone in filelock 4.
LMMS_EVAL = Client("lmms-eval", (("torch==2.14.1", "torchvision==0.29.1"), ("lmms-eval==0.7.3", "filelock<4")),
                   "lmms-eval")
GUIDELLM = Client("guidellm", (("torch==2.13.0",), ("guidellm[vision]==0.8.1",)), "guidellm")
CLIENTS = {c.name: c for c in (LMMS_EVAL, GUIDELLM)}

TASK_YAML = """\
task: demo_shapes
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 48
  temperature: 0
  do_sample: false
process_results: !function utils.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.1
"""

TASK_UTILS = '''\
"""demo_shapes: held-out demo scenes, a caption and one question each, exact match."""
from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    return {"exact_match": float(results[0].strip() == doc["answer"])}
'''


def say(message: str) -> None:
    print(f"[harnesses {time.strftime('%H:%M:%S')}] {message}", flush=True)


def ensure_venv(client: Client, log: Path) -> str:
    """Make ``client``'s venv if it is missing; returns the client's installed version."""
    if not client.exe.exists():
        say(f"creating {client.venv} (a few minutes; pip output in {log})")
        with open(log, "w") as out:
            subprocess.run([sys.executable, "-m", "venv", str(client.venv)], check=True, stdout=out, stderr=out)
            for packages in client.installs:
                say(f"  pip install {' '.join(packages)}")
                pip = [str(client.venv / "bin" / "pip"), "install", *packages]
                if subprocess.run(pip, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                    raise SystemExit(f"{' '.join(pip)} failed; see {log}")
    probe = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    package = client.installs[-1][0].split("[")[0].split("=")[0]
    return subprocess.run([str(client.venv / "bin" / "python"), "-c", probe, package], check=True, text=True,
                          capture_output=True).stdout.strip()


def build_data(out: Path, scenes: int, requests: int) -> tuple[Path, Path]:
    """Writes the pictures, the lmms-eval task (YAML, utils.py, JSONL) and guidellm's JSONL; returns
    the task folder and guidellm's file."""
    task, pictures = out / "task", out / "pictures"
    task.mkdir(parents=True, exist_ok=True)
    pictures.mkdir(exist_ok=True)
    rng = np.random.default_rng([0, 44])
    docs, paths = [], []
    for i, (scene, image) in enumerate(held_out_scenes(scenes, seed=44)):
        path = pictures / f"scene{i:02d}.png"
        image.save(path)
        paths.append(path)
        question = sample_question(rng, scene)
        docs.append({"id": f"{i}-caption", "kind": "caption", "image": str(path), "question": CAPTION_PROMPTS[0],
                     "answer": scene.caption})
        docs.append({"id": f"{i}-{question.kind}", "kind": question.kind, "image": str(path),
                     "question": question_text(question), "answer": question.answer})
    data = task / "demo_shapes.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (task / "demo_shapes.yaml").write_text(TASK_YAML.format(data=data))
    (task / "utils.py").write_text(TASK_UTILS)
    rows = itertools.islice(itertools.cycle(docs), max(requests, len(docs)))
    local = out / "guidellm_images.jsonl"
    local.write_text("".join(json.dumps({"prompt": d["question"], "image": d["image"],
                                         "output_tokens_count": OUTPUT_TOKENS}) + "\n" for d in rows))
    return task, local


def run_client(argv: list[str], log: Path, cwd: Path) -> tuple[int, float]:
    """Runs one client to ``log`` (its exit status and seconds); the tail of the log when it fails."""
    say(f"running {Path(argv[0]).name} (log: {log})")
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, timeout=CLIENT_TIMEOUT_S,
                                  env={**os.environ, **OFFLINE, "OPENAI_API_KEY": "unused"}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    seconds = time.perf_counter() - started
    if code != 0:
        say(f"exit {code}; last lines:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return code, seconds


def run_lmms_eval(url: str, model: str, task: Path, out: Path, concurrency: int) -> dict[str, Any]:
    folder = out / "lmms-eval"
    argv = [str(LMMS_EVAL.exe), "--model", "openai", "--model_args",
            f"model={model},base_url={url}/v1,num_concurrent={concurrency},max_retries=1,timeout=300",
            "--tasks", "demo_shapes", "--include_path", str(task), "--batch_size", "1",
            "--output_path", str(folder), "--log_samples"]
    code, seconds = run_client(argv, out / "lmms-eval.log", out)
    result: dict[str, Any] = {"command": argv, "exit": code, "wall_s": round(seconds, 1)}
    runs = sorted(folder.glob("**/*_results.json"), key=lambda p: p.stat().st_mtime)
    if code != 0 or not runs:
        return result | {"errors": None}
    summary = json.loads(runs[-1].read_text())
    samples_file = runs[-1].with_name(runs[-1].name.replace("_results.json", "_samples_demo_shapes.jsonl"))
    samples = [json.loads(line) for line in samples_file.open()]
    docs = [json.loads(line) for line in (task / "demo_shapes.jsonl").open()]
    kinds: dict[str, list[float]] = {}
    for sample in samples:
        kinds.setdefault(docs[sample["doc_id"]]["kind"], []).append(sample["exact_match"])
    return result | {
        "samples": len(samples),
        "errors": sum(FAILED_MARK in str(s["filtered_resps"]) for s in samples),
        "exact_match": round(summary["results"]["demo_shapes"]["exact_match,none"], 3),
        "by_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(kinds.items())},
        "gen_tok_per_request_s": round(summary["throughput"]["avg_speed"], 1),
    }


def guidellm_data(local: Path) -> dict[str, list[str]]:
    """Each dataset's ``--data`` arguments: the local JSONL, and guidellm's own synthetic text and
    image (the synthetic prompts are counted out in the processor's tokens: it needs ``--tokenizer``)."""
    return {"local": ["--data", f"kind=json_file,path={local}"],
            "synthetic": ["--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
                          "--data", "kind=synthetic_image,width=224,height=224"]}


def run_guidellm(url: str, model: str, data: list[str], processor: Path, out: Path, label: str, profile: str,
                 requests: int) -> dict[str, Any]:
    report = out / f"guidellm-{label}.json"
    argv = [str(GUIDELLM.exe), "run", "--backend", f"kind=openai_http,target={url},model={model}",
            "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
            "--constraint", "kind=max_duration,seconds=180",
            "--tokenizer", f"kind=huggingface_auto,model={processor}", *data,
            "--output", f"kind=json,path={report}", "--output", "kind=console", "--disable-progress"]
    code, seconds = run_client(argv, out / f"guidellm-{label}.log", out)
    result: dict[str, Any] = {"command": argv, "exit": code, "wall_s": round(seconds, 1)}
    if code != 0 or not report.exists():
        return result | {"errors": None}
    bench = json.loads(report.read_text())["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, key: str) -> float:
        value = m[name]["successful"]
        return round(float(value["percentiles"][key] if key.startswith("p") else value[key]), 2)

    totals = m["request_totals"]
    return result | {
        "successful": totals["successful"], "errors": totals["errored"], "incomplete": totals["incomplete"],
        "duration_s": round(bench["duration"], 2), "requests_per_s": stat("requests_per_second", "mean"),
        "output_tok_s": stat("output_tokens_per_second", "mean"), "ttft_ms_p50": stat("time_to_first_token_ms", "p50"),
        "ttft_ms_p95": stat("time_to_first_token_ms", "p95"), "itl_ms_p50": stat("inter_token_latency_ms", "p50"),
        "latency_s_p50": stat("request_latency", "p50"), "concurrency_p50": stat("request_concurrency", "p50"),
        "prompt_tokens_mean": stat("prompt_token_count", "mean"),
        "output_tokens_mean": stat("output_token_count", "mean"),
        "image_pixels_mean": round(m["image"]["pixels"]["input"]["successful"]["mean"]),
        "warnings": [w["message"] for w in bench["warnings"]],  # guidellm's own, about the client side
    }


@contextlib.contextmanager
def server(url: str | None, out: Path) -> Iterator[tuple[str, Path | None]]:
    """``url`` as it is, or the demo model served here for the block (its log path with it)."""
    if url is not None:
        yield url.rstrip("/"), None
        return
    port, log = free_port(), out / "vlmserve.log"
    argv = [sys.executable, "-m", "vlmserve.cli", "--log-level", "info", "serve", "--port", str(port)]
    say(f"starting vlmserve on port {port} (log: {log})")
    with serving(ServerSpec("vlmserve", argv, "/ready", {}), port, dict(os.environ), log) as (problem, _):
        if problem is not None:
            raise SystemExit(f"vlmserve {problem}; see {log}")
        yield f"http://127.0.0.1:{port}", log


def rejected(log: Path | None) -> list[str] | None:
    """The server's own record of the requests it turned away (4xx/5xx), when it ran here."""
    if log is None:
        return None
    return [line for line in log.read_text(errors="replace").splitlines() if "vlmserve.requests: rejected" in line]


def table(results: dict[str, Any]) -> str:
    """The results as markdown: one table per harness."""
    lines = []
    lm = results.get("lmms-eval")
    if lm is not None:
        lines += [f"lmms-eval {lm['version']}, model openai (chat), task demo_shapes:", "",
                  "| exit | samples | errors | exact_match | by kind | wall s |", "|---|---|---|---|---|---|",
                  f"| {lm['exit']} | {lm.get('samples', '-')} | {lm['errors']} | {lm.get('exact_match', '-')} | "
                  + ", ".join(f"{k} {v}" for k, v in lm.get("by_kind", {}).items()) + f" | {lm['wall_s']} |", ""]
    guidellm = results.get("guidellm")
    if guidellm is not None:
        lines += [f"guidellm {guidellm['version']}, /v1/chat/completions, streaming:", "",
                  "| data, profile | exit | ok | errors | req/s | output tok/s | TTFT p50 / p95 ms | ITL p50 ms "
                  "| latency p50 s | px per image |", "|---|---|---|---|---|---|---|---|---|---|"]
        for label, run in guidellm["runs"].items():
            cells = [run.get(k, "-") for k in ("successful", "errors", "requests_per_s", "output_tok_s")]
            ttft = f"{run.get('ttft_ms_p50', '-')} / {run.get('ttft_ms_p95', '-')}"
            cells += [ttft, *(run.get(k, "-") for k in ("itl_ms_p50", "latency_s_p50", "image_pixels_mean"))]
            lines.append(f"| {label} | {run['exit']} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: serve the demo model here)")
    parser.add_argument("--model", help="the model name to ask for (default: the server's first in /v1/models)")
    parser.add_argument("--processor", type=Path, default=DEMO_MODEL_DIR, help="guidellm's tokenizer directory")
    parser.add_argument("--only", default="lmms-eval,guidellm")
    parser.add_argument("--scenes", type=int, default=12, help="demo scenes in the task (2 questions each)")
    parser.add_argument("--requests", type=int, default=16, help="requests per guidellm run")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    work = (args.out / "harnesses").resolve()
    work.mkdir(parents=True, exist_ok=True)
    chosen = [CLIENTS[name] for name in args.only.split(",")]
    versions = {c.name: ensure_venv(c, work / f"venv-{c.name}.log") for c in chosen}
    say(f"versions: {versions}")
    task, local_data = build_data(work, args.scenes, args.requests)
    results: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "cpus": os.cpu_count(), "load_1min_at_start": os.getloadavg()[0]}
    with server(args.url, work) as (url, log):
        model = args.model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        results["server"] = {"url": url, "model": model, "started_here": log is not None}
        if LMMS_EVAL in chosen:
            results["lmms-eval"] = {"version": versions["lmms-eval"]} | run_lmms_eval(url, model, task, work,
                                                                                      args.concurrency)
        if GUIDELLM in chosen:
            profiles = {"synchronous": "kind=synchronous",
                        f"concurrent@{args.concurrency}": f"kind=concurrent,streams={args.concurrency}"}
            runs = {f"{name} {label}": run_guidellm(url, model, data, args.processor, work,
                                                    f"{name}-{label.split('@')[0]}", profile, args.requests)
                    for name, data in guidellm_data(local_data).items() for label, profile in profiles.items()}
            results["guidellm"] = {"version": versions["guidellm"], "processor": str(args.processor), "runs": runs}
        results["server"]["rejected"] = rejected(log)
    outcomes = [results["lmms-eval"]] if "lmms-eval" in results else []
    outcomes += list(results.get("guidellm", {}).get("runs", {}).values())
    results["passed"] = all(o["exit"] == 0 and o["errors"] == 0 for o in outcomes) and not results["server"]["rejected"]
    (args.out / "harnesses.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"server rejections: {results['server']['rejected']}; 1-min load average at start "
          f"{results['load_1min_at_start']:.2f}; passed: {results['passed']}; "
          f"written: {args.out / 'harnesses.json'}")
    sys.exit(0 if results["passed"] else 1)


if __name__ == "__main__":
    main()
