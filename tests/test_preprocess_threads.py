"""Phase 1 from many threads at once: every prompt and every decoded text is what one thread alone
makes, and the threads never share a processor (PromptBuilder lends each build a private copy)."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import anon_rss_kib, scene

from vlmserve.engine.loader import load_model
from vlmserve.preprocess import prompt as prompt_module
from vlmserve.preprocess.prompt import PromptBuilder
from vlmserve.testing import build_model

THREADS, ROUNDS = 8, 6


def _messages(text: str, with_image: bool) -> list[dict[str, Any]]:
    parts = [{"type": "image"}] if with_image else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _same(a: Any, b: Any) -> bool:
    return a.input_ids == b.input_ids and a.arrays.keys() == b.arrays.keys() and all(
        np.array_equal(np.asarray(a.arrays[k]), np.asarray(b.arrays[k])) for k in a.arrays if
        not isinstance(a.arrays[k], tuple))


@pytest.mark.parametrize("arch", ["gemma4", "qwen2_5_vl"])
def test_threads_build_and_decode_as_one_thread_does(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(build_model(arch, "micro")))
    builder = PromptBuilder.for_processor(loaded.processor, copies=2)  # fewer than the threads: more get made
    image = scene("circle", (220, 30, 30))
    cases = [(("colour and shape " * n) + str(n), n % 3 == 0) for n in range(1, 25)]
    alone = [builder.build(_messages(text, img), [image] if img else []) for text, img in cases]
    decoder = copy.deepcopy(loaded.tokenizer)  # the loop's own, as AsyncEngine keeps one
    texts = [decoder.decode(p.input_ids) for p in alone]

    in_use: set[int] = set()
    shared: list[int] = []
    guard = threading.Lock()
    real = prompt_module.build_prompt

    def exclusive(processor: Any, *args: Any) -> Any:  # no two builds at once may hold one processor
        with guard:
            shared.extend([id(processor)] if id(processor) in in_use else [])
            in_use.add(id(processor))
        try:
            return real(processor, *args)
        finally:
            with guard:
                in_use.discard(id(processor))

    monkeypatch.setattr(prompt_module, "build_prompt", exclusive)
    errors: list[str] = []

    def build(worker: int) -> None:
        for r in range(ROUNDS):
            for i in range(len(cases)):
                j = (i + worker + r) % len(cases)
                text, img = cases[j]
                if not _same(builder.build(_messages(text, img), [image] if img else []), alone[j]):
                    errors.append(f"thread {worker}: case {j} differs")

    def decode() -> None:
        for _ in range(ROUNDS * 4):
            errors.extend("the loop's decode differs" for p, t in zip(alone, texts) if decoder.decode(p.input_ids) != t)

    with ThreadPoolExecutor(THREADS + 1) as pool:
        for future in [pool.submit(build, w) for w in range(THREADS)] + [pool.submit(decode)]:
            future.result()
    assert errors == [] and shared == []
    assert 2 <= builder.spares.qsize() <= THREADS  # one copy per concurrent build at most, none lost
    assert all(p is not loaded.processor for p in _drain(builder))  # the original is never lent


def _drain(builder: PromptBuilder) -> list[Any]:
    out = []
    while not builder.spares.empty():
        out.append(builder.spares.get_nowait())
    return out


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_renewed_threads_take_the_tokenizers_thread_local_caches_with_them() -> None:
    """tokenizers (0.23) keeps each BPE model's word cache in a thread-local map that dropping the model
    leaves behind: on a thread that lives on, every tokenizer used and dropped stays (~77 KiB each here,
    what a swapping ``--model-dir`` server grew by). A renewed pool's old threads end, and that memory with
    them; work submitted during a renewal still runs."""
    from tokenizers import Tokenizer

    from vlmserve.preprocess.pool import RenewablePool

    path = str(build_model("gemma3", "micro") / "tokenizer.json")
    text = " ".join(f"word{i} thing{i * 7} alpha{i % 13}" for i in range(200))
    pool = RenewablePool(2, "renew-test")

    def one(renew: bool) -> list[int]:
        tokenizer = Tokenizer.from_file(path)
        ids = [pool.submit(tokenizer.encode, text) for _ in range(2)]
        if renew:
            pool.renew()  # while the two encodes may still be queued on the old threads
        return [len(f.result(timeout=60).ids) for f in ids]

    for _ in range(20):
        one(True)
    before = anon_rss_kib()
    lengths = {n for _ in range(200) for n in one(True)}
    grown = anon_rss_kib() - before
    threads = [t for t in threading.enumerate() if t.name.startswith("renew-test")]
    pool.shutdown()
    assert len(lengths) == 1 and pool.renewals == 220
    assert grown < 3 * 1024, f"{grown} KiB kept over 200 tokenizers"  # without renewing: ~15,000
    assert len(threads) <= 2 + 2  # the new pool's, and at most the last old pool's, still ending
