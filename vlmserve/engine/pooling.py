"""[worker] Pooling models (embeddings, rerank scores): which checkpoints are one, loading them with mlx-vlm's
own loaders, and the runner that pools many requests' sequences in one padded forward on the model's worker.

A pooling model has no scheduler and no KV cache: each sequence is one forward. Requests hand the runner one
``PoolJob`` per sequence (already tokenized on phase 1's pool); each step takes the oldest waiting jobs, up to a
row and padded-token budget, so sequences of requests that arrive together run together. Results go back through
each job's ``finish`` callback, on the worker.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from vlmserve.engine.loader import configure_process, weight_bytes

log = logging.getLogger(__name__)
KINDS = ("generate", "embed", "score")
TASKS = ("auto", "pooling", *KINDS)  # pooling: vLLM's --runner pooling (embed unless its files say score)
MAX_ROWS = 32  # sequences in one forward
MAX_PADDED_TOKENS = 16384  # rows x longest row in one forward: long inputs run in smaller batches
# vLLM's names for the kinds (--task embed|score|generate, and the older --task reward/classify spellings aside)
TASK_ALIASES = {"embedding": "embed", "rerank": "score", "reranker": "score"}


def kind_of(path: str | Path, task: str = "auto") -> str:
    """``generate``, ``embed`` or ``score`` for the checkpoint at ``path``: ``task`` where it says, else read from
    its files as mlx-vlm's loaders do (sentence-transformers' modules, a ``*_embedding`` model type, a sequence
    classifier; a Qwen3 yes/no reranker is a plain causal LM, so its folder name says ``reranker``, as on the Hub)."""
    task = TASK_ALIASES.get(task, task)
    if task == "pooling":
        found = kind_of(path)
        return found if found != "generate" else "embed"
    if task != "auto":
        return task
    folder = Path(path)
    config = _config(folder)
    if config is None:
        return "generate"
    model_type = str(config.get("model_type", "")).lower()
    if model_type.endswith("_embedding") or (folder / "modules.json").is_file() or \
            (folder / "1_Pooling" / "config.json").is_file():
        return "embed"
    architectures = [str(a) for a in config.get("architectures") or []]
    if any(a.endswith("ForSequenceClassification") for a in architectures) or "rerank" in folder.name.lower():
        return "score"
    return "generate"


def _config(folder: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


@dataclass(slots=True)
class PoolingModel:
    """A pooling model as the worker holds it; ``facts`` is what the loop may read."""

    model: Any
    processor: Any
    facts: PoolingFacts


@dataclass(slots=True, frozen=True)
class PoolingFacts:
    """What the loop reads of a pooling model (frozen: it crosses threads)."""

    kind: str  # embed | score
    model_type: str
    max_tokens: int  # tokens one sequence may hold
    vocab_size: int  # token ids past it would read past the embedding table (MLX does not check)
    weights_bytes: int
    dimensions: int = 0  # an embedding's length (embed)
    matryoshka: bool = False  # ``dimensions`` may truncate it (renormalized)
    sequence_classifier: bool = False  # score: sigmoid(logit) of a (query, document) pair, no template
    takes_images: bool = False


def load_pooling(path: str, kind: str, max_model_len: int | None) -> PoolingModel:
    """On the worker: the model by mlx-vlm's embedding or reranker loader, and its facts."""
    configure_process()
    from mlx_vlm.utils import load_processor

    folder = Path(path)
    config = _config(folder) or {}
    if kind == "embed":
        from mlx_vlm.embedding_loader import load_embedding_model
        from mlx_vlm.models.pooling import read_pooling_config

        model = load_embedding_model(folder)
        model.pooling_config = read_pooling_config(folder)  # type: ignore[no-untyped-call]  # mlx-vlm is untyped
        processor = load_processor(folder, add_detokenizer=False)
    else:
        _check_reranker(config)
        from mlx_vlm.reranker_loader import load_reranker

        model, processor = load_reranker(folder)
    facts = _facts(model, processor, config, kind, max_model_len)
    if kind == "embed":
        facts = _with_dimensions(PoolingModel(model, processor, facts), folder)
    return PoolingModel(model, processor, facts)


def _check_reranker(config: dict[str, Any]) -> None:
    """The rerankers served: sequence classifiers and Qwen3 (text) yes/no rerankers; ValueError for the rest."""
    from mlx_vlm.reranker import RerankerKind, reranker_kind

    kind = reranker_kind(config)  # ValueError naming an unknown type
    if kind == RerankerKind.GENERATIVE_VL:
        raise ValueError("Qwen3-VL rerankers (images in rerank) are not served here yet: Qwen3 text rerankers and "
                         "sequence classifiers are")


def _facts(model: Any, processor: Any, config: dict[str, Any], kind: str, max_model_len: int | None) -> PoolingFacts:
    text = config.get("text_config") or config
    limits = [text.get("max_position_embeddings") or 8192, getattr(tokenizer_of(processor), "model_max_length", 0)]
    limits += [max_model_len] if max_model_len else []
    max_tokens = min(int(v) for v in limits if isinstance(v, int) and 0 < v < 1_000_000)
    weights = weight_bytes(model.parameters())
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    images = kind == "embed" and getattr(processor, "image_processor", None) is not None
    vocab = int(text.get("vocab_size") or config.get("vocab_size") or len(tokenizer_of(processor)))
    return PoolingFacts(kind, str(config.get("model_type", "")), max_tokens, vocab, weights,
                        sequence_classifier=classifier, takes_images=images)


def _with_dimensions(loaded: PoolingModel, folder: Path) -> PoolingFacts:
    """An embedding's length, from one forward; Matryoshka truncation where the checkpoint says it was trained for
    it (sentence-transformers' ``config_sentence_transformers.json`` or the Qwen3 embedding families, whose cards
    list the shorter sizes)."""
    tokenizer = tokenizer_of(loaded.processor)
    ids = tokenizer("probe")["input_ids"]
    vectors = run_embed(loaded.model, [PoolJob(tuple(ids))])
    st_config = _config_file(folder / "config_sentence_transformers.json")
    matryoshka = bool(st_config.get("matryoshka_dims") or st_config.get("truncate_dim")) or \
        loaded.facts.model_type in ("qwen3", "qwen3_vl_embedding")
    from dataclasses import replace

    return replace(loaded.facts, dimensions=len(vectors[0]), matryoshka=matryoshka)


def _config_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


@dataclass(slots=True, frozen=True)
class PoolJob:
    """One sequence to pool: its token ids, and for an image its processor's arrays (numpy, from the pool).
    ``finish`` gets the embedding (or ``[score]``) or the error, on the worker."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None  # a sequence classifier's segment ids
    image: dict[str, np.ndarray] | None = None  # pixel_values, image_grid_thw
    finish: Callable[[list[float] | BaseException], None] = field(default=lambda _: None, compare=False)


class PoolingRunner:
    """The worker's stepper for a pooling model: a batch of waiting jobs per step."""

    def __init__(self, loaded: PoolingModel) -> None:
        self.loaded = loaded
        self.waiting: deque[PoolJob] = deque()
        self.batches = 0  # forwards run (for tests and logs)
        self.rows = 0  # sequences pooled

    def add(self, jobs: list[PoolJob]) -> None:
        """On the worker (a task): queue jobs; the next steps run them."""
        self.waiting.extend(jobs)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> None:
        batch = self._take()
        try:
            results = self._run(batch)
        except Exception as exc:  # noqa: BLE001 - a failed forward ends its jobs, the worker goes on
            log.exception("pooling forward failed")
            results = [exc] * len(batch)
        self.batches, self.rows = self.batches + 1, self.rows + len(batch)
        for job, result in zip(batch, results, strict=True):
            job.finish(result)

    def fail_all(self, message: str) -> None:
        while self.waiting:
            self.waiting.popleft().finish(RuntimeError(message))

    def _take(self) -> list[PoolJob]:
        """The oldest jobs that fit the budget (at least one); an image job runs alone (its grid is its own)."""
        first = self.waiting.popleft()
        batch, longest = [first], len(first.ids)
        while self.waiting and first.image is None and len(batch) < MAX_ROWS:
            nxt = self.waiting[0]
            longest = max(longest, len(nxt.ids))
            if nxt.image is not None or longest * (len(batch) + 1) > MAX_PADDED_TOKENS:
                break
            batch.append(self.waiting.popleft())
        return batch

    def _run(self, batch: list[PoolJob]) -> list[list[float] | BaseException]:
        facts = self.loaded.facts
        if facts.kind == "embed":
            return list(run_embed(self.loaded.model, batch))
        if facts.sequence_classifier:
            return [[s] for s in run_classifier(self.loaded.model, batch)]
        return [[s] for s in run_yes_no(self.loaded.model, tokenizer_of(self.loaded.processor), batch)]


def padded(rows: list[tuple[int, ...]], pad_id: int, left: bool) -> tuple[mx.array, mx.array]:
    """Token ids and attention mask, padded to the longest row."""
    width = max(len(r) for r in rows)
    ids = [[*([pad_id] * (width - len(r))), *r] if left else [*r, *([pad_id] * (width - len(r)))] for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r)) for r in rows]
    return mx.array(ids), mx.array(mask)


def run_embed(model: Any, batch: list[PoolJob]) -> list[list[float]]:
    """mlx-vlm's own forward (``model(input_ids, attention_mask=...).text_embeds``), right-padded so that each row
    keeps the positions it has alone; an image job with its pixel values."""
    _forget_positions(model)
    ids, mask = padded([job.ids for job in batch], 0, left=False)
    image = batch[0].image
    extra = {k: mx.array(v) for k, v in image.items()} if image is not None else {}
    out = model(input_ids=ids, attention_mask=mask, **extra)
    if getattr(out, "text_embeds", None) is None:
        raise ValueError(f"{type(model).__module__} gives no embeddings: not an embedding model")
    embeds = out.text_embeds.astype(mx.float32)
    mx.eval(embeds)
    return [list(map(float, row)) for row in np.array(embeds)]


def _forget_positions(model: Any) -> None:
    """Qwen3-VL embedders keep the last call's M-RoPE positions on the language model and reuse them for a text
    batch no longer than it (mlx-vlm resets them only for images): another batch's padding would leak in."""
    language = getattr(model, "language_model", None)
    if language is not None and hasattr(language, "_position_ids"):
        language._position_ids = None
        language._rope_deltas = None


def run_yes_no(model: Any, tokenizer: Any, batch: list[PoolJob]) -> list[float]:
    """A Qwen3 reranker's score, as mlx-vlm's ``_score_text_batch`` computes it after tokenizing: left-padded
    through the language model's layers, then sigmoid(logit_yes - logit_no) at the last token."""
    from mlx_vlm.server.reranking import _attention_mask, _binary_scores

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = padded([job.ids for job in batch], pad, left=True)
    inner = model.language_model.model
    hidden = inner.embed_tokens(ids)
    attention = _attention_mask(mask)  # type: ignore[no-untyped-call]  # mlx-vlm is untyped
    for layer in inner.layers:
        hidden = layer(hidden, attention, None)
    scores = _binary_scores(model, inner.norm(hidden), mask, tokenizer)  # type: ignore[no-untyped-call]
    return [float(s) for s in scores]


def run_classifier(model: Any, batch: list[PoolJob]) -> list[float]:
    """A sequence classifier's sigmoid(logit) for each (query, document) pair, right-padded."""
    ids, mask = padded([job.ids for job in batch], 0, left=False)
    types, _ = padded([job.type_ids or (0,) * len(job.ids) for job in batch], 0, left=False)
    out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    logits = getattr(out, "logits", out).reshape(len(batch), -1)[:, 0]
    scores = mx.sigmoid(logits.astype(mx.float32))
    mx.eval(scores)
    return [float(s) for s in np.array(scores)]

