"""[any] The demo model's architecture: the offline gemma4 builder's pieces at the demo's own size.

Tokenizer, chat template, processor, config and init all come from vlmserve.testing's gemma4
recipe; only the dimensions differ (a 96 px input seen as
3 x 3 soft tokens, one per cell of the scenes' grid, and a 4-layer text model).
Runs on whichever thread trains; the model made here is trained and saved there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn

from vlmserve.testing import build, gemma4
from vlmserve.testing.demo.dialogues import demo_corpus
from vlmserve.testing.recipe import Dims, Recipe
from vlmserve.testing.tokenizer import TokenizerSpec, build_tokenizer, stdlib_corpus
from vlmserve.testing.weights import POST_NORMS, instantiate, set_norm_weights, weight_tensors

DEMO_DIMS = Dims(
    vocab=4096, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384,
    vision_hidden=128, vision_layers=3, vision_heads=4, vision_intermediate=256,
    patch=16, image_size=96, image_tokens=9, dtype="bfloat16", image_budget=12,
)  # fmt: skip
PER_LAYER_INPUT = 0  # no per-layer token embeddings (like the larger Gemma 4s): ~35% faster on this CPU


def demo_recipe(dims: Dims = DEMO_DIMS) -> Recipe:
    """The builder's gemma4 recipe with the demo's dimensions."""
    tokens = TokenizerSpec(
        vocab_size=dims.vocab,
        special_tokens=gemma4.SPECIAL_TOKENS,
        roles=gemma4.ROLES,
        named=gemma4.NAMED_TOKENS,
        chat_template=gemma4.GEMMA4_CHAT_TEMPLATE,
    )
    return Recipe(
        arch="gemma4",
        dims=dims,
        tokens=tokens,
        config=gemma4.model_config(dims, tokens, PER_LAYER_INPUT),
        make_processor=lambda tokenizer: gemma4.make_processor(tokenizer, dims),
        fix_init=gemma4.fix_init,
    )


def initial_model(recipe: Recipe, seed: int) -> tuple[nn.Module, Any]:
    """A float32 model at the builder's (seeded, repaired) init, and its processor.

    The BPE also learns from the demo's own texts, so that " circle", "Red" or " Tokyo" are one
    token each: on the stdlib alone they took 2-4 (" red" was " re" + "d"), and a word spread
    over several tokens is slower to tie to what the image shows."""
    processor = recipe.make_processor(build_tokenizer(recipe.tokens, stdlib_corpus() + demo_corpus()))
    model = instantiate(recipe.config, seed)
    recipe.fix_init(model)
    retune_init(model, recipe.dims)
    return model, processor


def retune_init(model: nn.Module, dims: Dims) -> None:
    """Undo the builder's repairs that help a random model talk but slow learning.

    Gemma 4 attends with scale 1.0 and lets q_norm/k_norm weights set the temperature; at 1.0
    the logits have std ~sqrt(head_dim) and attention starts near one-hot on random keys.
    head_dim**-0.25 on both gives the usual 1/sqrt(head_dim). The residual gain goes back to 1.
    """
    set_norm_weights(model, POST_NORMS, 1.0)
    set_norm_weights(model.language_model, ("q_norm", "k_norm"), dims.head_dim**-0.25)
    vision_head_dim = dims.vision_hidden // dims.vision_heads
    set_norm_weights(model.vision_tower, ("q_norm", "k_norm"), vision_head_dim**-0.25)


def save_model(recipe: Recipe, processor: Any, model: nn.Module, path: Path) -> dict[str, Any]:
    """Write the Hugging Face layout ``mlx_vlm.load`` reads, with the builder's own save code."""
    tensors = weight_tensors(model, recipe.dims.dtype, skip=recipe.skip_weights)
    return build._save(recipe, processor, tensors, path)  # noqa: SLF001 - same package family, same format
