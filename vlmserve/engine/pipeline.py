"""[worker] One model's language model split across ranks (pipeline parallel, ``mx.distributed``).

``mlx.launch --backend ring -n 2 -- vlmserve serve --model X`` runs one process per rank. Each rank
holds a contiguous slice of the decoder layers: the last rank the first layers, rank 0 the last ones
with the head (mlx-lm's ``pipeline()`` layout: the hidden state flows rank N-1 -> ... -> 0 and never
hops back). Rank 0 also holds the vision tower and runs the HTTP server, phase 1 and the scheduler;
every step's plan goes from it to every rank (pipeline_runner.py), and each rank runs the same
runner code on it, on its own MLX worker thread.

How a rank runs only its slice: mlx-vlm's own forward runs unchanged on every rank, so masks, M-RoPE
positions, per-layer inputs and shared KV are what a single process computes. A layer held elsewhere
is a stand-in (``_Elsewhere``) that passes the hidden state through and moves its cache on by the
positions it would have written without storing any (zero-width keys and values), so offsets, left
padding and masks stay exact. The slice's first layer takes its input from the rank before it
(``recv``); the first layer after the slice sends the state the model's loop hands it to the next
(``send``), so what the loop adds between layers travels too. Both are evaluated as the forward is
built, so every rank's hops happen in one order whatever MLX's graph order.

The weights load lazily (``mlx_vlm.load(lazy=True)``) and only the slice's (and on rank 0 the
vision tower's, embeddings' and head's) are materialized: layers held elsewhere are dropped unread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from vlmserve import __version__
from vlmserve.engine import doorbell
from vlmserve.engine.loader import (
    LoadedModel,
    ModelLoadError,
    check_local_path,
    finish_loading,
    load_error,
    usable_memory,
    weight_bytes,
)
from vlmserve.engine.models import ModelAdapter

log = logging.getLogger(__name__)


class PipelineError(ModelLoadError):
    """The model cannot be split across the ranks as asked."""


def group() -> mx.distributed.Group:
    """The launch's process group (MLX's global one: the same group on every thread)."""
    return mx.distributed.init(strict=True)


@dataclass(frozen=True, slots=True)
class Stage:
    """This rank's slice of the decoder layers, ``[first, last)`` of ``num_layers``, and its doorbell."""

    rank: int
    size: int
    first: int
    last: int
    num_layers: int
    bell: doorbell.Doorbell = field(default_factory=lambda: doorbell.Doorbell({}), compare=False, repr=False)

    @property
    def upstream(self) -> int | None:
        """The rank whose output the slice's first layer takes (None: this rank embeds)."""
        return self.rank + 1 if self.first > 0 else None

    @property
    def downstream(self) -> int | None:
        """The rank the slice's output goes to (None: this rank runs the head, rank 0)."""
        return self.rank - 1 if self.rank > 0 else None

    @property
    def peers(self) -> str:
        """The rank(s) rank 0 waits on, for errors: the hidden state comes to it through rank 1."""
        return "rank 1" if self.size == 2 else f"rank 1 or a rank after it (of {self.size})"

    def describe(self) -> str:
        return f"rank {self.rank}/{self.size}: layers {self.first}-{self.last - 1} of {self.num_layers}"


def split_layers(layer_bytes: Sequence[int], budgets: Sequence[float],
                 starts: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Each rank's contiguous slice ``(first, last)`` of the layers (``layer_bytes``: each one's
    weights), its share of their bytes following its ``budgets`` (the memory it has for layers): the
    last rank takes the first layers, rank 0 the last ones. A slice may start only at ``starts``
    (None: anywhere), so that a layer that reads another's KV within the forward (Gemma 4's shared
    KV) stays with what it reads."""
    size, num_layers = len(budgets), len(layer_bytes)
    if size > num_layers:
        raise PipelineError(f"{size} ranks for {num_layers} decoder layers: at most one rank per layer")
    floor = max(max(budgets), 1) * 1e-6  # a rank with no memory left for layers still takes one
    weights = [max(float(b), floor) for b in budgets]
    total, layers_total = sum(weights), float(sum(layer_bytes)) or 1.0
    ends = [sum(layer_bytes[: i + 1]) / layers_total for i in range(num_layers)]  # share held through layer i
    order = list(reversed(range(size)))  # ranks in layer order
    bounds, acc = [0], 0.0
    for rank in order[:-1]:
        acc += weights[rank] / total
        allowed = [s for s in (starts if starts is not None else range(num_layers)) if bounds[-1] < s < num_layers]
        allowed = [s for s in allowed if s <= num_layers - (size - len(bounds))]  # a layer for every rank after
        if not allowed:
            raise PipelineError(f"the model cannot be split {size} ways: a slice may start only at layers "
                                f"{list(starts or ())} (shared KV)")
        bounds.append(min(allowed, key=lambda s: (abs(ends[s - 1] - acc), s)))
    bounds.append(num_layers)
    slices = [(0, 0)] * size
    for i, rank in enumerate(order):
        slices[rank] = (bounds[i], bounds[i + 1])
    return slices


# -- the slice in the model's own forward ------------------------------------------------


def _advance(cache: Any, h: mx.array) -> None:
    """Move a cache held elsewhere on by ``h``'s positions, storing nothing (zero-width keys and values).
    Recurrent state (``ArraysCache``: Qwen3.5's linear attention) has no positions: it stays empty."""
    if hasattr(cache, "update_and_fetch"):
        empty = mx.zeros((h.shape[0], 1, h.shape[1], 0), dtype=h.dtype)
        cache.update_and_fetch(empty, empty)


class _ReadsThrough(nn.Module):  # type: ignore[misc]  # mlx.nn has no type information
    """Stands in for a decoder layer: what the model's loop reads of a layer and the stand-in lacks
    (``layer_type``, Qwen's rotary embedding on layer 0) comes from the real one, ``_real()``."""

    def _real(self) -> Any:
        return None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = None if name.startswith("__") or name == "layer" else self._real()
            if real is None:
                raise
            return getattr(real, name)


class _Elsewhere(_ReadsThrough):
    """A decoder layer another rank holds: the hidden state passes through, its cache moves on. The
    first one after this rank's slice sends the state it gets on to ``send_to`` first: the state as
    the model's loop hands it to that layer, after whatever the loop adds between layers (Qwen3-VL's
    DeepStack features, Gemma 4's cut to the last positions). The real layer is kept outside the module
    tree: its weights are never read."""

    def __init__(self, layer: nn.Module, returns_tuple: bool, send_to: int | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_held_elsewhere", layer)  # not a child: parameters() never walks it
        self._returns_tuple = returns_tuple
        self._send_to = send_to

    def _real(self) -> Any:
        return self.__dict__.get("_held_elsewhere")

    def __call__(self, h: mx.array, mask: Any = None, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self._send_to is not None:
            mx.eval(mx.distributed.send(h, self._send_to))
        offset = kwargs.get("offset")  # Gemma 4: the position the layer's keys start at, as its attention returns it
        if cache is not None:
            offset = getattr(cache, "offset", offset)
            _advance(cache, h)
        return (h, None, offset) if self._returns_tuple else h


class _Receives(_ReadsThrough):
    """This rank's first layer, where the slice does not start at layer 0: its input is the state the
    rank before sent (see ``_Elsewhere``), received as the forward is built."""

    def __init__(self, layer: nn.Module, recv_from: int) -> None:
        super().__init__()
        self.layer = layer
        self._recv_from = recv_from

    def _real(self) -> Any:
        return self["layer"] if "layer" in self else None

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> Any:
        h = mx.distributed.recv_like(h, self._recv_from)
        mx.eval(h)
        return self.layer(h, *args, **kwargs)


def text_model(adapter: ModelAdapter) -> Any:
    """The language model's decoder, whose ``layers`` a stage splits (where is the adapter's fact)."""
    inner = adapter.decoder
    if inner is None:
        raise PipelineError(f"{type(adapter.model).__name__}: no decoder layer list to split")
    return inner


def splittable(adapter: ModelAdapter) -> str | None:
    """Why this family's language model cannot be split (None: it can). A layer held elsewhere must
    move its cache on without storing it: KV caches and recurrent state (``ArraysCache``) can."""
    from mlx_lm.models.cache import ArraysCache as LMArrays
    from mlx_vlm.models.cache import ArraysCache as VLMArrays

    for cache in adapter.make_cache():
        kv = hasattr(cache, "update_and_fetch") and hasattr(cache, "offset")
        if cache is not None and not kv and not isinstance(cache, (LMArrays, VLMArrays)):
            return f"its layers keep {type(cache).__name__} state, which a rank without the layer cannot follow"
    return None


def install(adapter: ModelAdapter, stage: Stage) -> None:
    """Put the stand-ins and the receiving layer in the decoder's layer list; the layers held
    elsewhere drop out of the model's tree, so their weights are never read."""
    inner = text_model(adapter)
    layers = list(inner.layers)
    returns_tuple = adapter.layer_returns_tuple
    for i, layer in enumerate(layers):
        if stage.first <= i < stage.last:
            if i == stage.first and stage.upstream is not None:
                layers[i] = _Receives(layer, stage.upstream)
        else:
            send_to = stage.downstream if i == stage.last else None
            layers[i] = _Elsewhere(layer, returns_tuple, send_to)
    inner.layers = layers


class _Follower:
    """A rank other than 0 runs mlx-vlm's forward for its slice's sake only: the logits it hands the
    runner are zeros of the head's batch and positions, so the head (and the layers after the slice)
    never run and their weights are never read."""

    def __init__(self, language_model: Any) -> None:
        self.__dict__["language_model"] = language_model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["language_model"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.__dict__["language_model"](*args, **kwargs)
        out.logits = mx.zeros((*out.logits.shape[:2], 1), dtype=mx.float32)
        return out


# -- loading ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What each rank tells the others at start-up."""

    identity: str  # the model's config, weights index and vlmserve's and MLX's versions, hashed
    free_bytes: int


def model_identity(path: Path, dtype: str) -> str:
    """A hash of what must agree on every rank: config.json, the weights' files, the serving dtype
    (``auto`` follows the BLAS), vlmserve's and MLX's versions."""
    from vlmserve.blas import openblas_preloaded

    digest = hashlib.sha256()
    digest.update(f"vlmserve {__version__} mlx {version('mlx')} {dtype} {openblas_preloaded()}\n".encode())
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        digest.update(f"{weights.name} {weights.stat().st_size}\n".encode())
    return digest.hexdigest()[:32]


def free_memory() -> int:
    """What this rank can give weights and KV (``VLMSERVE_PIPELINE_MEMORY_GB`` overrides it, to weigh
    ranks by hand)."""
    forced = os.environ.get("VLMSERVE_PIPELINE_MEMORY_GB")
    return int(float(forced) * 2**30) if forced else usable_memory()


def exchange(info: RankInfo) -> list[RankInfo]:
    """Every rank's ``RankInfo``, in rank order (an ``all_gather`` of fixed-size records)."""
    record = info.identity.encode().ljust(32)[:32] + info.free_bytes.to_bytes(8, "little")
    gathered = mx.distributed.all_gather(mx.array(list(record), dtype=mx.uint8)[None])
    rows = [bytes(row) for row in np.array(gathered, dtype=np.uint8)]
    return [RankInfo(row[:32].decode().strip(), int.from_bytes(row[32:], "little")) for row in rows]


def load_stage(path_or_id: str, name: str | None, dtype: str, trust_remote_code: bool = False) -> tuple[LoadedModel, Stage]:
    """Load this rank's slice of the model (on its worker thread): agree with every rank on the model,
    split the layers by their free memory, materialize only this rank's weights."""
    from mlx_vlm.utils import get_model_path, load

    start = time.perf_counter()
    check_local_path(path_or_id)
    world = group()
    rank, size = world.rank(), world.size()
    try:
        path = Path(get_model_path(path_or_id))
        infos = exchange(RankInfo(model_identity(path, dtype), free_memory()))
    except Exception as exc:  # noqa: BLE001 - one clear line
        raise ModelLoadError(f"rank {rank}: cannot load model {path_or_id!r}: {exc}") from exc
    differ = [r for r, info in enumerate(infos) if info.identity != infos[0].identity]
    if differ:
        raise ModelLoadError(f"ranks disagree about the model or vlmserve/MLX version: rank(s) {differ} differ from "
                             f"rank 0 on {path_or_id!r} (same model files and versions on every rank)")
    bell = doorbell.connect(rank, size)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="At least one mel filter")
            extra: dict[str, Any] = {"trust_remote_code": True} if trust_remote_code else {}
            model, processor = load(path_or_id, lazy=True, **extra)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one clear error
        raise load_error(path_or_id, exc) from exc
    loaded = finish_loading(model, processor, path_or_id, name, dtype, start, materialize=False)
    adapter = loaded.adapter
    why = splittable(adapter)
    if why is not None:
        raise ModelLoadError(f"model {path_or_id!r} ({loaded.model_type}) cannot be split across ranks: {why}")
    first, last, num_layers, whole = _my_layers(loaded, infos, rank)
    stage = Stage(rank, size, first, last, num_layers, bell)
    install(adapter, stage)
    if rank > 0:
        adapter.language_model = _Follower(adapter.language_model)
    own = _own_weights(loaded.model, adapter, rank)
    mx.eval(own)
    loaded.load_seconds = time.perf_counter() - start
    log.info("pipeline %s (%s), weights %.1f MiB on this rank (the whole model: %.1f MiB), loaded in %.2f s",
             stage.describe(), loaded.model_type, weight_bytes(own) / 2**20, whole / 2**20, loaded.load_seconds)
    return loaded, stage


def _my_layers(loaded: LoadedModel, infos: list[RankInfo], rank: int) -> tuple[int, int, int, int]:
    """This rank's layers ``[first, last)`` of the text model's, their count and the whole model's bytes: the
    layers split by each rank's free memory less what it holds besides its layers."""
    adapter = loaded.adapter
    inner = text_model(adapter)
    layer_bytes = [weight_bytes(layer.parameters()) for layer in inner.layers]  # shapes only: nothing is read
    whole = weight_bytes(loaded.model.parameters())
    # What each rank holds besides its layers: rank 0 the vision tower, embeddings and head; the rank
    # with the first layers the token embeddings it embeds each step's tokens with
    embeddings = [getattr(inner, name, None) for name in ("embed_tokens", "embed_tokens_per_layer")]
    held = [0] * len(infos)
    held[0] = whole - sum(layer_bytes)
    held[-1] += sum(weight_bytes(e.parameters()) for e in embeddings if e is not None)
    budgets = [info.free_bytes - held[r] for r, info in enumerate(infos)]
    first, last = split_layers(layer_bytes, budgets, adapter.layer_starts())[rank]
    return first, last, len(layer_bytes), whole


def _own_weights(model: nn.Module, adapter: ModelAdapter, rank: int) -> list[mx.array]:
    """The weights this rank reads: its layers' (the dropped ones are gone from the model), and on rank
    0 everything else too (vision tower, projector, embeddings, head). Another rank's other weights
    (the embeddings on the rank holding the first layers) load when first used."""
    layers = text_model(adapter).layers
    owners = [model] if rank == 0 else [m for m in layers if not isinstance(m, _Elsewhere)]
    return [cast(mx.array, pair[1]) for owner in owners for pair in tree_flatten(owner.parameters())]
