"""[main] TTFT of a ~2,000-token system prompt (+ an image): cold, from memory, from disk after a restart (issue 45).

    python benchmarks/disk_cache_bench.py [--models qwen2_5_vl,smollm2] [--servers vlmserve,vlmserve_kv8,mlx_vlm,vllm_mlx]
        [--reps 3] [--system-tokens 2000] [--image-size 448] [--no-warmup] [--vllm-mlx VENV] [--out DIR] [--plot PNG]
    python benchmarks/disk_cache_bench.py --rerender [--out DIR]     # table and plot again

The request: a fixed tool-use policy cut to ``--system-tokens`` of the model's tokenizer, then one image
(qwen2_5_vl/small in float32, 448 px kept whole as in vision_cache_bench) or none (the real SmolLM2-135M)
and a question; greedy, 8 tokens, streamed. Per rep: a fresh server on an empty cache directory answers a
warm-up (short, another image), then the request (cold) and again (memory); SIGTERM, a restart on the same
directory, the warm-up, the request (disk). Around each request: vlmserve's /metrics or mlx_vlm.server's
/v1/cache/stats. Servers: vlmserve ``--prefix-cache-dir`` (``--mm-prefix-cache`` with an image), the same
with ``--kv-bits 8``, mlx_vlm.server (``APC_ENABLED=1 APC_DISK_ENABLED=1 APC_DISK_PATH=DIR``), vllm-mlx
(``--ssd-cache-dir DIR --ssd-cache-max-gb 4``, venv ``--vllm-mlx``). Writes disk_cache.json/.md to DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from compare import OPENBLAS, free_port, machine, stop, wait_ready
from loadgen import _sse_lines, messages, synthetic_images
from prometheus_client.parser import text_string_to_metric_families
from report import _table
from vision_cache_bench import bench_model

from vlmserve.progress import progress

HERE = Path(__file__).resolve().parent
VLLM_MLX = HERE / "results" / "venvs" / "vllm-mlx"
PHASES = ("cold", "memory", "disk")
TITLES = {"qwen2_5_vl": "qwen2_5_vl/small float32, one 448 px image", "smollm2": "SmolLM2-135M float32, text"}
GROUP = {"qwen2_5_vl": "32", "smollm2": "64"}  # --kv-group-size: divides the head size
QUESTION = "Which tool should I use to move my meeting with Dana to Friday, and what must I confirm first?"
TOOLS = ("search_flights", "book_hotel", "get_weather", "convert_currency", "send_email", "create_calendar_event",
         "query_database", "read_file", "write_file", "run_shell", "translate_text", "summarize_document")
RULES = ("Use {t} only when the user has asked for it in plain words, never because it seems helpful.",
         "Before calling {t}, restate the arguments you intend to pass and check each against the user's request.",
         "If {t} fails, report the error message verbatim, do not retry more than {n} times, and suggest a fix.",
         "Never pass secrets, passwords or personal identifiers to {t} unless the user typed them in this turn.",
         "When {t} returns more than {m} items, summarise the first few and say how many were left out.",
         "Answers that rely on {t} must name it, give the time of the call, and quote the relevant fields.",
         "Rule {k} overrides earlier rules about {t} where they disagree; later rules override rule {k}.")


def policy(count: Callable[[str], int], tokens: int) -> str:
    """The system prompt: sections of rules, one tool each, until it holds ``tokens`` of the tokenizer."""
    text, k = "You are an assistant that operates tools for a travel and office team. Follow this policy.\n", 0
    while count(text) < tokens:
        tool = TOOLS[k % len(TOOLS)]
        rules = " ".join(r.format(t=tool, n=2 + k % 3, m=5 + k, k=k + 1) for r in RULES)
        text += f"\nSection {k + 1} (revision {k // len(TOOLS) + 1}), the tool {tool}: {rules}\n"
        k += 1
    return text


def request(model: str, path: Path, tokens: int, image_size: int) -> tuple[list[Any], list[Any]]:
    """The measured messages and a warm-up's (a short prompt; another image where the request has one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    system = policy(lambda s: len(tokenizer(s)["input_ids"]), tokens)
    if model == "smollm2":
        return ([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
                [{"role": "user", "content": "Say hello."}])
    warm, image = synthetic_images(2, size=image_size, seed=45)
    return ([{"role": "system", "content": system}, *messages(QUESTION, image)], messages("Say hello.", warm))


def argv_for(server: str, model: str, path: Path, port: int, cache: Path, venv: Path) -> tuple[list[str], str]:
    """The server's command line and its readiness path."""
    py, image = sys.executable, model != "smollm2"
    if server.startswith("vlmserve"):
        kv = ["--kv-bits", "8", "--kv-group-size", GROUP[model]] if server == "vlmserve_kv8" else []
        return [py, "-m", "vlmserve", "serve", "--model", str(path), "--port", str(port), "--dtype", "model",
                "--prefix-cache-dir", str(cache), *(["--mm-prefix-cache"] if image else []), *kv], "/ready"
    if server == "mlx_vlm":
        return [py, "-m", "mlx_vlm.server", "--model", str(path), "--host", "127.0.0.1", "--port", str(port)], "/health"
    return [str(venv / "bin" / "vllm-mlx"), "serve", str(path), "--mllm", "--continuous-batching", "--ssd-cache-dir",
            str(cache), "--ssd-cache-max-gb", "4", "--host", "127.0.0.1", "--port", str(port)], "/v1/models"


@contextlib.contextmanager
def running(argv: list[str], ready: str, port: int, env: dict[str, str], log: Path) -> Iterator[dict[str, Any]]:
    """A server for the block (ready_s, or why it failed); then SIGTERM, a clean shutdown: exit code and time."""
    with log.open("a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
        info: dict[str, Any] = {}
        began = time.perf_counter()
        try:
            problem = wait_ready(proc, f"http://127.0.0.1:{port}{ready}", timeout=300)
            info = {"failed": problem} if problem else {"ready_s": round(time.perf_counter() - began, 1)}
            yield info
        finally:
            began = time.perf_counter()
            stop(proc)  # SIGTERM; SIGKILL after 15 s
            info.update(exit_code=proc.returncode, stop_s=round(time.perf_counter() - began, 1))


async def counters(client: httpx.AsyncClient, server: str) -> dict[str, float]:
    """vlmserve's prefix-cache and vision counters, or mlx_vlm.server's APC stats; {} elsewhere."""
    if server == "mlx_vlm":
        stats = (await client.get("/v1/cache/stats")).json()
        return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not server.startswith("vlmserve"):
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for s in family.samples:
            if s.name.startswith(("vlmserve_prefix_cache", "vlmserve_mm_prefix_cache", "vlmserve_vision_seconds")):
                name = s.name.removeprefix("vlmserve_").removesuffix("_total")
                values[name] = values.get(name, 0.0) + s.value
    return values


async def timed(client: httpx.AsyncClient, server: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: TTFT (to the first content), usage, and the counters' deltas around it."""
    before, out = await counters(client, server), dict[str, Any](ttft_s=None, text="")
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in _sse_lines(response):
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            text = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
            if out["ttft_s"] is None and text:
                out["ttft_s"] = round(time.perf_counter() - sent, 4)
            out["text"] += text
            if chunk.get("usage"):
                usage = chunk["usage"]
                out.update(prompt_tokens=usage.get("prompt_tokens"),
                           cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    after = await counters(client, server)
    out["counters"] = {k: round(v - before.get(k, 0.0), 6) for k, v in after.items() if v != before.get(k, 0.0)}
    return out


async def phase(port: int, server: str, body: dict[str, Any], warm: dict[str, Any] | None, runs: int,
                drain: bool) -> list[dict[str, Any]]:
    """The warm-up (not counted), then ``runs`` measured requests; mlx_vlm's disk writes drained if asked."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        if warm is not None:
            (await client.post("/v1/chat/completions", json=warm)).raise_for_status()
        results = [await timed(client, server, body) for _ in range(runs)]
        for _ in range(120 if drain and server == "mlx_vlm" else 0):
            if not (await client.get("/v1/cache/stats")).json().get("disk_pending_bytes"):
                break
            await asyncio.sleep(0.5)
    return results


def model_path(model: str, image_size: int) -> Path:
    if model == "smollm2":
        from real_weights import build_smolvlm_smollm2

        return build_smolvlm_smollm2()  # float32
    return bench_model(model, "float32", image_size, HERE / "results" / "models")


def bench(model: str, server: str, args: argparse.Namespace, env: dict[str, str], bar: Any) -> dict[str, Any]:
    """``--reps`` times: a fresh server and directory (cold, memory), a restart on that directory (disk)."""
    path = model_path(model, args.image_size)
    msgs, warm_msgs = request(model, path, args.system_tokens, args.image_size)
    extra = {"ignore_eos": True} if server.startswith("vlmserve") else {}
    base = {"model": str(path), "max_tokens": 8, "temperature": 0.0, "stream_options": {"include_usage": True}, **extra}
    body, warm = {**base, "messages": msgs}, (None if args.no_warmup else {**base, "messages": warm_msgs})
    env = {**env, **({"APC_ENABLED": "1", "APC_DISK_ENABLED": "1"} if server == "mlx_vlm" else {})}
    out: dict[str, Any] = {"model": model, "server": server, "path": str(path), "reps": []}
    cache, log = args.out / "cache" / f"{model}-{server}", args.out / f"{model}-{server}.log"
    # vllm-mlx also saves its prefix cache at shutdown to, and loads it at start from, a directory of its own
    own = Path.home() / ".cache" / "vllm-mlx" / "prefix_cache" / str(path).replace("/", "--")
    for _ in range(args.reps):
        for d in (cache, own):
            shutil.rmtree(d, ignore_errors=True)
        cache.mkdir(parents=True)
        port = free_port()
        out["argv"], ready = argv_for(server, model, path, port, cache, args.vllm_mlx)
        row: dict[str, Any] = {}
        for start in ("first", "restart"):
            with running(out["argv"], ready, port, {**env, "APC_DISK_PATH": str(cache)}, log) as row[start]:
                if "failed" not in row[start]:
                    try:
                        got = asyncio.run(phase(port, server, body, warm, 2 if start == "first" else 1, start == "first"))
                        row.update(zip(PHASES, got) if start == "first" else {"disk": got[0]})
                    except (httpx.HTTPError, ValueError) as exc:
                        row[start]["failed"] = f"{type(exc).__name__}: {exc}"[:300]
            for key, d in (("cache_dir", cache), ("vllm_mlx_own_dir", own)):
                files = [f for f in d.rglob("*") if f.is_file()]
                row[start][key] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
            bar.update(1)
            if "failed" in row[start]:
                tail = " ".join(log.read_text(errors="replace").strip().splitlines()[-1:])[:300]
                return {**out, "failed": f"{start} start: {row[start]['failed']}; log: {tail}"}
        out["reps"].append(row)
    return out


def med(values: list[float], digits: int = 4) -> float | None:
    return round(statistics.median(values), digits) if values else None


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Medians over the reps; for vlmserve, disk read s/token against prefill s/token, and the tower's time."""
    reps = run["reps"]
    out: dict[str, Any] = {p: med([r[p]["ttft_s"] for r in reps if r[p]["ttft_s"] is not None]) for p in PHASES}
    out.update({f"cached_{p}": med([r[p].get("cached_tokens") or 0 for r in reps]) for p in PHASES})
    out["prompt_tokens"] = med([r["cold"].get("prompt_tokens") or 0 for r in reps])
    out["same_answers"] = sum(r["cold"].get("text") == r["memory"].get("text") == r["disk"].get("text") for r in reps)
    if run["server"].startswith("vlmserve"):
        out.update({f"vision_s_{p}": med([r[p]["counters"].get("vision_seconds", 0.0) for r in reps]) for p in PHASES})
        read = [r["disk"]["counters"].get("prefix_cache_disk_read_seconds", 0.0) for r in reps]
        out["disk_read_s"] = med(read)
        out["disk_read_s_per_token"] = med([s / max(1, r["disk"].get("cached_tokens") or 0) for s, r in zip(read, reps)], 9)
        out["prefill_s_per_token"] = med([r["cold"]["ttft_s"] / r["cold"]["prompt_tokens"] for r in reps], 9)
    if out["cold"] and out["disk"]:
        out["disk_over_cold"] = round(out["disk"] / out["cold"], 3)
    return out


def render(summary: dict[str, Any]) -> str:
    header = ["model", "server", "prompt tokens", "cold TTFT s", "memory TTFT s", "disk-after-restart TTFT s",
              "disk/cold", "same answer (reps)", "cached tokens (memory / disk)", "disk read ms/token", "prefill ms/token (cold)",
              "vision tower s (cold / memory / disk)"]
    rows, failed = [], []
    for run in summary["runs"]:
        if "failed" in run:
            failed.append(f"- {run['model']}, {run['server']}: {run['failed']}")
            continue
        s = run["summary"]
        rows.append([run["model"], run["server"], s["prompt_tokens"], s["cold"], s["memory"], s["disk"],
                     s.get("disk_over_cold", "-"), f"{s['same_answers']}/{len(run['reps'])}",
                     f"{s['cached_memory']} / {s['cached_disk']}",
                     *(f"{1000 * s[k]:.4f}" if s.get(k) else "-" for k in ("disk_read_s_per_token", "prefill_s_per_token")),
                     " / ".join(str(s.get(f"vision_s_{p}", "-")) for p in PHASES)])
    return _table(header, rows) + ("\nFailed:\n" + "\n".join(failed) + "\n" if failed else "")


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in summary["runs"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), dpi=90, squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = [r for r in summary["runs"] if r["model"] == model and "failed" not in r]
        for i, p in enumerate(PHASES):
            bars = ax.bar([j + (i - 1) * 0.27 for j in range(len(runs))], [r["summary"][p] or 0 for r in runs], 0.27,
                          label={"disk": "disk after restart"}.get(p, p))
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
        ax.set_xticks(range(len(runs)), [r["server"] for r in runs], fontsize=8)
        ax.set(ylabel="TTFT s (median, log scale)", yscale="log", title=TITLES.get(model, model))
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"~{summary['system_tokens']}-token system prompt, 8 tokens, greedy", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="qwen2_5_vl,smollm2")
    parser.add_argument("--servers", default="vlmserve,vlmserve_kv8,mlx_vlm,vllm_mlx")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--no-warmup", action="store_true", help="no unrelated request before cold and disk")
    parser.add_argument("--vllm-mlx", type=Path, default=VLLM_MLX, help="the venv vllm-mlx is installed in")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "disk-cache")
    parser.add_argument("--plot", type=Path, default=HERE / "disk_cache_ttft.png")
    parser.add_argument("--rerender", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rerender:
        summary = json.loads((args.out / "disk_cache.json").read_text())
    else:
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLMSERVE_NO_OPENBLAS="1", LD_PRELOAD=OPENBLAS)
        cells = [(m, s) for m in args.models.split(",") for s in args.servers.split(",")]
        with progress(total=2 * args.reps * len(cells), desc="disk cache", unit="start", file=sys.stderr) as bar:
            runs = []
            for model, server in cells:
                bar.set_postfix_str(f"{model} {server}")
                runs.append(bench(model, server, args, env, bar))
        summary = {"machine": machine(env), "system_tokens": args.system_tokens, "image_size": args.image_size,
                   "reps": args.reps, "warmup": not args.no_warmup, "runs": runs}
    for run in summary["runs"]:
        if "failed" not in run:
            run["summary"] = summarise(run)
    (args.out / "disk_cache.json").write_text(json.dumps(summary, indent=1))
    text = render(summary)
    (args.out / "disk_cache.md").write_text(text)
    plot(summary, args.plot)
    print(text)
    print(f"results in {args.out}, plot in {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
