"""[main] Speculative decoding against none, in one run, on the same engine code: tokens/s per
workload and concurrency, the ratio, and the draft acceptance (engine/speculative.py).

Two model kinds:
- ``--model real`` (default): SmolLM2-135M-Instruct's real weights in a SmolVLM
  (``benchmarks/real_weights.py``), text workloads: ``copy`` (repeat a passage: ngram drafts),
  ``edit`` (rewrite a JSON object with one value changed, the original as the ``prediction``) and
  ``free`` (a story: ngram drafts, which rarely match);
- ``--model demo``: the demo model's caption of ``assets/example.png``, with the right caption as the
  prediction (``copy``), one colour wrong (``edit``), or none (``free``); and its shapes as JSON, no
  prediction (``json``, a longer answer).

Each cell runs ``--rounds`` rounds of ``c`` concurrent greedy requests through two ``AsyncEngine``s
side by side (no HTTP), one with speculation and one without, round by round in alternating order, so
that a noisy machine's drift falls on both; the answers with and without speculation are checked equal. Float32 weights want OpenBLAS
(``LD_PRELOAD``, see vlmserve/blas.py); the program restarts itself under it when it is installed,
unless ``VLMSERVE_NO_OPENBLAS`` is set.

With ``--method KIND --drafter DIR`` (``mtp``, ``dflash``, ``eagle3`` or ``draft_model``; a drafter
alone means ``mtp``, and ``demo-gemma4-assistant`` names the demo model's) the speculating engine
drafts with that drafter instead of prompt lookup; requests with a prediction still draft from it.
``--long N`` adds ``long``: a summary of an ~N-token document (Python's own ``json`` and ``textwrap``
sources), where a wide verify costs most and the adaptive policy should stop drafting. Each cell
reports ``per_step``: draft tokens per row step (a step of a row drafts, or decodes one token), which
falls to ~0 where the policy stops drafting.

    python benchmarks/spec_bench.py [--model real|demo|DIR] [--method KIND] [--drafter DIR] [--long N]
        [--concurrency 1,4,8] [--rounds 2] [--forced] [--tag NAME]
    python benchmarks/spec_bench.py --collect --out benchmarks/results/spec_kinds

Each run's file records the machine's load average as it started and ended (a shared machine's ratios
move with it; acceptance and draft counts do not). ``--collect`` joins every ``spec_bench-*.json`` in
``--out`` into ``spec_kinds.json`` and the table ``spec_kinds.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from PIL import Image

from vlmserve.blas import find_openblas, openblas_preloaded
from vlmserve.config import DEMO_MODEL_DIR, resolve_drafter
from vlmserve.engine.engine_config import EngineConfig
from vlmserve.engine.params import SamplingParams
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.frontend.async_engine import AsyncEngine
from vlmserve.progress import progress

ROOT = Path(__file__).resolve().parent.parent
PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the "
           "ninety steps, trimmed the wick and wound the clockwork that turned the great lens. Ships passing in "
           "the dark saw its beam sweep the water once every ten seconds, and knew where the rocks were.")
RECORD = json.dumps({"name": "Ada Lovelace", "born": 1815, "city": "London", "fields": ["mathematics", "computing"],
                     "notes": "wrote the first published algorithm for a machine"}, indent=1)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    messages: list[dict[str, Any]]
    images: list[Image.Image]
    prediction: str | None  # None: drafts from prompt lookup only


def _text(prompt: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": prompt}]}]


def real_workloads() -> list[Workload]:
    return [Workload("copy", _text(f"Repeat the following passage word for word.\n\n{PASSAGE}"), [], None),
            Workload("edit", _text(f"Here is a JSON object:\n{RECORD}\nWrite it again with the city changed to "
                                   "Paris. Answer with the JSON only."), [], RECORD),
            Workload("free", _text("Write a short story about a lighthouse keeper and a storm."), [], None)]


def long_workload(tokens: int) -> Workload:
    """A summary of ~``tokens`` tokens of Python's own sources (~3.3 characters a token with SmolLM2's BPE)."""
    import json.decoder
    import textwrap
    text = (inspect.getsource(json.decoder) + inspect.getsource(textwrap))[:int(tokens * 3.3)]
    return Workload("long", _text(f"Summarize what this code does in plain English.\n\n{text}"), [], None)


def demo_workloads(caption: str) -> list[Workload]:
    image = Image.open(ROOT / "assets" / "example.png").convert("RGB")
    ask = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    edited = caption.replace("red", "green", 1)
    as_json = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Return the shapes as JSON."}]}]
    return [Workload("copy", ask, [image], caption), Workload("edit", ask, [image], edited),
            Workload("free", ask, [image], None), Workload("json", as_json, [image], None)]


async def _one(engine: AsyncEngine, rid: str, work: Workload, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate_chat(rid, work.messages, work.images, None, params):
        assert out.error is None, out.error
        tokens += out.token_ids
    return tokens


async def _round(engine: AsyncEngine, work: Workload, params: SamplingParams, c: int, r: int
                 ) -> tuple[float, list[list[int]]]:
    """One round of ``c`` concurrent requests: its seconds and answers."""
    start = time.perf_counter()
    outputs = await asyncio.gather(*(_one(engine, f"{work.name}-{r}-{i}-{time.monotonic_ns()}", work, params)
                                     for i in range(c)))
    return time.perf_counter() - start, list(outputs)


async def _run(args: argparse.Namespace, model: str, spec: SpeculativeConfig, levels: list[int]
               ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Both engines side by side (without speculation, and with ``spec``), each cell's rounds taken in
    turn, first one engine then the other, alternating: the machine's drift falls on both alike."""
    engines = {name: AsyncEngine(model, config=EngineConfig(max_batch_size=max(levels), speculative=config,
                                                            dtype=args.dtype, prefix_cache=False,
                                                            vision_cache_bytes=0))
               for name, config in (("off", None), ("spec", spec))}
    for engine in engines.values():
        await engine.start()
    try:
        params = SamplingParams(max_tokens=args.max_tokens)
        off = engines["off"]
        if args.model == "demo":
            probe = demo_workloads("")[2]
            workloads = demo_workloads(off.prompter.detokenize(await _one(off, "probe", probe, params)))
        else:
            workloads = real_workloads()
        workloads = [w for w in workloads if w.name in args.workloads.split(",")]
        workloads += [long_workload(args.long)] if args.long else []
        cells: dict[str, dict[str, dict[str, Any]]] = {"off": {}, "spec": {}}
        with progress(desc=f"{spec.method} against none: workloads x concurrency",
                      total=len(workloads) * len(levels)) as bar:
            for work in workloads:
                asked = {"off": params, "spec": params}
                if work.prediction is not None:
                    ids = off.prompter.tokenize(work.prediction, add_special_tokens=False)
                    asked["spec"] = dataclasses.replace(params, prediction=tuple(ids))
                for c in levels:
                    before = await engines["spec"].stats()
                    seconds, outputs = {"off": 0.0, "spec": 0.0}, {"off": [], "spec": []}
                    for r in range(args.rounds):
                        for name in ("off", "spec") if r % 2 == 0 else ("spec", "off"):
                            took, answers = await _round(engines[name], work, asked[name], c, r)
                            seconds[name] += took
                            outputs[name] += answers
                    after = await engines["spec"].stats()
                    drafted = after.spec_draft_tokens - before.spec_draft_tokens
                    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
                    # a row step yields one token plus those of its draft accepted
                    row_steps = after.generated_tokens - before.generated_tokens - accepted
                    for name in cells:
                        total = sum(len(o) for o in outputs[name])
                        cells[name][f"{work.name}/{c}"] = {
                            "tok_s": total / seconds[name], "tokens": total // len(outputs[name]),
                            "drafted": drafted, "acceptance": accepted / drafted if drafted else None,
                            "per_step": drafted / max(row_steps, 1),
                            "outputs": outputs[name]}
                    bar.update()
        return cells["off"], cells["spec"]
    finally:
        for engine in engines.values():
            await engine.shutdown()


def _rows(off: dict[str, dict[str, Any]], spec: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key, cell in spec.items():
        base = off[key]
        name, c = key.split("/")
        assert cell.pop("outputs") == base.pop("outputs"), f"{key}: speculation changed the answers"
        rows.append({"workload": name, "c": int(c), "tokens": cell["tokens"], "tok_s_off": round(base["tok_s"], 1),
                     "tok_s_spec": round(cell["tok_s"], 1), "ratio": round(cell["tok_s"] / base["tok_s"], 2),
                     "acceptance": None if cell["acceptance"] is None else round(cell["acceptance"], 3),
                     "drafted": cell["drafted"], "per_step": round(cell["per_step"], 2)})
    return rows


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)")
        return
    names = sorted({r["workload"] for r in rows}, key=[r["workload"] for r in rows].index)
    levels = sorted({r["c"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, c in enumerate(levels):
        ratios = [next(r["ratio"] for r in rows if r["workload"] == n and r["c"] == c) for n in names]
        ax.bar([j + i * 0.8 / len(levels) for j in range(len(names))], ratios, 0.8 / len(levels), label=f"c={c}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - 0.4 / len(levels) for j in range(len(names))], names)
    ax.set_ylabel("tok/s, speculation / none")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="real", help="real, demo, or a model directory (text workloads)")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", default="copy,edit,free")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", default=None, help="ngram (default), mtp, dflash, eagle3 or draft_model")
    parser.add_argument("--drafter", default=None, help="the drafter model of --method (alone: mtp)")
    parser.add_argument("--long", type=int, default=0, help="add a long-prompt workload of ~N tokens")
    parser.add_argument("--forced", action="store_true", help='"adaptive": false: draft on every step')
    parser.add_argument("--tag", default=None, help="the results' file name (default: model and drafter)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--collect", action="store_true", help="only join the runs in --out into spec_kinds.md/json")
    args = parser.parse_args()
    if args.collect:
        collect(args.out)
        return
    library = find_openblas()
    if library is not None and not openblas_preloaded() and not os.environ.get("VLMSERVE_NO_OPENBLAS"):
        env = {**os.environ, "LD_PRELOAD": library}  # float32 matmuls ~28x faster (vlmserve/blas.py)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.model == "real":
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from real_weights import build_smolvlm_smollm2
        model = str(build_smolvlm_smollm2())
    else:
        model = str(DEMO_MODEL_DIR) if args.model == "demo" else args.model
    levels = [int(c) for c in args.concurrency.split(",")]
    kind = args.method or ("mtp" if args.drafter else "ngram")
    drafter = resolve_drafter(args.drafter) if args.drafter else None
    method = SpeculativeConfig(method=kind, model=drafter, num_speculative_tokens=args.k, adaptive=not args.forced)
    load = os.getloadavg()[0]
    off, spec = asyncio.run(_run(args, model, method, levels))
    rows = _rows(off, spec)
    print(f"model {Path(model).name}, dtype {args.dtype}, BLAS: {'OpenBLAS' if openblas_preloaded() else 'reference'}")
    print(f"method {kind}" + (f", drafter {Path(drafter).name}" if drafter else "") + (", forced" if args.forced else ""))
    print("| workload | c | tokens | tok/s off | tok/s spec | ratio | acceptance | draft tokens | per row step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acceptance = "-" if r["acceptance"] is None else r["acceptance"]
        print(f"| {r['workload']} | {r['c']} | {r['tokens']} | {r['tok_s_off']} | {r['tok_s_spec']} | {r['ratio']}x | "
              f"{acceptance} | {r['drafted']} | {r['per_step']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.tag or Path(model).name + (f"-{Path(args.drafter).name}" if args.drafter else "")
    meta = {"model": Path(model).name, "method": kind, "drafter": drafter and Path(drafter).name, "k": args.k,
            "rounds": args.rounds, "max_tokens": args.max_tokens, "dtype": args.dtype, "adaptive": not args.forced,
            "load_average": [round(load, 1), round(os.getloadavg()[0], 1)]}
    print(f"load average (1 min): {meta['load_average'][0]} at the start, {meta['load_average'][1]} at the end")
    (args.out / f"spec_bench-{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    _plot(rows, args.out / f"spec_bench-{name}.png", f"speculative decoding, {name}")


def collect(out: Path) -> None:
    """Every run's file in ``out`` (``spec_bench-NAME.json``) into ``spec_kinds.json`` (by NAME) and one table,
    ``spec_kinds.md``: a row per run, workload and concurrency."""
    runs = {p.stem.removeprefix("spec_bench-"): json.loads(p.read_text()) for p in sorted(out.glob("spec_bench-*.json"))}
    (out / "spec_kinds.json").write_text(json.dumps(runs, indent=1) + "\n")
    lines = ["| run | method | adaptive | load | workload | c | tokens | tok/s off | tok/s spec | ratio | acceptance "
             "| draft tokens | per row step |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        load = "-".join(str(x) for x in run.get("load_average", [])) or run.get("load_note", "?")
        for r in sorted(run["rows"], key=lambda r: (r["workload"], r["c"])):
            acceptance = "-" if r["acceptance"] is None else r["acceptance"]
            lines.append(f"| {name} | {run['method']} | {'yes' if run.get('adaptive', True) else 'forced'} | {load} | "
                         f"{r['workload']} | {r['c']} | {r['tokens']} | {r['tok_s_off']} | {r['tok_s_spec']} | "
                         f"{r['ratio']}x | {acceptance} | {r['drafted']} | {r['per_step']} |")
    (out / "spec_kinds.md").write_text("# spec kinds (issue 58): every run in this folder (`spec_bench.py --collect`)\n\n"
                                      "load: the 1-minute load average as the run started and ended (2 shared cores)\n\n"
                                      + "\n".join(lines) + "\n")
    print(f"{len(runs)} runs: {out / 'spec_kinds.md'}")


if __name__ == "__main__":
    main()
