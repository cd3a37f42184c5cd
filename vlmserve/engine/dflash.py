"""[worker] DFlash drafters (mlx-vlm's ``qwen3_dflash`` and ``gemma4_dflash``, the ``dflash`` kind): a block of
drafts in one forward, from a KV of their own built from several target layers' hidden states.

At each position a row has, the drafter reads the outputs of the target's ``target_layer_ids`` layers side by
side (recorded by the adapter: ``hidden_layers``). ``fc`` and ``hidden_norm`` make them one context vector,
which each drafter layer projects to its keys and values: the drafter's KV (its *context*) depends on the
target's states alone, never on the drafter's own layers. To draft ``k`` tokens for a row whose input ``t``
is at position ``p``, the block ``[t, mask * k]`` at positions ``p .. p + k`` runs through the drafter's layers
once, attending to the row's context and to the whole block (both ways, unless the config says causal); the
argmax at block positions ``1 .. k`` are the drafts (mlx-vlm's ``draft_block``). The block's keys are not kept.
The block is as wide as the drafter was trained for (its ``block_size``, mlx-vlm's ceiling) whatever ``k``:
its positions attend to each other, so a narrower one would draft other tokens, and a row's drafts would
depend on how wide the widest row of its batch drafts.

- **prompt:** each prefill chunk's states go into the row's context as the chunk ends (``prefill``); a prompt
  that reuses a cached prefix starts from the context stored with it (engine/mtp_prefix.py);
- **decode and verify:** each target forward leaves every row's kept positions (``after_decode``,
  ``after_verify``); they go into the context when the next step drafts, before it drafts. A step that does
  not draft drops them (the context has a gap; the positions stay right), so a step without drafts costs
  nothing more than without a drafter.

The context lives in the buffers the MTP drafter uses (``DraftRows``, engine/mtp.py): one column per append
for every row, masked where a row has none there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.speculative.common import _dflash_block_total

from vlmserve.engine.mtp import DraftRows

if TYPE_CHECKING:
    from vlmserve.engine.batch import DecodeBatch
    from vlmserve.engine.models import ModelAdapter


class DFlashDrafter:
    """A loaded DFlash drafter, bound to its target; every call runs on the worker that loaded both."""

    reads_prompt = True  # its context needs every position's hidden states, the prompt's included

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        self.model: Any = model
        self.adapter = adapter  # the target's: its forwards record the chosen layers' states while asked
        config = self.model.config
        self.mask_id = int(config.mask_token_id)
        self.causal = bool(getattr(config, "is_causal", False))
        self.block = _dflash_block_total(model, None)  # the trained block (or the config's runtime one)
        adapter.hidden_layers = tuple(int(i) for i in config.target_layer_ids)

    @staticmethod
    def unfit(model: Any, target_config: Any, layers: int) -> str | None:
        """Why the DFlash drafter ``model`` cannot read a target of ``layers`` decoder layers whose text config is
        ``target_config`` (None: it can)."""
        config = model.config
        if any(t != "full_attention" for t in config.layer_types) or getattr(config, "draft_window_size", None):
            return "its sliding-window layers are not supported here (yet)"
        ids = list(config.target_layer_ids)
        if not ids or max(ids) >= layers or config.num_target_layers != layers:
            return f"it reads layers {ids} of {config.num_target_layers}; the target has {layers}"
        # Gemma 4's layers that read earlier layers' KV (E2B, E4B) run a prompt's last position only
        shared = int(getattr(target_config, "num_kv_shared_layers", 0) or 0)
        if shared and max(ids) >= layers - shared:
            return (f"it reads layers {ids}; the target's last {shared} share earlier layers' KV and compute a "
                    "prompt's last position only")
        for name in ("hidden_size", "vocab_size"):
            if getattr(config, name) != getattr(target_config, name, None):
                return f"its {name} is {getattr(config, name)}, the target's {getattr(target_config, name, None)}"
        return None

    # -- the target's hidden states -------------------------------------------------

    def hidden_sink(self, row_state: dict[str, mx.array]) -> tuple[dict[str, Any], list[mx.array]]:
        """Record the next target forwards' chosen layers (in the list returned) until ``recorded``."""
        sink: list[mx.array] = []
        self.adapter.hidden_sink = sink
        return row_state, sink

    def recorded(self, sink: list[mx.array]) -> mx.array:
        """The recorded states, ``[B, L, layers * H]`` (several forwards of the same rows, side by side); stops
        recording."""
        self.adapter.hidden_sink = None
        assert len({h.shape[0] for h in sink}) == 1, f"forwards of different rows: {[h.shape for h in sink]}"
        return sink[0] if len(sink) == 1 else mx.concatenate(sink, axis=1)

    # -- prompts --------------------------------------------------------------------

    def prefill(self, rows: DraftRows | None, input_ids: mx.array, hidden: mx.array, end: int) -> DraftRows:
        """A prompt's positions ``[end - L, end)`` (``hidden``: ``[1, L, layers * H]``) into its context."""
        if rows is None:
            rows = DraftRows.start(len(self.model.layers), 1, end - hidden.shape[1])
        self._context(rows, hidden, None)
        return rows  # evaluated with the prompt's own cache (``arrays``), so its hidden states are not held

    def first(self, prompts: list[DraftRows], tokens: list[list[int]]) -> DraftRows:
        """Prefilled prompts' rows, in order: a row per first token (``n`` > 1 forks copy a prompt's context)."""
        return DraftRows.merge([p for p, t in zip(prompts, tokens) for _ in t])

    # -- decode ---------------------------------------------------------------------

    def after_decode(self, batch: DecodeBatch, tokens: mx.array, hidden: mx.array) -> None:
        """After a decode forward: each row's newest position, kept for the next step that drafts."""
        self._pend(batch, hidden, [1] * len(batch))

    def after_verify(self, batch: DecodeBatch, picked: list[list[int]], hidden: mx.array) -> None:
        """After a verify forward: each row's kept positions (``len(picked[row])``), kept for the next step
        that drafts."""
        self._pend(batch, hidden[:, :max(len(p) for p in picked)], [len(p) for p in picked])

    def _pend(self, batch: DecodeBatch, hidden: mx.array, lengths: list[int]) -> None:
        state = _rows(batch)
        if state.pending is not None:  # not drafted from: dropped, but the rows' positions go on
            state.position = state.position + mx.array(state.pending[2], dtype=mx.int32)
        state.pending = mx.zeros(hidden.shape[:2], dtype=mx.int32), hidden, lengths

    def draft(self, batch: DecodeBatch, rows: list[int], inputs: list[int], k: int) -> dict[int, tuple[int, ...]]:
        """``k`` draft tokens for the batch rows ``rows`` (``inputs``: every row's input); the last forward's
        positions go into the context first."""
        state = _rows(batch)
        if state.pending is not None:
            _, hidden, lengths = state.pending
            state.pending = None
            self._context(state, hidden, lengths)
        return dict(zip(rows, self.propose(state, rows, [inputs[i] for i in rows], k))) if rows else {}

    def propose(self, rows: DraftRows, which: list[int], inputs: list[int], k: int) -> list[tuple[int, ...]]:
        """``k`` draft tokens for each of the rows ``which`` (their inputs ``inputs``), in one forward; read on
        the host."""
        model, size, width = self.model, rows.size, max(k + 1, self.block)
        assert size > 0, "a row drafts from its context"
        index = mx.array(which)
        keys = [key[index, :, :size] for key in rows.keys]
        values = [value[index, :, :size] for value in rows.values]
        valid, position = rows.valid[index, :size], rows.position[index]
        column = mx.arange(width)
        own = column[None, :] <= column[:, None] if self.causal else mx.ones((width, width), dtype=mx.bool_)
        seen = mx.concatenate([mx.broadcast_to(valid[:, None, :], (len(which), width, size)),
                               mx.broadcast_to(own, (len(which), width, width))], axis=-1)[:, None]
        block = mx.array([[t] + [self.mask_id] * (width - 1) for t in inputs], dtype=mx.int32)
        h = model._embed_input_tokens(block)
        for layer, key, value in zip(model.layers, keys, values):
            h = h + self._attend(layer.self_attn, layer.input_layernorm(h), key, value, seen, position)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        drafted = mx.argmax(model._logits(model.norm(h)[:, 1:k + 1]), axis=-1)
        return [tuple(t) for t in cast(list[list[int]], drafted.tolist())]

    # -- the forwards ---------------------------------------------------------------

    def _attend(self, attn: Any, x: mx.array, ctx_keys: mx.array, ctx_values: mx.array, seen: mx.array,
                position: mx.array) -> mx.array:
        """A drafter layer's attention for the block ``x`` ``[n, W, H]`` at each row's ``position``: the row's
        context (where ``seen``) and the block's own keys (mlx-vlm's ``DFlashAttention``, per row)."""
        n, width, _ = x.shape
        queries = attn.q_norm(attn.q_proj(x).reshape(n, width, attn.n_heads, -1)).transpose(0, 2, 1, 3)
        keys, values = attn._project_kv(x)
        keys = attn.k_norm(keys.reshape(n, width, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(n, width, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.model.rope(queries, offset=position), self.model.rope(keys, offset=position)
        out = mx.fast.scaled_dot_product_attention(
            queries, mx.concatenate([ctx_keys, keys], axis=2), mx.concatenate([ctx_values, values], axis=2),
            scale=attn.scale, mask=seen, sinks=attn.attention_sink_bias)
        return cast(mx.array, attn.o_proj(out.transpose(0, 2, 1, 3).reshape(n, width, -1)))

    def _context(self, rows: DraftRows, hidden: mx.array, lengths: list[int] | None) -> None:
        """Target states (``hidden`` ``[B, W, layers * H]``) at each row's next positions, the first
        ``lengths[row]`` of them real (None: all), into every drafter layer's context."""
        model = self.model
        batch, width = hidden.shape[:2]
        h = model.hidden_norm(model.fc(hidden))
        start, used = rows.size, lengths if lengths is not None else [width] * batch
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            keys, values = attn._project_kv(h)
            keys = attn.k_norm(keys.reshape(batch, width, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            values = values.reshape(batch, width, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            rows.reserve(width, keys)
            rows.keys[i][..., start:start + width, :] = model.rope(keys, offset=rows.position)
            rows.values[i][..., start:start + width, :] = values
        rows.valid[:, start:start + width] = mx.arange(width)[None, :] < mx.array(used)[:, None]
        rows.size += width
        rows.counts = [c + u for c, u in zip(rows.counts, used)]
        rows.position = rows.position + mx.array(used, dtype=mx.int32)
        rows.compact()


def _rows(batch: DecodeBatch) -> DraftRows:
    assert isinstance(batch.draft, DraftRows) and len(batch.draft) == len(batch), "a decode row without its context"
    return batch.draft
