"""[worker] Loading a model with mlx-vlm on the worker thread, plus what the engine needs to know about it."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from vlmserve.engine.draft_model import DraftModel, DraftModelError
from vlmserve.engine.drafter import AnyDrafter, Drafter, DrafterError
from vlmserve.engine.engine_config import DEFAULT_DTYPE, DTYPES
from vlmserve.engine.models import ModelAdapter, UnsupportedModelError, adapter_for
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.preprocess.prompt import templater_of

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model could not be loaded: a bad path, a bad config or corrupt weights."""


@dataclass(slots=True)
class LoadedModel:
    """A model and its processor, created on (and owned by) one worker thread."""

    name: str
    path: Path
    model: nn.Module
    processor: Any
    model_type: str
    adapter: ModelAdapter
    eos_token_ids: frozenset[int]
    max_context: int
    load_seconds: float
    drafter: AnyDrafter | None = None  # speculative decoding's drafter model (engine/drafter.py), loaded beside it
    weights_bytes: int = 0  # its weights' bytes as served (after any cast)

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)


def load_model(path_or_id: str, name: str | None = None, dtype: str = DEFAULT_DTYPE,
               trust_remote_code: bool = False) -> LoadedModel:
    """Load with ``mlx_vlm.load`` and materialize every weight on the calling thread.

    Must run on the worker: the weights become arrays of this thread's stream. ``dtype``: the
    float weights as stored (``model``), cast to one type, or ``auto`` (see ``serving_dtype``).
    ``trust_remote_code`` goes to mlx-vlm, and through it to transformers' processor loading.
    """
    from mlx_vlm.utils import load  # heavy import; keep it off module import

    start = time.perf_counter()
    check_local_path(path_or_id)
    try:
        with warnings.catch_warnings():
            # Gemma 4's processor builds an audio front end we never use; its mel warning is noise.
            warnings.filterwarnings("ignore", message="At least one mel filter")
            extra: dict[str, Any] = {"trust_remote_code": True} if trust_remote_code else {}
            model, processor = load(path_or_id, **extra)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one clear error
        raise load_error(path_or_id, exc) from exc
    return finish_loading(model, processor, path_or_id, name, dtype, start)


def settle_random_key() -> None:
    """Evaluate MLX's global random key. Building a module draws its initial weights lazily (every
    ``nn.Linear`` calls ``mx.random.uniform``), and each draw splits the key into a graph node that holds
    the one before. Nothing evaluates the key, so the chain grows with every model built: ~130 KiB of
    host memory a load, and a ``--model-dir`` server swapping models grew 16-20 MiB a minute. Evaluated,
    the chain is dropped."""
    mx.eval(mx.random.state)


def load_error(path_or_id: str, exc: Exception) -> ModelLoadError:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")  # not a page of hints
    return ModelLoadError(f"cannot load model {path_or_id!r}: {type(exc).__name__}: {first}")


def finish_loading(model: nn.Module, processor: Any, path_or_id: str, name: str | None, dtype: str, start: float,
                   materialize: bool = True) -> LoadedModel:
    """What the engine needs of a model mlx-vlm loaded: its serving dtype, its adapter, EOS ids and
    context; every weight materialized unless ``materialize`` is off (a pipeline rank reads a slice)."""
    try:
        _cast_floats(model, serving_dtype(dtype, model))
        if materialize:
            mx.eval(model.parameters())
    except Exception as exc:  # noqa: BLE001 - corrupt weights surface here
        raise load_error(path_or_id, exc) from exc
    config = model.config
    model_type = str(getattr(config, "model_type", "unknown"))
    try:
        adapter = adapter_for(model, model_type)
    except UnsupportedModelError as exc:
        raise ModelLoadError(f"cannot load model {path_or_id!r}: {exc}") from exc
    adapter.span_token_ids = _span_token_ids(processor)
    loaded = LoadedModel(
        name=name or path_or_id,
        path=Path(path_or_id),
        model=model,
        processor=processor,
        model_type=model_type,
        adapter=adapter,
        eos_token_ids=_eos_token_ids(config, processor),
        max_context=_max_context(config),
        load_seconds=time.perf_counter() - start,
        weights_bytes=weight_bytes(model.parameters()),
    )
    if materialize:
        log.info("loaded %s (%s) in %.2f s, weights %.1f MiB", loaded.name, loaded.model_type, loaded.load_seconds,
                 loaded.weights_bytes / 2**20)
    return loaded


def weight_bytes(parameters: Any) -> int:
    """The bytes of a module's ``parameters()`` tree (or a list of arrays)."""
    return sum(int(cast(mx.array, pair[1]).nbytes) for pair in tree_flatten(parameters))


def serving_dtype(requested: str, model: nn.Module) -> mx.Dtype | None:
    """The dtype to serve float weights in; None keeps what the checkpoint stores.

    ``auto`` picks float32 on a Linux CPU with OpenBLAS preloaded: there float32 matmuls ran
    ~30x faster than bfloat16 ones, which MLX runs with its own kernels (140 vs 4.6 GFLOP/s on
    our 2-core machine; a gemma4 prefill 7x faster). Elsewhere (Metal, or the wheel's reference
    BLAS) half-precision weights are as fast or faster, and take half the memory. Quantized
    models keep their dtype: their scales and biases belong to the quantization.
    """
    from vlmserve.blas import openblas_preloaded

    assert requested in DTYPES, requested
    if requested == "model" or any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
        return None
    if requested == "auto":
        return mx.float32 if not mx.metal.is_available() and openblas_preloaded() else None
    dtype: mx.Dtype = getattr(mx, requested)
    return dtype


def _cast_floats(model: nn.Module, dtype: mx.Dtype | None) -> None:
    if dtype is None:
        return
    model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    log.info("serving float weights as %s", dtype)


def check_local_path(path_or_id: str) -> None:
    # A path-looking argument that does not exist would otherwise be sent to the Hub.
    looks_local = path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") > 1
    path = Path(path_or_id).expanduser()
    if looks_local and not path.exists():
        raise ModelLoadError(f"cannot load model {path_or_id!r}: no such directory")
    if path.exists() and not (path / "config.json").is_file():
        raise ModelLoadError(f"cannot load model {path_or_id!r}: no config.json in {path}")
    if path.is_dir() and not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"cannot load model {path_or_id!r}: no *.safetensors weights in {path} "
                             "(python -m mlx_vlm.convert makes them from a Hugging Face checkpoint)")


def _eos_token_ids(config: Any, processor: Any) -> frozenset[int]:
    """EOS from the model config, the generation config and the tokenizer's end of turn."""
    ids: set[int] = set()
    for source in (
        getattr(config, "eos_token_id", None),
        getattr(getattr(config, "text_config", None), "eos_token_id", None),
    ):
        ids.update([source] if isinstance(source, int) else list(source or []))
    tokenizer = getattr(processor, "tokenizer", processor)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    turn_end = _template_end_of_turn(processor, tokenizer)
    if turn_end is not None:
        ids.add(turn_end)
    return frozenset(i for i in ids if isinstance(i, int) and i >= 0)


def _template_end_of_turn(processor: Any, tokenizer: Any) -> int | None:
    """The special token the chat template puts right after an assistant message."""
    marker = "vlmserve-probe"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    templater = templater_of(processor)  # the checkpoint's template, as phase 1 renders with
    try:
        text = templater.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        after = text[text.index(marker) + len(marker):]
        first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    except Exception:  # noqa: BLE001 - no template, or one that refuses this conversation
        return None
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return first[0] if first and first[0] in special else None


def _max_context(config: Any) -> int:
    text = getattr(config, "text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        value = getattr(text, key, None) or getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 8192


_process_configured = False
_process_lock = threading.Lock()


_TILE_MARKER = re.compile(r"^<\|img_row_\d+_col_\d+\|>$")  # LFM2-VL's tile positions


def _span_token_ids(processor: Any) -> frozenset[int]:
    """Tokens inside an image's placeholder span besides the image token, which the processors name:
    Pixtral's and Mistral 3's row breaks and span end (``[IMG_BREAK]``, ``[IMG_END]``); LFM2-VL's span
    start and end, thumbnail and tile markers (``<|img_row_1_col_2|>``...)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    names = [getattr(processor, name, None) for name in
             ("image_break_token", "image_end_token", "image_start_token", "image_thumbnail_token")]
    if isinstance(getattr(processor, "image_thumbnail_token", None), str):  # LFM2-VL's layout: its tile markers
        names += [t for t in tokenizer.get_vocab() if _TILE_MARKER.match(t)]
    ids = set()
    for token in names:
        token_id = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None):
            ids.add(token_id)
    return frozenset(ids)


def usable_memory() -> int:
    """What MLX may use here for weights and KV: on Metal 80% of the recommended working set, else
    half the physical memory."""
    if mx.metal.is_available():
        return int(0.8 * int(mx.device_info()["max_recommended_working_set_size"]))
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def default_kv_budget() -> int:
    """The KV budget when none is configured: ``usable_memory`` less what is allocated already (the
    weights); at least 256 MiB."""
    return max(256 << 20, usable_memory() - mx.get_active_memory())


def configure_process() -> None:
    """Process-global MLX settings, applied once however many engines start at the same time."""
    global _process_configured
    with _process_lock:
        if _process_configured:
            return
        _process_configured = True
        if mx.metal.is_available():
            # Keep weights wired on Apple Silicon, as mlx-lm's server does.
            mx.set_wired_limit(int(mx.device_info()["max_recommended_working_set_size"]))


def load_drafter(spec: SpeculativeConfig, loaded: LoadedModel, pipeline: bool) -> AnyDrafter:
    """``spec``'s drafter model for ``loaded``, on the worker; ModelLoadError (the server exits, one line)
    where it cannot serve it."""
    if pipeline:
        raise ModelLoadError(f"{loaded.name}: a drafter model does not run across pipeline ranks (yet); "
                             "drop --speculative-config's drafter or serve on one machine")
    if not loaded.adapter.verifies_drafts:
        raise ModelLoadError(f"{loaded.name}: {loaded.model_type} does not verify drafts, so a drafter cannot serve it")
    try:
        if spec.method == "draft_model" and spec.model is not None:
            return DraftModel.load(spec.model, loaded.model, loaded.tokenizer, loaded.name)
        return Drafter.load(spec.model or str(loaded.path), loaded.model, loaded.model_type, loaded.name,
                            loaded.adapter, own=spec.model is None, kind=spec.method)
    except (DrafterError, DraftModelError) as exc:
        raise ModelLoadError(str(exc)) from None
