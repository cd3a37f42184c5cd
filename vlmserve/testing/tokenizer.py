"""[any] A byte-level BPE tokenizer trained offline on Python's stdlib, wrapped for transformers.

The special tokens take the lowest ids, in the order the architecture lists them, so a test can
name them by id. Training is deterministic: the same sorted file list gives the same merges.
The tokenizer adds BOS itself only where the real one does (``add_bos_token``); elsewhere the
chat template emits it (see templates.py).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# ~2 MB of source: enough merges for a few thousand tokens, trained in about a second.
CORPUS_CHARS = 2_000_000


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What an architecture needs from its tokenizer."""

    vocab_size: int
    special_tokens: tuple[str, ...]  # ids 0..n-1, in this order
    roles: Mapping[str, str]  # bos_token, eos_token, pad_token, unk_token, mask_token
    named: Mapping[str, str]  # e.g. image_token, boi_token: become tokenizer attributes
    chat_template: str
    add_bos_token: bool = False  # True where the real tokenizer adds BOS itself (Llama-style)

    def id_of(self, token: str) -> int:
        return self.special_tokens.index(token)


def stdlib_corpus(max_chars: int = CORPUS_CHARS) -> list[str]:
    """Top-level stdlib ``*.py`` files in sorted order, up to ``max_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root} to train a tokenizer on")
    return texts


def train_bpe(spec: TokenizerSpec, corpus: list[str] | None = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unk
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or stdlib_corpus(), trainer=trainer)
    return tokenizer


def build_tokenizer(spec: TokenizerSpec, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train the BPE (on ``corpus``, default the stdlib) and wrap it with the spec's special
    tokens and chat template."""
    tokenizer = train_bpe(spec, corpus)
    # A small corpus may stop short of vocab_size; the model config must use the real size.
    assert tokenizer.get_vocab_size() <= spec.vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **spec.roles,
        extra_special_tokens=dict(spec.named),
        chat_template=spec.chat_template,
        padding_side="left",
        add_bos_token=spec.add_bos_token,
        add_eos_token=False,
    )


def unmark_special(tokenizer: PreTrainedTokenizerFast, plain: Iterable[str]) -> PreTrainedTokenizerFast:
    """The same tokenizer with the ``plain`` added tokens marked non-special, as real tokenizer.json files mark
    tool and think tags: ``decode(..., skip_special_tokens=True)`` keeps them. tokenizers cannot unmark a token
    once trained as special, so the JSON is edited and wrapped again with the original arguments."""
    plain = set(plain)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    for token in data["added_tokens"]:
        if token["content"] in plain:
            token["special"] = False
    kwargs = {k: v for k, v in tokenizer.init_kwargs.items() if k != "backend"}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), **kwargs)
