"""[main] Train the demo model: full fine-tune in MLX on the CPU, on freshly generated chats.

Runs on the calling thread, which owns every array it makes. Two phases: a vision warm-up
(warmup.py: the vision tower alone learns each grid cell's shape and colour, and the connector
starts as that read-out in word embeddings), then the whole model on chats, every answer token
built and embedded exactly as at inference.

What the experiments behind the defaults showed (shared 2-core CPU, MLX's CPU backend):
- The ``mlx[cpu]`` wheel's own float32 matmul runs at ~5 GFLOP/s here, ~170 with OpenBLAS
  preloaded (``vlmserve.blas``): a vision warm-up step went from ~1 s to ~0.14 s.
- Scenes on free positions, 16 soft tokens and a 1-layer vision tower: held-out captions 0-4%
  exact, shapes confused. A 3x3 grid lined up with 3x3 soft tokens (16 px patches pooled 2x2,
  one token per cell) made every warm-up label exact: 99% of held-out cells right.
- With the vision tower taught, captions came right (~80%) but questions that must find a
  shape by name ("What colour is the star?") stayed at chance, even trained on questions alone:
  nothing tied the word to the image's features in budget. What fixed it: the demo's own BPE
  corpus (" red" was " re" + "d"), ``warmup.init_connector`` (captions 100% held-out), and
  answers that say the caption first, then "The star is green." / "The star is not there.":
  the word asked about sits right before the answer, found in the model's own words.
- Adam without bias correction (MLX's default) moves every weight ~3x the rate in its first
  steps: at 1e-2 that collapsed the image features within ~10 steps. The vision tower runs at
  a tenth of the rate here, to keep what the warm-up taught it.
- Gemma 4 attends with scale 1 and lets q/k norm weights set the temperature; at their init of
  1 attention starts near one-hot, and learning to read the image was several times slower
  (see model.retune_init).
- ``mx.compile`` cost ~60 s and was slower; examples of similar length share a batch.

Deterministic for a seed: the init is seeded by ``mx.random.seed`` and the data by numpy's
seeded generators, so the same seed gives byte-identical weights.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from vlmserve.blas import openblas_preloaded
from vlmserve.testing.demo.batches import HostBatch, batch_stream, prefetch
from vlmserve.testing.demo.dialogues import CAPTION_PROMPTS, WEATHER_REQUESTS, WEATHER_TOOL, image_message, user
from vlmserve.testing.demo.evaluate import generate_reply
from vlmserve.testing.demo.model import demo_recipe, initial_model, save_model
from vlmserve.testing.demo.render import render
from vlmserve.testing.demo.scenes import sample_scene
from vlmserve.testing.recipe import Recipe

TRAINING_INFO = "training.json"  # written last; marks a directory as a demo model we may replace


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Hyper-parameters; the defaults made the shipped model (see its MODEL_CARD.md)."""

    seed: int = 0
    steps: int = 1450
    batch_size: int = 16
    lr: float = 3e-3
    vision_lr_scale: float = 0.1  # the vision tower's rate, as a fraction of ``lr``
    warmup: int = 10
    final_lr_fraction: float = 0.05  # cosine decay ends at this fraction of ``lr``
    clip_norm: float = 1.0
    check_every: int = 250  # greedy-decoding checks; 0 = none
    vision_warmup_steps: int = 1400  # vision-only steps on per-cell shape and colour labels first (warmup.py)
    vision_warmup_batch: int = 32
    vision_warmup_lr: float = 5e-3


def forward_hidden(model: nn.Module, input_ids: mx.array, arrays: dict[str, mx.array]) -> mx.array:
    """Final hidden states, through the embedding path ``ModelRunner`` uses at inference."""
    arrays = dict(arrays)
    pixel_values = arrays.pop("pixel_values", None)
    mask = mx.ones(input_ids.shape, dtype=mx.int32)
    features = model.get_input_embeddings(input_ids, pixel_values, mask=mask, **arrays)
    extra = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    # language_model.model, not language_model: the vocabulary projection waits for the targets
    return model.language_model.model(input_ids, inputs_embeds=features.inputs_embeds, **arrays, **extra)


def loss_fn(model: nn.Module, batch: dict[str, Any]) -> mx.array:
    """Cross-entropy on answer tokens only, averaged per example, then over the batch."""
    hidden = forward_hidden(model, batch["input_ids"], batch["arrays"])
    states = hidden.reshape(-1, hidden.shape[-1])[batch["positions"]]
    logits = model.language_model.logits_from_hidden(states)
    return (nn.losses.cross_entropy(logits, batch["targets"]) * batch["weights"]).sum()


def to_device(batch: HostBatch) -> dict[str, Any]:
    return {
        "input_ids": mx.array(batch.input_ids),
        "arrays": {k: mx.array(v) for k, v in batch.arrays.items()},
        "positions": mx.array(batch.positions),
        "targets": mx.array(batch.targets),
        "weights": mx.array(batch.weights),
    }


def make_optimizer(config: TrainConfig) -> optim.Optimizer:
    """Adam with a 10-step warm-up and cosine decay; the vision tower on a scaled copy."""

    def schedule(scale: float) -> Any:
        peak = config.lr * scale
        warm = optim.linear_schedule(peak / config.warmup, peak, config.warmup)
        decay = optim.cosine_decay(peak, max(1, config.steps - config.warmup), peak * config.final_lr_fraction)
        return optim.join_schedules([warm, decay], [config.warmup])

    # bias correction: without it Adam's first steps move every weight ~3x the rate
    vision = optim.Adam(learning_rate=schedule(config.vision_lr_scale), bias_correction=True)
    rest = optim.Adam(learning_rate=schedule(1.0), bias_correction=True)
    return optim.MultiOptimizer([vision, rest], [lambda path, _: path.startswith("vision_tower.")])


@dataclass(slots=True)
class Trainer:
    """One training run: model, optimizer and data stream, stepped by ``run``."""

    config: TrainConfig
    recipe: Recipe
    model: nn.Module
    processor: Any
    optimizer: optim.Optimizer
    tokens_seen: int = 0

    @classmethod
    def create(cls, config: TrainConfig) -> Trainer:
        recipe = demo_recipe()
        model, processor = initial_model(recipe, config.seed)
        return cls(config, recipe, model, processor, make_optimizer(config))

    def step(self, batch: HostBatch) -> float:
        loss, grads = nn.value_and_grad(self.model, loss_fn)(self.model, to_device(batch))
        grads, _ = optim.clip_grad_norm(grads, self.config.clip_norm)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, self.model.parameters(), self.optimizer.state)
        self.tokens_seen += batch.num_tokens
        return float(loss.item())

    def warm_up_vision(self) -> tuple[list[float], float]:
        """The vision-only phase (see warmup.py), with its own progress bar."""
        from vlmserve.progress import progress
        from vlmserve.testing.demo.warmup import warm_up_vision

        config = self.config
        with progress(total=config.vision_warmup_steps, desc="vision warm-up", file=sys.stderr) as bar:

            def on_step(loss: float) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")

            return warm_up_vision(
                self.model, self.processor, self.recipe.dims, config.seed, config.vision_warmup_steps,
                config.vision_warmup_batch, config.vision_warmup_lr, on_step,
            )  # fmt: skip

    def run(self) -> list[float]:
        """All steps with a progress bar; returns the loss of every step."""
        from vlmserve.progress import progress

        stream = prefetch(batch_stream(self.processor, np.random.default_rng([self.config.seed, 1]), self.config.batch_size))
        losses: list[float] = []
        with progress(range(1, self.config.steps + 1), desc="training demo-gemma4", file=sys.stderr) as bar:
            for step in bar:
                losses.append(self.step(next(stream)))
                bar.set_postfix(loss=f"{_smooth(losses):.3f}", tok=self.tokens_seen)
                if self.config.check_every and (step % self.config.check_every == 0 or step == self.config.steps):
                    bar.write(f"step {step}: {self.check()}")
        return losses

    def check(self) -> str:
        """Greedy answers to a few fixed prompts, through the serving runner."""
        loaded = _as_loaded(self)
        rng = np.random.default_rng([self.config.seed, 2])
        lines = []
        for scene in (sample_scene(rng) for _ in range(3)):
            reply = generate_reply(loaded, [image_message(CAPTION_PROMPTS[0])], [render(scene)])
            lines.append(f"{'ok ' if reply.text == scene.caption else 'BAD'} {reply.text!r}")
        tool = generate_reply(loaded, [user(WEATHER_REQUESTS[0].format(city="Tokyo", unit="celsius"))], tools=[WEATHER_TOOL])
        lines.append(repr(tool.text))
        return "\n  ".join(["", *lines])


def _as_loaded(trainer: Trainer) -> Any:
    from vlmserve.engine.loader import LoadedModel
    from vlmserve.engine.models import adapter_for

    return LoadedModel(
        name="demo-gemma4 (training)", path=Path("."), model=trainer.model, processor=trainer.processor,
        model_type="gemma4", adapter=adapter_for(trainer.model, "gemma4"), eos_token_ids=frozenset(trainer.recipe.eos_ids),
        max_context=4096, load_seconds=0.0,
    )  # fmt: skip


def _smooth(losses: list[float], window: int = 20) -> float:
    return sum(losses[-window:]) / len(losses[-window:])


def train(config: TrainConfig, out: Path) -> dict[str, Any]:
    """Train, then write the model to ``out`` atomically; returns what the model card reports."""
    start = time.perf_counter()
    trainer = Trainer.create(config)
    vision_losses, vision_accuracy = trainer.warm_up_vision() if config.vision_warmup_steps else ([0.0], 0.0)
    losses = trainer.run()
    seconds = time.perf_counter() - start
    info = {
        "config": asdict(config),
        "dims": asdict(trainer.recipe.dims),
        "train_seconds": round(seconds, 1),
        "tokens_seen": trainer.tokens_seen,
        "final_loss": round(_smooth(losses, 50), 4),
        "vision_warmup_loss": [round(vision_losses[0], 4), round(_smooth(vision_losses, 20), 4)],
        "vision_warmup_cell_accuracy": round(vision_accuracy, 4),
        "first_loss": round(losses[0], 4),
        "mlx": mx.__version__,
        "blas": "OpenBLAS preloaded" if openblas_preloaded() else "the mlx wheel's own BLAS",
    }
    with _Staging(out) as tmp:
        info.update(save_model(trainer.recipe, trainer.processor, trainer.model, tmp))
        (tmp / TRAINING_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


class _Staging:
    """A temp directory next to ``out`` that replaces ``out`` whole when the block succeeds."""

    def __init__(self, out: Path) -> None:
        if out.exists() and any(out.iterdir()) and not (out / TRAINING_INFO).exists():
            raise FileExistsError(f"{out} is not empty and holds no demo model; not replacing it")
        self.out = out

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        self.tmp.chmod(0o755)
        return self.tmp

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            if self.out.exists():
                shutil.rmtree(self.out)
            self.tmp.rename(self.out)
        shutil.rmtree(self.tmp, ignore_errors=True)

