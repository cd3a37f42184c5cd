"""[worker] A drafter model beside the target, on the worker: mlx-vlm's own drafter classes.

Gemma 4's assistant drafters (``gemma4_assistant``, mlx-vlm's ``mtp`` kind) draft from the target's
state. A decode row's input token was sampled from the target's output at the row's newest position;
the drafter takes that token's embedding (the target's table), the target's last hidden state there
(normalized, as mlx-vlm's round loop gives it) and the KV of the target's last layer of each attention
type, and runs ``k`` small forwards, each proposing one token (its argmax). The drafts are verified as
any others (engine/verify.py): a drafter changes how many tokens a step keeps, never which.

The hidden state comes out of the target's own decode and verify forwards (``hidden_sink``: mlx-vlm's
Gemma 4 records its last decoder layer's output there), so it costs nothing to keep; a row that has
just joined the batch has none yet and decodes plainly for one step. Each row drafts on its own, its
KV taken from the batch's caches as a one-row cache (``extract``, in temporal order and without the
batch's padding), as mlx-vlm drafts rows at different positions: each has its own rotary position
and masks.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.models import ModelAdapter

# Drafter model types this server runs, and the target families they pair with.
SUPPORTED = {"gemma4_assistant": ("gemma4",)}


class DrafterError(ValueError):
    """The drafter cannot serve this target: a bad path, an unsupported kind, or another model's drafter."""


class Drafter:
    """A loaded drafter, bound to its target; every call runs on the worker that loaded both."""

    def __init__(self, model: nn.Module, target: nn.Module, sources: dict[str, int], path: str) -> None:
        self.model: Any = model
        self.target: Any = target  # the target's language model (its final norm turns hidden states into the drafter's input)
        self.sources = sources  # per attention type the drafter reads: the target layer whose KV it is
        self.path = path

    @classmethod
    def load(cls, path: str, target: nn.Module, family: str, name: str, adapter: ModelAdapter) -> Drafter:
        """Load the drafter at ``path`` for the model ``target`` (its family's model type ``family``, served as
        ``name``); DrafterError, in one line, where it cannot serve it."""
        from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility

        try:
            loaded_drafter: tuple[Any, str] = load_drafter(path, "mtp")
            model, kind = loaded_drafter
        except Exception as exc:  # noqa: BLE001 - any failure to load is the one-line start-up error
            raise DrafterError(f"drafter {path!r} could not be loaded: {type(exc).__name__}: {exc}") from exc
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED:
            raise DrafterError(f"drafter {path!r} is a {model_type!r}; this server runs "
                               f"{', '.join(SUPPORTED)} drafters (mtp)")
        if family not in SUPPORTED[model_type]:
            raise DrafterError(f"drafter {path!r} ({model_type}) drafts for {', '.join(SUPPORTED[model_type])}, "
                               f"not {family}")
        try:
            validate_drafter_compatibility(target, model, kind)
        except ValueError as exc:
            raise DrafterError(f"drafter {path!r} does not fit {name}: {exc}") from exc
        lm = adapter.language_model
        model.set_dtype(lm.model.embed_tokens.weight.dtype)  # the target's serving dtype (it reads its KV and states)
        model.reset(target)  # binds it: the target's embedding table is its input's
        sources: dict[str, int] = {}
        for i, layer in enumerate(lm.model.layers):  # the last layer of each type; a KV-shared one reads its source's
            sources[layer.layer_type] = lm.model.previous_kvs[i]
        wanted = {layer.layer_type for layer in model.model.layers}
        if not wanted <= sources.keys():
            raise DrafterError(f"drafter {path!r} reads {sorted(wanted)} KV; {name} has {sorted(sources)}")
        return cls(model, lm, {t: sources[t] for t in wanted}, path)

    @staticmethod
    def hidden_sink(row_state: dict[str, mx.array]) -> tuple[dict[str, Any], list[mx.array]]:
        """A forward's keywords that record its last hidden state (in the list returned)."""
        sink: list[mx.array] = []
        return {**row_state, "hidden_sink": sink}, sink

    def rows_hidden(self, sink: list[mx.array], positions: list[int]) -> list[mx.array | None]:
        """Each row's drafter input from a forward's recorded hidden state ``[B, W, H]``: the normalized
        state at the row's position ``positions[row]`` (its newest kept one), ``[1, H]`` each."""
        hidden = sink[0] if len(sink) == 1 else mx.concatenate(sink, axis=1)  # a verify in blocks records each
        picked = hidden[mx.arange(len(positions)), mx.array(positions)]
        normed = cast(mx.array, self.target.speculative_draft_hidden(picked))
        rows: list[mx.array | None] = [normed[i:i + 1] for i in range(len(positions))]
        return rows

    def propose(self, cache: list[Any], rows: list[int], inputs: list[int], hidden: list[mx.array],
                k: int) -> list[tuple[int, ...]]:
        """``k`` draft tokens for each of the batch rows ``rows``, whose inputs are ``inputs`` and whose
        hidden states (``rows_hidden``) are ``hidden``; read on the host."""
        drafts = []
        for row, token, state in zip(rows, inputs, hidden):
            shared = {}
            length = 0
            for layer_type, index in self.sources.items():
                one = cache[index].extract(row)  # the row alone: temporal order, no padding
                shared[layer_type] = (one.keys, one.values)
                length = max(length, int(one.offset))
            self.model.set_shared_kv(shared, length, position=length - 1, kv_valid_len=length)
            drafts.append(self.model.draft_block(token, state[None], None, k + 1, _argmax, greedy=True))
        tokens = cast(list[list[int]], mx.concatenate(drafts).tolist())
        return [tuple(t) for t in tokens]


def _argmax(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1).astype(mx.int32)
