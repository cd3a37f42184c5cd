"""Logprobs through a real server and the openai client: each entry's ``bytes`` are its token's own,
so a client that joins them gets the text back, even where a token holds part of a character."""

from __future__ import annotations

import math

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from vlmserve.frontend.token_bytes import token_text_and_bytes

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
SPLIT = "é😊\u2028!"  # characters of two, four and three bytes: byte-level BPE spells each as byte tokens


def _check_entry(entry) -> None:
    if entry.token.startswith("bytes:"):  # part of a character: the text is its bytes, escaped
        assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in entry.bytes)
    else:
        assert entry.bytes == list(entry.token.encode())


def test_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hello"}],
                                       logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-4)
        _check_entry(entry)
        for top in entry.top_logprobs:
            _check_entry(top)


@pytest.mark.parametrize("stream", [False, True])
def test_joined_bytes_give_back_characters_split_across_tokens(client, model_name, stream):
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": "hello"}], logprobs=True, top_logprobs=3,
                  temperature=0, max_tokens=20, extra_body={"structured_outputs": {"choice": [SPLIT]}})
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == SPLIT
    assert bytes(b for entry in content for b in entry.bytes).decode() == SPLIT
    assert [e.token for e in content[:2]] == ["bytes:\\xc3", "bytes:\\xa9"]  # é, one byte per token
    for entry in content:
        _check_entry(entry)
        # Tokens the grammar rules out are not listed: they would be -inf, which JSON cannot carry.
        assert 1 <= len(entry.top_logprobs) <= 3 and all(math.isfinite(t.logprob) for t in entry.top_logprobs)
        for top in entry.top_logprobs:
            _check_entry(top)


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary as Gemma's and Llama's: ``▁`` for spaces, and ``<0xNN>``
    pieces for any byte the vocabulary has no piece for."""
    pieces = ["<unk>", "▁", "h", "i", "hi", "▁hi", *(f"<0x{b:02X}>" for b in range(256))]
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, [("h", "i"), ("▁", "hi")], unk_token="<unk>",
                     byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_byte_fallback_pieces_give_their_own_bytes():
    tok = _byte_fallback_tokenizer()
    ids = tok.encode("▁hi" + SPLIT, add_special_tokens=False)
    entries = [token_text_and_bytes(tok, i) for i in ids]
    assert entries[0] == (" hi", list(b" hi"))
    assert entries[1] == ("bytes:\\xc3", [0xC3])
    assert bytes(b for _, raw in entries for b in raw) == (" hi" + SPLIT).encode()
