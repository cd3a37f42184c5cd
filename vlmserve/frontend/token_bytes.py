"""[loop] One token as logprobs report it: its own bytes, and text for them.

A token that holds part of a character (byte-level BPE as in Qwen, SmolVLM and Mistral, or the
``<0xE2>`` byte fallback of SentencePiece-style vocabularies as in Gemma and LLaVA) decodes alone
to U+FFFD. Its ``bytes`` must still be its own, so that a client joining the bytes of a run of
tokens gets the character back: that is what OpenAI's ``bytes`` field is for. Its ``token`` is
then written ``bytes:\\xe2\\x80``, as OpenAI writes one.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: each of the 256 characters a byte-level
    vocabulary writes its pieces in, to the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in printable):
        chars[b] = chr(256 + n)  # the rest, in order, past Latin-1
    return {c: b for b, c in chars.items()}


def _piece_bytes(piece: str) -> bytes | None:
    """A vocabulary piece's bytes, where it is written as bytes; else None."""
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    table = _byte_level_chars()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


def token_text_and_bytes(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """The token's text and its bytes, as OpenAI's logprobs entries give them."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text, list(text.encode())
    raw = _piece_bytes(tokenizer.convert_ids_to_tokens(token_id) or "")
    if raw is None:  # U+FFFD that the vocabulary spells as text: it is the token
        return text, list(text.encode())
    try:
        return raw.decode(), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
