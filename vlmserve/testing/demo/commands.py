"""[main] The ``train-demo`` and ``eval-demo`` subcommands, for ``vlmserve.cli`` to register."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vlmserve.config import usage_error
from vlmserve.testing.demo.evaluate import DEFAULT_EVAL_N

DRAFTER_STEPS = {"mtp": 400, "dflash": 300, "eagle3": 150}  # each kind's default: ~10-15 minutes on 2 shared cores


def add_cli(subparsers: Any) -> None:
    """Register ``train-demo`` and ``eval-demo`` on an ``argparse`` subparsers object."""
    train = subparsers.add_parser("train-demo", help="train the built-in demo model on synthetic scenes (CPU, at most ~60 min)")
    train.add_argument("--out", type=Path, required=True, help="directory to write the model to (replaced)")
    train.add_argument("--seed", type=int, default=0, help="same seed, byte-identical weights")
    train.add_argument("--steps", type=int, default=None, help="chat steps at most (default: the shipped model's cap)")
    train.set_defaults(func=_train_command, wants_openblas=True)

    drafter = subparsers.add_parser("train-demo-drafter",
                                    help="train a drafter of the demo model for speculative decoding (CPU, ~10 min)")
    drafter.add_argument("--out", type=Path, required=True, help="directory to write the drafter to")
    drafter.add_argument("--model", type=Path, default=None, help="the demo model it drafts for (default: the built-in)")
    drafter.add_argument("--kind", choices=tuple(DRAFTER_STEPS), default="mtp",
                         help="mtp: a Gemma 4 assistant; dflash: a DFlash block drafter; eagle3: an EAGLE-3 drafter")
    drafter.add_argument("--steps", type=int, default=None, help="training steps (default: 400 mtp, 300 dflash, 150 eagle3)")
    drafter.add_argument("--seed", type=int, default=0)
    drafter.set_defaults(func=_train_drafter_command, wants_openblas=True)

    evaluate = subparsers.add_parser(
        "eval-demo", help="score the demo model on held-out grid and free-position scenes, tests/drawings.py, JSON and tools"
    )
    evaluate.add_argument("--model", type=Path, default=None, help="model directory (default: the built-in demo)")
    evaluate.add_argument("--n", type=int, default=DEFAULT_EVAL_N, help="held-out scenes of each kind")
    evaluate.set_defaults(func=_eval_command)


def _train_command(args: argparse.Namespace) -> int:
    from vlmserve.testing.demo import train_demo

    if args.steps is not None and args.steps < 1:
        return usage_error("--steps must be at least 1")
    path = train_demo(args.out, seed=args.seed, steps=args.steps)
    print(path)
    return 0


def _train_drafter_command(args: argparse.Namespace) -> int:
    from vlmserve.testing.demo.drafter import train_drafter
    from vlmserve.testing.demo.drafter_dflash import train_dflash_drafter
    from vlmserve.testing.demo.drafter_eagle3 import train_eagle3_drafter

    steps = DRAFTER_STEPS[args.kind] if args.steps is None else args.steps
    if steps < 1:
        return usage_error("--steps must be at least 1")
    target = _model_or_demo(args.model)
    if isinstance(target, str):
        return usage_error(target)
    trainer = {"mtp": train_drafter, "dflash": train_dflash_drafter, "eagle3": train_eagle3_drafter}[args.kind]
    info = trainer(target, args.out, steps=steps, seed=args.seed)
    print(f"{args.out}: held-out accuracy per drafted token {info['held_out_accuracy_per_depth']}")
    return 0


def _eval_command(args: argparse.Namespace) -> int:
    from vlmserve.testing.demo import evaluate_demo

    if args.n < 1:
        return usage_error("--n must be at least 1")
    path = _model_or_demo(args.model)
    if isinstance(path, str):
        return usage_error(path)
    print(format_scores(evaluate_demo(path, n=args.n)))
    return 0


def _model_or_demo(model: Path | None) -> Path | str:
    """``--model``, else the built-in demo model; what is wrong where it is missing."""
    from vlmserve.testing.demo import demo_model_path

    try:
        return model or demo_model_path()
    except FileNotFoundError as exc:
        return str(exc)


def format_scores(scores: dict[str, Any]) -> str:
    """The scores as a small fixed-width table, then the first failures if any."""
    groups = scores["groups"]
    rows = [("1 grid: caption exact", scores["n_scenes"], scores["caption_exact_match"]),
            ("  qa accuracy", scores["n_scenes"], scores["qa_accuracy"])]  # fmt: skip
    rows += [(f"    {name}", g["n"], g["accuracy"]) for name, g in groups.items() if name.startswith("qa_")]
    if "free_caption" in groups:
        rows.append(("2 free: caption exact", groups["free_caption"]["n"], groups["free_caption"]["accuracy"]))
    if "drawing" in groups:
        rows.append(("3 drawings: named", groups["drawing"]["n"], groups["drawing"]["accuracy"]))
    rows += [(f"4 {name}", g["n"], g["accuracy"]) for name, g in groups.items() if name.startswith("json_")]
    rows += [(f"5 {name}" if name.startswith("tool") else name, g["n"], g["accuracy"])
             for name, g in groups.items() if name in ("tool_call", "tool_result", "small_talk")]  # fmt: skip
    lines = [f"{'metric':<28}{'n':>6}{'score':>8}", "-" * 42]
    lines += [f"{name:<28}{n:>6}{value:>8.3f}" for name, n, value in rows]
    lines.append(f"{'ended by EOS':<28}{'':>6}{scores['stopped_by_eos']:>8.3f}")
    for failure in scores.get("failures", [])[:8]:
        lines.append(f"miss ({failure.get('group', '?')}): expected {failure['expected']!r}, got {failure['got']!r}")
    return "\n".join(lines)
