"""[any] The built-in demo VLM: a small gemma4 trained in-repo, on the CPU, on synthetic scenes.

    from vlmserve.testing.demo import demo_model_path
    path = demo_model_path()  # vlmserve/assets/demo-gemma4: mlx_vlm.load(str(path)) loads it

It captions pictures of coloured shapes, answers questions about them, greets, and calls a
weather tool; see vlmserve/assets/demo-gemma4/MODEL_CARD.md for exactly what it knows. Importing this
package is cheap: MLX is imported only by training and evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.config import DEMO_MODEL_DIR, default_model_path
from vlmserve.testing.demo.evaluate import DEFAULT_EVAL_N

__all__ = ["DEMO_MODEL_DIR", "demo_model_path", "evaluate_demo", "train_demo"]


def demo_model_path() -> Path:
    """The committed demo model's directory (package data); FileNotFoundError if it is not there."""
    return default_model_path()


def train_demo(
    out: Path,
    seed: int = 0,
    steps: int | None = None,
    evaluate: bool = True,
    eval_n: int = DEFAULT_EVAL_N,
) -> Path:
    """Train the demo model into ``out`` (replacing an earlier one), score it, write its card."""
    from vlmserve.testing.demo.card import write_model_card
    from vlmserve.testing.demo.train import TrainConfig, train

    config = TrainConfig(seed=seed) if steps is None else TrainConfig(seed=seed, steps=steps)
    info = train(config, Path(out))
    scores = evaluate_demo(Path(out), n=eval_n) if evaluate else None
    write_model_card(Path(out), info, scores)
    return Path(out)


def evaluate_demo(path: Path, n: int = DEFAULT_EVAL_N) -> dict[str, Any]:
    """Caption exact match and QA accuracy on ``n`` held-out scenes, through the serving path."""
    from vlmserve.testing.demo.evaluate import evaluate_demo as run

    return run(Path(path), n=n)
