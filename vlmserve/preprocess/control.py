"""[pool] Control tokens a client may not type: turn markers, image placeholders, BOS and EOS.

A chat template pastes message text into the prompt, and the tokenizer then reads every special
token's string as that token. So ``<|image|>`` typed into a message would become an image
placeholder, and ``<end_of_turn>`` would end the user's turn early. vlmserve refuses such text with
a 400 naming the token, instead of guessing an escape that each tokenizer would read differently.
Non-special added tokens (PaliGemma's ``<loc0042>``, Qwen's ``<tool_call>``) are ordinary content.
The same walk over the client's text refuses half a UTF-16 surrogate pair left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class ControlTokens:
    """The special-token strings of one model, indexed for a fast scan."""

    tokens: frozenset[str] = frozenset()
    # A scan that costs the same for 20 special tokens or 6,000 (Gemma's <unusedN>): only where
    # a token's first character occurs, only the lengths tokens have.
    _starts: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)
    _lengths: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens:
            firsts = "".join(sorted({re.escape(t[0]) for t in self.tokens}))
            object.__setattr__(self, "_starts", re.compile(f"[{firsts}]"))
            object.__setattr__(self, "_lengths", tuple(sorted({len(t) for t in self.tokens}, reverse=True)))

    @classmethod
    def of(cls, processor: Any, tokenizer: Any) -> ControlTokens:
        found: set[str] = set(getattr(tokenizer, "all_special_tokens", None) or ())
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        found.update(t.content for t in decoder.values() if getattr(t, "special", False))
        for owner in (processor, tokenizer):  # image_token, boi_token, video_token...
            for name in dir(owner):
                if name.endswith("_token") and not name.startswith("_"):
                    value = getattr(owner, name, None)
                    if isinstance(value, str):
                        found.add(value)
        return cls(frozenset(t for t in found if len(t) > 1 and not t.isspace()))

    def first_in(self, text: str) -> str | None:
        """The first control token that occurs in ``text``, if any."""
        if self._starts is None:
            return None
        for start in self._starts.finditer(text):
            at = start.start()
            for length in self._lengths:  # the longest first, where one token starts another
                if text[at:at + length] in self.tokens:
                    return text[at:at + length]
        return None

    def refusal(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                instructions: str) -> str | None:
        """Why the client's text cannot become a prompt, naming where, or None: a control token typed
        as text, or half of a UTF-16 surrogate pair alone (JSON can carry ``"\\ud800"``, Unicode text
        cannot, and no tokenizer takes it)."""
        for where, text in _texts(messages, tools, instructions):
            if alone := _SURROGATE.search(text):
                return (f"{where}: the text contains U+{ord(alone.group()):04X}, half of a UTF-16 surrogate pair, "
                        "alone; it is not a character")
            token = self.first_in(text)
            if token is not None:
                return (f"{where}: the text contains {token!r}, a control token of this model; special tokens "
                        "cannot be sent as text")
        return None


_SURROGATE = re.compile("[\ud800-\udfff]")  # a pair (JSON's \ud83d\ude00) decodes to one character


def _texts(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
           instructions: str) -> Iterator[tuple[str, str]]:
    for i, message in enumerate(messages):
        yield from _strings(message, f"messages.{i}")
    for i, tool in enumerate(tools or ()):
        yield from _strings(tool, f"tools.{i}")
    yield "response_format", instructions


def _strings(value: Any, where: str) -> Iterable[tuple[str, str]]:
    """Every string in a JSON-like value, keys included, walked with a stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
