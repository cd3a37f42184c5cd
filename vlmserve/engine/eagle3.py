"""[worker] EAGLE-3 drafters (mlx-vlm's ``eagle3``, the Red Hat speculators format; the ``eagle3`` kind): a
decoder layer with a KV of its own, fed with three target layers' hidden states.

The drafter reads pairs, as Qwen3.5's MTP does (engine/mtp.py, whose bookkeeping this is): at position ``p``,
the embedding of token ``p + 1`` and the target's state at ``p``. Here that state is three decoder layers'
outputs side by side (the config's ``eagle_aux_hidden_state_layer_ids`` count Hugging Face's hidden states,
the embedding first, so they are the outputs of the layers before: mlx-vlm's ``capture_layer_ids``,
recorded by the adapter's ``hidden_layers``), which ``fc`` makes one vector. The first layer attends over
``[norm(embedding), norm(state)]``; its residual is the state. While drafting, a pair's state is the
drafter's own output at the position before (before its final norm: mlx-vlm's ``draft_block``), so a row's
seed is that output. Its head scores a reduced ("hot") vocabulary: ``d2t`` maps a hot id to the target's,
and the target's verify, over its whole vocabulary, decides.

Everything else is the MTP's: the prompt's positions into the drafter's KV as each chunk ends, the last one
waiting for the first token; a verify's kept positions pending until the next step drafts; ``k`` drafts
from each row's seed, their entries dropped after; the prompt's drafter state stored with its cached
prefix (engine/mtp_prefix.py), the last position waiting for the next prompt's own token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx.nn as nn

from vlmserve.engine.mtp import DraftColumns, DraftRows, MtpDrafter

if TYPE_CHECKING:
    from vlmserve.engine.models import ModelAdapter

READS = 3  # target layers an EAGLE-3 drafter reads (its fc takes 3 x the target's width)


class Eagle3Drafter(MtpDrafter):
    """A loaded EAGLE-3 drafter, bound to its target; every call runs on the worker that loaded both."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        super().__init__(model, adapter)
        # mlx-vlm captures in the layers' order, and its fc was trained on them in that order
        adapter.hidden_layers = tuple(sorted(int(i) for i in self.model.config.capture_layer_ids))

    @staticmethod
    def unfit(model: Any, target_config: Any, layers: int) -> str | None:
        """Why the EAGLE-3 drafter ``model`` cannot read a target of ``layers`` decoder layers whose text config
        is ``target_config`` (None: it can)."""
        ids = sorted(int(i) for i in model.config.capture_layer_ids)
        # Gemma 4's layers that read earlier layers' KV run a prompt's last position only (logits_to_keep)
        readable = layers - int(getattr(target_config, "num_kv_shared_layers", 0) or 0)
        if len(set(ids)) != READS or ids[0] < 0 or ids[-1] >= readable:
            return (f"it reads the outputs of layers {ids}; {READS} different ones of the target's first {readable} "
                    "are needed")
        width = getattr(target_config, "hidden_size", None)
        if model.target_hidden_size != width:
            return f"it reads states {model.target_hidden_size} wide, the target's are {width}"
        if READS * width == model.hidden_size:  # mlx-vlm tells the target's states from its own by their width
            return f"its width {model.hidden_size} is that of the target's {READS} states side by side"
        if model.target_vocab_size != getattr(target_config, "vocab_size", None):
            return f"its vocabulary maps to {model.target_vocab_size} tokens, the target's has {target_config.vocab_size}"
        return None

    def _greedy(self, state: mx.array) -> mx.array:
        """The drafter's token for its output ``state`` ``[B, 1, H]``: its hot vocabulary's best, as the target's id."""
        return cast(mx.array, self.model._draft_to_target(mx.argmax(self.model._logits(state), axis=-1), mx.int32))

    def _layers(self, rows: DraftRows, tokens: mx.array, hidden: mx.array, seen: mx.array) -> mx.array:
        """The drafter's layers over pairs (``hidden``: the target's layers side by side, or, while drafting, the
        drafter's own output), their entries written into ``rows``; its output before the final norm."""
        model = self.model
        h = model._prepare_target_hidden(hidden)  # fc, where the state is the target's
        embeds = model.embed_tokens(tokens)
        mask = mx.where(seen, 0.0, -mx.inf).astype(h.dtype)
        position = rows.position + 1  # mlx-vlm numbers a pair by its token's position
        first, *rest = model.layers
        h = first(embeds, h, mask, DraftColumns(rows, 0), position)
        for i, layer in enumerate(rest, start=1):
            h = layer(h, mask, DraftColumns(rows, i), position)
        return cast(mx.array, h)
