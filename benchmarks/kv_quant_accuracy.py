"""[main] How far quantized KV (``--kv-bits``, engine/kv_quant.py) moves a real model's logprobs (issue 45).

A fixed English passage, cut to ``--tokens`` tokens of SmolLM2-135M's (``benchmarks/real_weights.py``,
float32), is prefilled in chunks of ``--chunk``, and each position's logprob of the next passage token
is compared with full precision's (mean |delta| in nats over every predicted token), as are each
position's argmax and a ``--new``-token greedy continuation after the passage. Two sides:

- mlx-lm's own caches on mlx-vlm's language model: ``QuantizedKVCache`` from the first chunk (issue
  45's reference), and ``KVCache.to_quantized`` after the first chunk (what ``generate_step`` does
  with ``quantized_kv_start=0``; vlmserve packs there too, but attends to a later chunk's own
  positions exact and to the stored ones dequantized: engine/kv_quant.py);
- vlmserve's ``AsyncEngine`` with ``kv_bits`` against one without, the passage's logprobs read as
  ``prompt_logprobs`` (such a prompt is prefilled by tokens, ``prefill_chunk`` at a time).

    python benchmarks/kv_quant_accuracy.py [--tokens 600] [--chunk 64] [--new 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETTINGS = ((8, 64), (4, 64), (4, 32))  # (bits, group size)
PASSAGE = """\
The lighthouse at the end of the northern pier had not been lit for nearly thirty years when Margaret \
Hale bought it at auction. Everyone in the village told her it was a foolish purchase. The roof leaked, \
the iron stairs had rusted through in three places, and the keeper's cottage beside the tower smelled of \
damp wool and old tobacco. But Margaret had spent most of her life in cities, in small apartments above \
loud streets, and she wanted a place where the loudest thing was the sea.

She arrived in early March, when the wind still carried ice from the open water. For the first few weeks \
she did little more than sweep. She carried bucket after bucket of broken glass, dead leaves and the \
remains of birds' nests down the spiral stairs, and she burned what she could in the cottage stove. In \
the evenings she sat by the window with a cup of tea and a notebook, making lists of what needed to be \
done and what it might cost. The lists grew longer every night, and the numbers at the bottom of each \
page grew more alarming, but she found that she did not mind.

The village itself was small: a church, a post office that also sold bread and newspapers, a harbour \
with a dozen fishing boats, and a pub called the Anchor where the same six men seemed to sit at the same \
table every evening. At first they watched her with polite suspicion. Strangers who bought old buildings \
usually arrived with grand plans and left within a year, and nobody expected Margaret to be different. \
Then, one wet afternoon in April, the harbourmaster's son found her on the roof of the cottage, nailing \
down slates in the rain, and by the next morning the whole village knew about it.

After that, help began to appear without being asked for. A retired carpenter named Thomas came by with \
a box of tools and stayed for three days, rebuilding the rotten window frames. A woman from the farm \
above the cliffs brought eggs and advice about which chimney sweep could be trusted. The schoolteacher \
sent her older students to scrape and paint the railings as part of a project on local history, and \
they returned to class with stories about the keepers who had lived there before: a man who had rescued \
eleven sailors from a sinking schooner, a woman who had kept the lamp burning alone through a winter \
when her husband was lost at sea.

By the end of summer the tower was sound again. The stairs had been repaired, the glass of the lantern \
room replaced, and the great brass lens, which Margaret had found wrapped in canvas in the cellar, had \
been cleaned until it shone. The lighthouse would never again guide ships; modern beacons and satellite \
navigation had made it unnecessary long ago. Still, on the first evening of September, with half the \
village gathered on the pier below, Margaret climbed to the top and switched on a single electric bulb \
behind the old lens. The beam swept slowly across the dark water, and for a moment nobody spoke. Then \
someone at the back of the crowd began to clap, and the sound spread along the pier until it was louder \
than the waves. Margaret stood in the lantern room and watched the light turn, and she thought that she \
had never in her life been so tired, or so certain that she was exactly where she belonged.
"""


@dataclass(slots=True)
class Run:
    """One cache's reading of the passage: each next token's logprob, each position's argmax, and
    the greedy continuation after the passage."""

    logprobs: list[float]
    argmax: list[int]
    continuation: list[int]


def compare(run: Run, ref: Run) -> dict[str, float]:
    diff = np.abs(np.array(run.logprobs) - np.array(ref.logprobs))
    same = [a == b for a, b in zip(run.continuation, ref.continuation, strict=True)]
    return {"mean_abs_dlogprob": float(diff.mean()), "max_abs_dlogprob": float(diff.max()),
            "argmax_agreement": float(np.mean(np.array(run.argmax) == np.array(ref.argmax))),
            "continuation_agreement": float(np.mean(same)),
            "continuation_common_prefix": same.index(False) if False in same else len(same)}


def mlx_lm_run(lm: Any, ids: list[int], chunk: int, new: int, quant: tuple[int, int] | None, settle: bool) -> Run:
    """Prefill ``ids`` into mlx-lm's caches chunk by chunk, then decode ``new`` tokens greedily. ``quant``:
    quantized from the first chunk on, or (``settle``) converted once the first chunk is in."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    bits, group = quant or (0, 0)
    plain: Any = KVCache  # mlx-lm's constructor is untyped
    cache: list[Any] = [QuantizedKVCache(group_size=group, bits=bits) if quant and not settle else plain()
                        for _ in lm.layers]
    tokens = mx.array(ids, dtype=mx.int32)[None]
    logprobs: list[float] = []
    argmax: list[int] = []
    for start in range(0, len(ids), chunk):
        logits = lm(tokens[:, start:start + chunk], cache=cache).logits[0].astype(mx.float32)
        scored = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = tokens[0, start + 1:start + chunk + 1]
        chosen = mx.take_along_axis(scored[: targets.shape[0]], targets[:, None], axis=-1)[:, 0]
        logprobs += cast(list[float], chosen.tolist())
        argmax += cast(list[int], mx.argmax(scored[: targets.shape[0]], axis=-1).tolist())
        if quant and settle and start == 0:
            cache = [c.to_quantized(group_size=group, bits=bits) for c in cache]
    continuation: list[int] = []
    last = scored[-1]
    for _ in range(new):
        continuation.append(cast(int, mx.argmax(last).item()))
        last = lm(mx.array([[continuation[-1]]], dtype=mx.int32), cache=cache).logits[0, -1]
    return Run(logprobs, argmax, continuation)


async def engine_run(path: str, ids: list[int], chunk: int, new: int, quant: tuple[int, int] | None
                     ) -> tuple[Run, dict[str, Any]]:
    """The passage through vlmserve's engine with ``prompt_logprobs``; returns its run and how it was served."""
    from vlmserve.engine.engine_config import EngineConfig
    from vlmserve.engine.params import SamplingParams
    from vlmserve.frontend.async_engine import AsyncEngine
    from vlmserve.inputs import PromptInputs

    bits, group = quant or (None, 64)
    config = EngineConfig(kv_bits=bits, kv_group_size=group, prefill_chunk=chunk, dtype="float32",
                          prefix_cache=False, max_batch_size=1)
    engine = AsyncEngine(path, config=config)
    await engine.start()
    scored: tuple[Any, ...] | None = None
    tokens: list[int] = []
    first_step = 0
    try:
        assert engine.loaded is not None
        served = engine.loaded.adapter.kv_quant
        assert (served is not None) == (quant is not None), engine.kv_quant_off
        params = SamplingParams(max_tokens=new, prompt_logprobs=1, ignore_eos=True)  # top 1: each position's argmax
        async for out in engine.generate("kv-accuracy", PromptInputs(list(ids)), params):
            if out.error:
                raise RuntimeError(out.error)
            scored = out.prompt_logprobs if out.prompt_logprobs is not None else scored
            first_step = first_step or out.engine_step
            tokens += out.token_ids
    finally:
        await engine.shutdown()
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    run = Run([lp.logprob for lp in scored[1:]], [lp.top[0][0] for lp in scored[1:]], tokens)
    return run, {"engine_step_of_first_token": first_step, "kv_quant": repr(served)}


def measure(args: argparse.Namespace, path: str, ids: list[int]) -> dict[str, Any]:
    from mlx_vlm.utils import load

    from vlmserve.progress import progress

    model, _ = load(path)
    lm, results, extra = model.language_model, {}, {}
    jobs = [("mlx-lm", q, s) for s in (False, True) for q in SETTINGS] + [("vlmserve", q, False) for q in SETTINGS]
    with progress(total=len(jobs) + 2, desc="kv accuracy", unit="run", file=sys.stderr) as bar:
        ref = mlx_lm_run(lm, ids, args.chunk, args.new, None, False)
        bar.update(1)
        engine_ref, extra["vlmserve full"] = asyncio.run(engine_run(path, ids, args.chunk, args.new, None))
        results["vlmserve full vs mlx-lm full"] = compare(engine_ref, ref)
        bar.update(1)
        for side, (bits, group), settle in jobs:
            name = f"{side} {bits}/{group}" + (" (after 1st chunk)" if settle else "")
            bar.set_postfix_str(name)
            if side == "mlx-lm":
                results[name] = compare(mlx_lm_run(lm, ids, args.chunk, args.new, (bits, group), settle), ref)
            else:
                run, extra[name] = asyncio.run(engine_run(path, ids, args.chunk, args.new, (bits, group)))
                results[name] = compare(run, engine_ref)
            bar.update(1)
    return {"results": results, "engine": extra, "reference_continuation": ref.continuation,
            "engine_reference_continuation": engine_ref.continuation}


def table(results: dict[str, dict[str, float]], new: int) -> str:
    lines = ["| cache | mean \\|Δ logprob\\| (nats) | max \\|Δ\\| | argmax agreement (prompt) "
             f"| greedy agreement ({new} tokens) | common prefix |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['mean_abs_dlogprob']:.4f} | {r['max_abs_dlogprob']:.3f} | "
                     f"{r['argmax_agreement']:.1%} | {r['continuation_agreement']:.1%} | "
                     f"{r['continuation_common_prefix']}/{new} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=600, help="the passage's length in tokens")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    parser.add_argument("--new", type=int, default=32, help="greedy tokens after the passage")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_quant_accuracy.json")
    args = parser.parse_args()
    from vlmserve.blas import find_openblas, openblas_preloaded

    library = find_openblas()
    if library is not None and not openblas_preloaded() and not os.environ.get("VLMSERVE_NO_OPENBLAS"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": library})  # fast f32
    from transformers import AutoTokenizer

    from benchmarks.real_weights import build_smolvlm_smollm2

    path = str(build_smolvlm_smollm2(dtype="float32"))
    ids = [int(i) for i in AutoTokenizer.from_pretrained(path)(PASSAGE, add_special_tokens=False)["input_ids"]]
    assert len(ids) >= args.tokens, f"the passage has only {len(ids)} tokens"
    ids = ids[: args.tokens]
    report = {"model": path, "tokens": len(ids), "chunk": args.chunk, "new_tokens": args.new,
              "blas": "OpenBLAS" if openblas_preloaded() else "reference", **measure(args, path, ids)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report["results"], args.new))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
