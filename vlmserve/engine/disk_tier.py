"""[worker] The prefix stores' disk tier: what they evict (and hold at shutdown) goes to disk, and comes back.

The worker turns a stored prefix's cache into host arrays (its layers' ``state`` and ``meta_state``,
the arrays copied to numpy: a memory copy) and hands them to ``DiskStore``, whose own thread writes
the file; nothing here waits for a disk write. A prompt whose memory stores hold less than a file
does reads it back on the worker, when reading is cheaper than prefilling what it adds: reads are
timed per byte, prefill per token (engine/costs.py). A file is restored into a fresh cache of the
model (``adapter.make_cache``), layer by layer, so every attribute a cache class sets in its
constructor is there; a layer of another kind than the model's makes the file foreign.

Files are keyed by the model's identity (its config and weights' fingerprint, the serving dtype,
the KV quantization, the vlmserve version) and the prefix's tokens, with each store's own marker
first: the text store's keys and the image-keyed store's (tokens with image content hashes) never meet.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from vlmserve import __version__
from vlmserve.engine.disk_store import DiskStore, DiskStoreStats
from vlmserve.engine.kv_quant import PackedKVCache

log = logging.getLogger(__name__)

TEXT, IMAGES = -1, -2  # each store's marker, the first "token" of its keys on disk
_BANDWIDTH = 200e6  # bytes a second assumed for reads until one is timed (a slow laptop disk)
_AHEAD = 4  # files read ahead and held until their prompts are admitted, at most
_Read = tuple[list[int], dict[str, Any], list[np.ndarray]]


class DiskTier:
    """One model's disk tier: ``spill`` on eviction, ``lookup`` when the memory stores fall short."""

    def __init__(self, store: DiskStore, make_cache: Callable[[], list[Any]],
                 prefill_s: Callable[[], float]) -> None:
        self.store = store
        self.make_cache = make_cache
        self.prefill_s = prefill_s  # a prompt token's measured prefill seconds (0: not measured yet)
        self.skipped = 0  # files found but not read: prefilling their tokens was cheaper
        self.trims = bool(can_trim_prompt_cache(make_cache()))  # may a longer file be cut back to a prompt?
        # Files being read ahead for prompts that arrived (``prefetch``), by entry, oldest first
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-disk-read")
        self._ahead: OrderedDict[str, Future[_Read | None]] = OrderedDict()

    def spill(self, store: int, tokens: Sequence[int], cache: list[Any]) -> None:
        """Queue a stored prefix's cache for a file (the store's ``store`` marker, its key ``tokens``)."""
        meta, arrays = to_host(cache)
        self.store.put([store, *tokens], meta, arrays)

    def prefetch(self, store: int, tokens: list[int]) -> None:
        """A prompt arrived: read the file ``lookup`` would read for it on a thread of its own, so that by
        its admission the worker only turns the arrays into a cache (the worker never reads the disk
        itself but for a prompt admitted as it arrives, which waits for its read)."""
        plan = self._plan(store, tokens, 0, count=False)
        if plan is not None and plan[0] not in self._ahead:
            self._ahead[plan[0]] = self._reader.submit(self.store.read, plan[0])
            while len(self._ahead) > _AHEAD:  # a prompt that was aborted, or served from memory after all
                self._ahead.popitem(last=False)

    def lookup(self, store: int, tokens: list[int], beyond: int) -> tuple[list[Any], int] | None:
        """A cache for more of ``tokens`` than ``beyond`` (what memory had), with one token left to compute,
        read back from a file where that is faster than prefilling the difference; else None."""
        skipped = self.skipped
        plan = self._plan(store, tokens, beyond, count=True)
        got = self._restore(*plan) if plan is not None else None
        if got is None and self.skipped == skipped:  # a file not worth reading is no miss
            self.store.miss()
        return got

    def _plan(self, store: int, tokens: list[int], beyond: int, count: bool) -> tuple[str, int] | None:
        """The file worth reading for ``tokens`` past ``beyond``, and how many positions it gives."""
        found = self.store.find([store, *tokens], longer_ok=self.trims)
        if found is None:
            return None
        length, entry = found
        usable = min(length - 1, len(tokens) - 1)  # the marker is not a position; one token stays to compute
        if usable <= beyond or (usable < length - 1 and not self.trims):
            return None
        if not self._worth_reading(self.store.entry_bytes(entry), usable - beyond):
            self.skipped += count
            return None
        return entry, usable

    def _restore(self, entry: str, usable: int) -> tuple[list[Any], int] | None:
        ahead = self._ahead.pop(entry, None)
        read = ahead.result() if ahead is not None else self.store.read(entry)
        if read is None:
            return None
        file_tokens, meta, arrays = read
        try:
            cache = from_host(meta, arrays, self.make_cache())
        except (KeyError, TypeError, ValueError) as exc:  # a layout this model does not have: never served
            log.warning("prefix cache file for %d tokens does not fit this model (%s); ignored", len(file_tokens), exc)
            return None
        cut = len(file_tokens) - 1 - usable
        if cut and not (can_trim_prompt_cache(cache) and cast(int, trim_prompt_cache(cache, cut)) == cut):
            return None
        return cache, usable

    def _worth_reading(self, n_bytes: int, tokens: int) -> bool:
        stats = self.store.stats()
        bandwidth = stats.read_bytes / stats.read_seconds if stats.read_seconds > 0 else _BANDWIDTH
        per_token = self.prefill_s()  # 0 until measured: the warm-up's prompts never read the disk
        return per_token > 0 and n_bytes / bandwidth < tokens * per_token

    def stats(self) -> DiskStoreStats:
        return self.store.stats()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.store.close()


def model_folder(root: str, name: str) -> Path:
    """Where one model's files go under ``--prefix-cache-dir``: a folder per model, so the models of one
    server each lock their own (a second server on the same model and directory is refused)."""
    return Path(root) / (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model")


def identity(path: Path, model_type: str, model: Any, kv: str, drafter: str | None = None) -> dict[str, str]:
    """What must match for a file to be served: the model's config, its weights (each file's name, size
    and first MiB: the header with every tensor's shape, dtype and offset, and the first values), the
    dtypes it is served in, the KV quantization and this vlmserve; and where every entry ends with a
    drafter's state (engine/mtp_prefix.py), that drafter's files the same way (or its Hub id)."""
    leaves = cast(list[tuple[str, Any]], tree_flatten(model.language_model.parameters()))
    dtypes = sorted({str(leaf.dtype) for _, leaf in leaves})
    found = {"model_type": model_type, "config": _config(path), "weights": _weights(path),
             "dtype": ",".join(dtypes), "kv": kv, "vlmserve": __version__}
    if drafter is not None:  # another drafter's state has other shapes, or other values
        found["drafter"] = f"{_config(Path(drafter))}:{_weights(Path(drafter))}" if Path(drafter).is_dir() else drafter
    return found


def _config(path: Path) -> str:
    config = path / "config.json"
    return hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else ""


def _weights(path: Path) -> str:
    weights = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            weights.update(file.name.encode() + file.stat().st_size.to_bytes(8, "little") + f.read(1 << 20))
    return weights.hexdigest()


def to_host(cache: list[Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A cache as JSON-able layout and numpy arrays (bfloat16, which numpy lacks, as its bits)."""
    arrays: list[np.ndarray] = []
    layers = []
    for layer in cache:
        meta = getattr(layer, "meta_state", None)
        layers.append({"class": type(layer).__name__, "state": _flatten(layer.state, arrays),
                       "meta": list(meta) if meta else None})
    return {"layers": layers}, arrays


def from_host(meta: dict[str, Any], arrays: list[np.ndarray], fresh: list[Any]) -> list[Any]:
    """``to_host``'s output back into ``fresh`` (a new cache of the model), layer by layer."""
    layers = meta["layers"]
    if len(layers) != len(fresh):
        raise ValueError(f"{len(layers)} layers, the model has {len(fresh)}")
    for i, saved in enumerate(layers):
        layer = fresh[i]
        if saved["class"] == PackedKVCache.__name__ and type(layer).__name__ == "KVCache":
            layer = fresh[i] = PackedKVCache()  # packed in the file: its group size and bits come with it
        if saved["class"] != type(layer).__name__:
            raise ValueError(f"layer {i} is a {saved['class']}, the model's a {type(layer).__name__}")
        layer.state = _unflatten(saved["state"], arrays)
        if saved["meta"] is not None:
            layer.meta_state = tuple(saved["meta"])
    return fresh


def _flatten(value: Any, arrays: list[np.ndarray]) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return {"seq": [_flatten(v, arrays) for v in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, mx.array):
        bf16 = value.dtype == mx.bfloat16
        arrays.append(np.array(value.view(mx.uint16) if bf16 else value))
        return {"array": len(arrays) - 1, "bf16": bf16}
    raise TypeError(f"a cache state holds a {type(value).__name__}")


def _unflatten(node: Any, arrays: list[np.ndarray]) -> Any:
    if node is None:
        return None
    if "seq" in node:
        items = [_unflatten(n, arrays) for n in node["seq"]]
        return tuple(items) if node["tuple"] else items
    array = mx.array(arrays[int(node["array"])])
    return array.view(mx.bfloat16) if node["bf16"] else array
