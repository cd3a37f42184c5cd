"""[worker] A drafter model beside the target, on the worker: mlx-vlm's own drafter classes.

Four run here: Gemma 4's assistant (this module), Qwen3.5's MTP (engine/mtp.py, which keeps a KV of its
own), DFlash (engine/dflash.py, a KV of its own from several target layers) and EAGLE-3 (engine/eagle3.py,
the MTP's bookkeeping over three target layers' states). ``load`` picks by the
drafter's model type; the runner talks to each the same way (``hidden_sink``/``recorded`` around a target
forward, ``after_decode``/``after_verify``, ``draft``).

Gemma 4's assistant drafters (``gemma4_assistant``, mlx-vlm's ``mtp`` kind) draft from the target's
state. A decode row's input token was sampled from the target's output at the row's newest position;
the drafter takes that token's embedding (the target's table), the target's last hidden state there
(normalized, as mlx-vlm's round loop gives it) and the KV of the target's last layer of each attention
type, and runs ``k`` small forwards, each proposing one token (its argmax). The drafts are verified as
any others (engine/verify.py): a drafter changes how many tokens a step keeps, never which.

The hidden state comes out of the target's own decode and verify forwards (``hidden_sink``: mlx-vlm's
Gemma 4 records its last decoder layer's output there), so it costs nothing to keep; a row that has
just joined the batch has none yet and decodes plainly for one step. Every drafting row goes in one
forward per token, each at its own rotary position, reading the keys where the batch's caches hold
them, with a mask per row (``propose``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.dflash import DFlashDrafter
from vlmserve.engine.draft_model import DraftModel
from vlmserve.engine.eagle3 import Eagle3Drafter
from vlmserve.engine.models import ModelAdapter
from vlmserve.engine.mtp import MtpDrafter

if TYPE_CHECKING:
    from vlmserve.engine.batch import DecodeBatch

# Drafter model types this server runs, and the target families they pair with, by kind (the method).
SUPPORTED = {"mtp": {"gemma4_assistant": ("gemma4",), "qwen3_5_mtp": ("qwen3_5",)},
             "dflash": {"qwen3_dflash": ("qwen3_5",), "gemma4_dflash": ("gemma4",)},
             "eagle3": {"eagle3": ("gemma4",)}}


class DrafterError(ValueError):
    """The drafter cannot serve this target: a bad path, an unsupported kind, or another model's drafter."""


class Drafter:
    """A loaded Gemma 4 assistant drafter, bound to its target; every call runs on the worker that loaded both."""

    reads_prompt = False  # it reads the target's KV: nothing of its own to fill from the prompt

    def __init__(self, model: nn.Module, target: nn.Module, sources: dict[str, int]) -> None:
        self.model: Any = model
        self.target: Any = target  # the target's language model (its final norm turns hidden states into the drafter's input)
        self.sources = sources  # per attention type the drafter reads: the target layer whose KV it is

    @classmethod
    def load(cls, path: str, target: nn.Module, family: str, name: str, adapter: ModelAdapter,
             own: bool = False, kind: str = "mtp") -> AnyDrafter:
        """Load the drafter at ``path`` for the model ``target`` (its family's model type ``family``, served as
        ``name``; ``own``: the MTP layers its own checkpoint at ``path`` carries; ``kind``: the method asked
        for); DrafterError, in one line, where it cannot serve it."""
        from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility

        try:
            loaded_drafter: tuple[Any, str] = load_drafter(path, kind)
            model, kind = loaded_drafter
        except Exception as exc:  # noqa: BLE001 - any failure to load is the one-line start-up error
            why = " ".join(str(exc).split())  # one line, whatever the loader said
            if own:
                raise DrafterError(f'{name} carries no MTP layers mlx-vlm can read ({type(exc).__name__}: {why}); '
                                   'give a drafter directory as "model" (--draft-model)') from exc
            raise DrafterError(f"drafter {path!r} could not be loaded: {type(exc).__name__}: {why}") from exc
        model_type = _model_type(model)
        supported = SUPPORTED[kind]
        if own and model_type not in supported:
            raise DrafterError(f'{name} carries no MTP layers of its own (it is a {family}); give a drafter '
                               'directory as "model" (--draft-model)')
        if model_type not in supported:
            raise DrafterError(f"drafter {path!r} is a {model_type!r}; this server runs "
                               f"{', '.join(supported)} drafters ({kind})")
        if family not in supported[model_type]:
            raise DrafterError(f"drafter {path!r} ({model_type}) drafts for {', '.join(supported[model_type])}, "
                               f"not {family}")
        try:
            validate_drafter_compatibility(target, model, kind)
        except ValueError as exc:
            raise DrafterError(f"drafter {path!r} does not fit {name}: {exc}") from exc
        lm = adapter.language_model
        fits = {"dflash": DFlashDrafter.unfit, "eagle3": Eagle3Drafter.unfit}.get(kind)
        if fits is not None and (unfit := fits(model, _text_config(target), adapter.num_layers)):
            raise DrafterError(f"drafter {path!r} does not fit {name}: {unfit}")
        model.set_dtype(lm.model.norm.weight.dtype)  # the target's serving dtype (quantized or not: its norm's)
        model.reset(target)  # binds it: the target's embedding table (and head) are its own
        if model_type == "qwen3_5_mtp":
            return MtpDrafter(model, adapter)
        if kind == "dflash":
            return DFlashDrafter(model, adapter)
        if kind == "eagle3":
            return Eagle3Drafter(model, adapter)
        sources: dict[str, int] = {}
        for i, layer in enumerate(lm.model.layers):  # the last layer of each type; a KV-shared one reads its source's
            sources[layer.layer_type] = lm.model.previous_kvs[i]
        wanted = {layer.layer_type for layer in model.model.layers}
        if not wanted <= sources.keys():
            raise DrafterError(f"drafter {path!r} reads {sorted(wanted)} KV; {name} has {sorted(sources)}")
        return cls(model, lm, {t: sources[t] for t in wanted})

    @staticmethod
    def hidden_sink(row_state: dict[str, mx.array]) -> tuple[dict[str, Any], list[mx.array]]:
        """A forward's keywords that record its last hidden state (in the list returned)."""
        sink: list[mx.array] = []
        return {**row_state, "hidden_sink": sink}, sink

    @staticmethod
    def recorded(sink: list[mx.array]) -> mx.array:
        """A forward's recorded last hidden state, ``[B, W, H]`` (before the final norm)."""
        return sink[0] if len(sink) == 1 else mx.concatenate(sink, axis=1)  # a verify in blocks records each

    def after_decode(self, batch: DecodeBatch, tokens: mx.array, hidden: mx.array) -> None:
        """A decode forward's hidden states: each row's newest position's."""
        batch.record_hidden(hidden, [0] * len(batch))

    def after_verify(self, batch: DecodeBatch, picked: list[list[int]], hidden: mx.array) -> None:
        """A verify forward's hidden states: each row's newest kept position is its ``len(picked) - 1``."""
        batch.record_hidden(hidden, [len(p) - 1 for p in picked])

    def draft(self, batch: DecodeBatch, rows: list[int], inputs: list[int], k: int) -> dict[int, tuple[int, ...]]:
        """``k`` draft tokens for the batch rows ``rows`` (inputs: every row's) that have a hidden state."""
        at = {i: where for i in rows if (where := batch.hidden_at[i]) is not None}
        if not at or batch.hidden is None or batch.cache is None:
            return {}
        picked = list(at)
        hidden = batch.hidden[mx.array([r for r, _ in at.values()]), mx.array([c for _, c in at.values()])]
        return dict(zip(picked, self.propose(batch.cache, picked, [inputs[i] for i in picked], hidden, k)))

    def propose(self, cache: list[Any], rows: list[int], inputs: list[int], hidden: mx.array, k: int
                ) -> list[tuple[int, ...]]:
        """``k`` draft tokens for each of the batch rows ``rows``, whose inputs are ``inputs`` and whose
        recorded hidden states (before the norm) are ``hidden`` (``[n, H]``); read on the host.

        All rows in one forward per token. What a row sees is what mlx-vlm's round loop shows its drafter
        for that row alone (``set_shared_kv``, ``draft_block``): every key of its own in the full layer;
        in the sliding one those in the target's window at its position. Keys stay where the batch's
        caches hold them (right-aligned, a rotated window in place): attention does not depend on the
        keys' order, only on which are masked, so nothing is copied.
        """
        model = self.model
        index = mx.array(rows)
        every = rows == list(range(int(cache[0].offset.shape[0])))  # the whole batch: no rows picked out
        shared, masks, lengths = {}, {}, None
        for layer_type, source in self.sources.items():
            keys, values, valid, lengths = _row_keys(cache[source], self._window(layer_type))
            if not every:
                keys, values, valid, lengths = keys[index], values[index], valid[index], lengths[index]
            shared[layer_type] = (keys, values)
            masks[layer_type] = mx.where(valid, 0.0, -mx.inf).astype(keys.dtype)[:, None, None, :]
        assert lengths is not None
        position = lengths - 1  # the drafter's position stays the row's newest throughout (draft_block)
        state = cast(mx.array, self.target.speculative_draft_hidden(hidden))[:, None, :]
        token = mx.array(inputs, dtype=mx.int32)[:, None]
        drafted = []
        for _ in range(k):
            h = model.pre_projection(mx.concatenate([model._input_embed(token) * model._input_embed_scale, state], -1))
            for layer in model.model.layers:
                h, _, _ = layer(h, mask=masks[layer.layer_type], cache=None, per_layer_input=None,
                                shared_kv=shared[layer.layer_type], offset=position)
            h = model.model.norm(h)
            state = model.post_projection(h)
            if model.masked_embedding is not None:
                token = model.masked_embedding.argmax(h, model.model.embed_tokens.weight).astype(mx.int32)
            else:
                token = mx.argmax(model._lm_head_fn(h), axis=-1).astype(mx.int32)
            drafted.append(token)
        tokens = cast(list[list[int]], mx.concatenate(drafted, axis=1).tolist())
        return [tuple(t) for t in tokens]

    def _window(self, layer_type: str) -> int | None:
        window = self.model.config.text_config.sliding_window
        return int(window) if layer_type == "sliding_attention" else None


def _row_keys(layer: Any, window: int | None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A batch cache's keys and values as stored, which of them each row's drafter query sees, and each
    row's length. Rows end together (right-aligned, their left padding before them); a full rotating
    window is a ring whose slot ``_idx`` holds the oldest key."""
    lengths = layer.offset.astype(mx.int32)  # per row: the positions in it
    if window is None:  # BatchKVCache
        stored = layer._idx
        keys, values = layer.keys[..., :stored, :], layer.values[..., :stored, :]
        age = stored - 1 - mx.arange(stored)  # slot j holds the row's position lengths - 1 - age
    else:  # BatchRotatingKVCache: its slots in time order, wherever the ring starts
        stored = min(layer._offset, layer.keys.shape[2])
        keys, values = layer.keys[..., :stored, :], layer.values[..., :stored, :]
        order = (mx.arange(stored) - (layer._idx if layer.rotated else 0)) % stored
        age = stored - 1 - order
    valid = age[None, :] < lengths[:, None]  # not the row's left padding
    if window is not None:  # the target's own window: its newest position and the window - 1 before it
        valid = valid & (age[None, :] < window)
    return keys, values, valid, lengths


def _model_type(model: Any) -> str | None:
    """A loaded drafter's model type: its config's, or for DFlash the module mlx-vlm loaded it from (the config
    says ``qwen3``; mlx-vlm reads the ``dflash_config`` as ``qwen3_dflash``)."""
    module = type(model).__module__.split(".")
    if "drafters" in module and module.index("drafters") + 1 < len(module):
        found = module[module.index("drafters") + 1]
        if "dflash" in found:
            return found
    return getattr(model.config, "model_type", None)


def _text_config(target: Any) -> Any:
    config = target.config
    return getattr(config, "text_config", None) or config


AnyDrafter = Drafter | MtpDrafter | DFlashDrafter | DraftModel
