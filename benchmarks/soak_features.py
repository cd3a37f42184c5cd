"""[main] soak.py ``--features``: every feature on at once, MLX's memory beside the RSS, and the slope that says flat.

The server gets a ``--model-dir`` of three small offline models (gemma4, gemma3, qwen2_5_vl; copies, so the
folders are the DIR's own) with ``--max-loaded-models 2``: requests name one of the three at random, so
most of them load one and unload another. Beside that: the disk tier (``--prefix-cache-dir``), 8-bit KV
(``--kv-bits 8``), ngram speculation, and soak.py's own mix (images, dropped and stalled clients).

Each sample reads ``/metrics``: MLX's active and cached bytes (``vlmserve_mlx_*``, read on a worker at
scrape time), beside the RSS soak.py reads from ``/proc``. ``slope`` is the trend over the samples of the
run's second half: memory that levels off has a slope near 0 MiB/min there.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import httpx

ARCHS = ("gemma4", "gemma3", "qwen2_5_vl")
PINNED = "pinned"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def model_dir(root: Path) -> tuple[Path, list[str]]:
    """Three small models in ``root``, each a folder named by its family; their names."""
    from vlmserve.testing import build_model

    root.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        if not (root / arch).exists():  # a symlink out of the DIR would be refused (api/registry.py)
            shutil.copytree(build_model(arch, "micro"), root / arch)
    return root, list(ARCHS)


def server_args(out: Path) -> list[str]:
    """The flags that turn every feature on (KV groups of 32: the small models' heads are 32 wide). A fourth
    model, pinned (``--model``), takes the stalled clients and the huge images: its counters live as long as
    the server, so soak.py sees ``vlmserve_stalled_requests_total`` grow (an unloaded model's go with it)."""
    from vlmserve.testing import build_model

    root, _ = model_dir(out / "models")
    return ["--model", str(build_model("gemma4", "micro")), "--served-model-name", PINNED, "--model-dir", str(root), "--max-loaded-models", "2", "--idle-unload-s", "0",
            "--prefix-cache-dir", str(out / "prefix-disk"), "--kv-bits", "8", "--kv-group-size", "32",
            "--speculative-config", json.dumps(NGRAM)]


async def mlx_memory(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """MLX's (active, cached) MiB from ``/metrics``; None when no model is loaded to say, or the read failed."""
    try:
        text = (await client.get(f"{base_url}/metrics", timeout=10)).text
    except httpx.TransportError:  # a kept-alive connection closed as it was taken: the next sample reads it
        return None
    found = {k: float(v) for k, v in re.findall(r"^vlmserve_mlx_(active|cache)_bytes (\S+)$", text, re.M)}
    if len(found) < 2:
        return None
    return round(found["active"] / 2**20, 2), round(found["cache"] / 2**20, 2)


def slope(points: list[list[float]], column: int = 1, after_s: float = 0.0) -> float | None:
    """MiB per minute over ``(t, point[column])`` for ``t >= after_s``: the median of the slopes between every two
    samples (Theil-Sen), which a few spikes do not tilt as they tilt a least-squares line (a 30 MP image's decode
    lifts the RSS by 60-120 MiB for one sample)."""
    kept = [(p[0], p[column]) for p in points if p[0] >= after_s]
    pairs = [(y2 - y1) / (t2 - t1) for i, (t1, y1) in enumerate(kept) for t2, y2 in kept[i + 1:] if t2 > t1]
    return round(statistics.median(pairs) * 60, 2) if len(kept) >= 3 and pairs else None


def summary(rss: list[list[float]], mlx: list[list[float]], duration: float) -> dict[str, Any]:
    """Slopes over the second half (MiB/min): RSS, MLX active, MLX cache; with the halves' medians, and the
    server's threads at the first sample and the last."""
    half = duration / 2
    out: dict[str, Any] = {"from_s": half, "rss_slope": slope(rss, 1, half), "active_slope": slope(mlx, 1, half),
                           "cache_slope": slope(mlx, 2, half),
                           "threads": [mlx[0][3], mlx[-1][3]] if mlx and len(mlx[0]) > 3 else None}
    for name, points, column in (("rss", rss, 1), ("active", mlx, 1), ("cache", mlx, 2)):
        first = [p[column] for p in points if p[0] < half]
        second = [p[column] for p in points if p[0] >= half]
        out[f"{name}_median_mb"] = [statistics.median(first) if first else None,
                                    statistics.median(second) if second else None]
    return out


def plot(rss: list[list[float]], mlx: list[list[float]], flat: dict[str, Any], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=90)
    ax.plot([p[0] / 60 for p in rss], [p[1] for p in rss], lw=1.2, label=f"RSS ({flat['rss_slope']} MiB/min)")
    ax.plot([p[0] / 60 for p in mlx], [p[1] for p in mlx], lw=1.0, label=f"MLX active ({flat['active_slope']} MiB/min)")
    ax.plot([p[0] / 60 for p in mlx], [p[2] for p in mlx], lw=1.0, label=f"MLX cache ({flat['cache_slope']} MiB/min)")
    ax.axvline(flat["from_s"] / 60, color="0.5", ls="--", lw=0.8, label="second half (slopes)")
    ax.set(xlabel="minutes", ylabel="MiB", title=title)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
