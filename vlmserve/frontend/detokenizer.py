"""[loop] Incremental detokenization: token ids in, text deltas out, never a broken character."""

from __future__ import annotations

from typing import Any

# How many already-emitted tokens to re-decode for context (spaces and merges depend on it).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (a few tokens of context plus the new ones) rather than the
    whole sequence, so each token costs O(1). Holds text back while it ends in an
    incomplete UTF-8 sequence (``\\ufffd``).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens up to here have been emitted as text
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation, emit whatever is still held back."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        delta = full[len(prefix) :]
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip)
        return text
