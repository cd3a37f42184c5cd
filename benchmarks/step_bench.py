"""[main + worker] The raw limit: the model's own batched decode step (and prefill), no server, no scheduler.

    python benchmarks/step_bench.py [--arch gemma4] [--size small] [--quick] [--json PATH]

On one MLXWorkerThread (as the engine runs it): build a batch of B requests with ModelRunner
(enter and embed, prefill the whole prompt into the batch), then time N of the model's own batched decode steps with
a greedy argmax, no engine around them, twice: synchronous (build, evaluate, read each step) and
pipelined as mlx-lm's generators run it (step n+1 dispatched with ``mx.async_eval`` before step
n is read). The pipelined step is the limit the engine is held to. The prompts are the load generator's: one image + 12 words.
The engine's efficiency is a server's tok/s at concurrency B divided by this tok/s at batch B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadgen import prompt_text, synthetic_pil_images

BATCHES = (1, 2, 4, 8, 16)


def _prompts(processor: Any, count: int, words: int, with_image: bool) -> tuple[list[Any], float]:
    """PromptInputs built like the server's phase 1; returns them and the mean seconds each took."""
    from vlmserve.preprocess.prompt import PromptBuilder

    images = synthetic_pil_images(count, seed=1)
    prompter = PromptBuilder.for_processor(processor)
    prompts, start = [], time.perf_counter()
    for i in range(count):
        content = [{"type": "text", "text": prompt_text(words, i)}]
        if with_image:
            content.insert(0, {"type": "image"})
        prompts.append(prompter.build([{"role": "user", "content": content}], [images[i]] if with_image else []))
    return prompts, (time.perf_counter() - start) / count


def _prefill(runner: Any, request_id: str, prompt: Any) -> float:
    """Embed and prefill one request alone, in one piece, into the batch (two plans through
    ``ModelRunner.execute``); returns the seconds it took."""
    from vlmserve.engine.params import SamplingParams
    from vlmserve.engine.plan import EncodeChunk, NewRequest, PrefillChunk, SchedulerOutput

    start = time.perf_counter()
    new = NewRequest(request_id, prompt, SamplingParams(max_tokens=1 << 20, ignore_eos=True))
    out = runner.execute(SchedulerOutput(new=[new], encode=[EncodeChunk(request_id)]))
    out = runner.execute(SchedulerOutput(prefill=[PrefillChunk(request_id, 0, out.prompt_lengths[request_id])]))
    assert not out.errors, out.errors
    return time.perf_counter() - start


def _raw_steps(runner: Any, steps: int, pipelined: bool) -> list[float]:
    """Seconds per step of the model's batched decode + argmax on the runner's batch, nothing else."""
    import mlx.core as mx

    batch, adapter = runner.batch, runner.adapter

    def step(tokens: Any) -> Any:
        logits = adapter.decode(tokens[:, None], batch.cache, batch.row_state)
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    times, tokens = [], batch.tokens
    if pipelined:
        tokens = step(tokens)
        mx.async_eval(tokens)
    for _ in range(steps):
        start = time.perf_counter()
        following = step(tokens)
        if pipelined:
            mx.async_eval(following)
        tokens.tolist()  # pipelined: the previous step, computed while this one was being built
        tokens = following
        if not pipelined:
            tokens.tolist()
        times.append(time.perf_counter() - start)
    mx.eval(tokens)
    return times


def bench_batch(loaded: Any, prompts: list[Any], batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """On the worker: prefill ``batch`` requests one by one, then time ``steps`` batched decode steps."""
    from vlmserve.engine.runner import ModelRunner

    runner = ModelRunner(loaded)
    prefill_s = [_prefill(runner, f"r{i}", prompts[i % len(prompts)]) for i in range(batch)]
    _raw_steps(runner, warmup, pipelined=False)
    sync = _raw_steps(runner, steps, pipelined=False)
    piped = _raw_steps(runner, steps, pipelined=True)
    runner.remove(list(runner.batch.request_ids))
    ms, ms_sync = statistics.median(piped) * 1000, statistics.median(sync) * 1000
    return {"ms_per_step": round(ms, 2), "ms_mean": round(statistics.fmean(piped) * 1000, 2),
            "tok_s": round(batch * 1000 / ms, 1), "ms_per_step_sync": round(ms_sync, 2),
            "tok_s_sync": round(batch * 1000 / ms_sync, 1), "prefill_ms": [round(s * 1000, 1) for s in prefill_s]}


def workload_tok_s(prefill_ms: float, step_ms: float, batch: int, max_tokens: int) -> float:
    """The raw limit for serve_bench's workload: each request costs its prefill plus its share
    of ``max_tokens`` batched decode steps (every prefill runs alone, as the engine runs it)."""
    per_request_ms = prefill_ms + max_tokens * step_ms / batch
    return round(max_tokens * 1000 / per_request_ms, 1) if per_request_ms else 0.0


def run(arch: str, size: str, batches: tuple[int, ...], steps: int, warmup: int, max_tokens: int = 64,
        model: Path | None = None) -> dict[str, Any]:
    import mlx.core as mx

    from vlmserve.engine.loader import load_model
    from vlmserve.engine.worker import MLXWorkerThread
    from vlmserve.testing import build_model

    path = model or build_model(arch, size, ignore_eos=True)
    worker = MLXWorkerThread(name="mlx-step-bench")
    worker.start()
    try:
        loaded = worker.call(load_model, str(path))
        image_prompts, image_pre_s = _prompts(loaded.processor, max(batches), 12, True)
        long_prompts, _ = _prompts(loaded.processor, 1, 300, False)
        worker.call(bench_batch, loaded, image_prompts, 1, 4, 2)  # warm-up: first calls compile and allocate
        out: dict[str, Any] = {
            "arch": arch, "size": size, "model": str(path), "steps": steps, "mlx": mx.__version__,
            "cpus": os.cpu_count(), "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "image_prompt_tokens": len(image_prompts[0]), "long_text_prompt_tokens": len(long_prompts[0]),
            "preprocess_ms_image_prompt": round(image_pre_s * 1000, 1), "decode": {},
        }
        out["prefill_ms_long_text"] = worker.call(bench_batch, loaded, long_prompts, 1, 1, 0)["prefill_ms"][0]
        for batch in batches:
            out["decode"][str(batch)] = worker.call(bench_batch, loaded, image_prompts, batch, steps, warmup)
        prefills = [ms for row in out["decode"].values() for ms in row.pop("prefill_ms")]
        out["prefill_ms_image_prompt"] = round(statistics.median(prefills), 1)  # one per request prefilled
        out["workload_max_tokens"] = max_tokens
        for batch, row in out["decode"].items():
            row["workload_tok_s"] = workload_tok_s(out["prefill_ms_image_prompt"], row["ms_per_step"], int(batch), max_tokens)
        return out
    finally:
        worker.shutdown()


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Raw step, {Path(result['model']).name}, {result['steps']} decode steps per batch size "
             f"(prompt: {result['image_prompt_tokens']} tokens with one image)\n",
             f"| batch | ms/step synchronous | ms/step pipelined (median) | decode tok/s pipelined | "
             f"tok/s with prefill (estimate), {result['workload_max_tokens']}-token outputs |",
             "|---|---|---|---|---|"]
    for batch, row in result["decode"].items():
        lines.append(f"| {batch} | {row.get('ms_per_step_sync', '-')} | {row['ms_per_step']} | {row['tok_s']} | {row['workload_tok_s']} |")
    lines.append(f"\nPrefill alone: image prompt {result['prefill_ms_image_prompt']} ms (+ {result['preprocess_ms_image_prompt']} ms "
                 f"preprocessing), {result['long_text_prompt_tokens']}-token text prompt {result['prefill_ms_long_text']} ms.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gemma4")
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 steps per batch size")
    parser.add_argument("--max-tokens", type=int, default=64, help="output length of the workload limit")
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: build arch/size)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    steps = 16 if args.quick else args.steps
    result = run(args.arch, args.size, BATCHES, steps, warmup=4, max_tokens=args.max_tokens, model=args.model)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
