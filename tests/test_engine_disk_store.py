"""The disk tier of the prefix caches on real files: restarts, prefix lookups, damaged and foreign
files, LRU by bytes, the directory lock and atomic writes."""

from __future__ import annotations

import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vlmserve.engine.disk_store import SUFFIX, DiskStore, DiskStoreLocked

IDENTITY = {"config": "c0ffee", "weights": "w1", "kv": "bfloat16/16", "vlmserve": "0.1"}
TOKENS = [11, 12, 13, 14, 15, 16]


def _arrays(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((2, 4, 6, 8), dtype=np.float32)
    return [
        keys,
        keys.astype(np.float16).transpose(0, 2, 1, 3),  # not C-contiguous: stored in C order
        (rng.integers(0, 1 << 16, (4, 6), dtype=np.uint32)).astype(np.uint16),  # bfloat16, viewed as uint16
        np.arange(5, dtype=np.int32),
        np.array(7, dtype=np.int64),  # 0-d: a cache offset
        np.zeros((0, 8), dtype=np.float32),
        np.array([True, False]),
    ]


def _open(directory: Path, **kw: Any) -> DiskStore:
    return DiskStore(directory, kw.pop("max_bytes", 1 << 30), kw.pop("identity", IDENTITY), **kw)


@pytest.fixture
def kv_dir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def store(kv_dir: Path) -> Iterator[DiskStore]:
    s = _open(kv_dir)
    yield s
    s.close()


def _put(s: DiskStore, tokens: list[int], seed: int = 0) -> Path:
    s.put(tokens, {"tokens": len(tokens), "layers": ["kv", "rotating"]}, _arrays(seed))
    assert s.flush(5)
    found = s.find(tokens)
    assert found is not None and found[0] == len(tokens)
    return s.directory / f"{found[1]}{SUFFIX}"


def _length(found: tuple[int, str] | None) -> int | None:
    return found[0] if found else None


def _tokens_of(s: DiskStore, found: tuple[int, str] | None) -> list[int] | None:
    got = s.read(found[1]) if found else None
    return got[0] if got else None


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != ".lock")


def test_an_entry_survives_a_restart_exactly(kv_dir: Path) -> None:
    with_meta = {"tokens": len(TOKENS), "layers": ["kv", "rotating"]}
    first = _open(kv_dir)
    path = _put(first, TOKENS)
    first.close()
    second = _open(kv_dir)
    try:
        found = second.find([*TOKENS, 99, 100])
        assert found == (len(TOKENS), path.name.removesuffix(SUFFIX))
        assert second.entry_bytes(found[1]) == path.stat().st_size
        got = second.read(found[1])
        assert got is not None
        tokens, meta, arrays = got
        assert (tokens, meta) == (TOKENS, with_meta)
        for out, want in zip(arrays, _arrays(), strict=True):
            assert (out.dtype, out.shape) == (want.dtype, want.shape)
            assert np.array_equal(out, want)
        stats, size = second.stats(), path.stat().st_size
        assert (stats.entries, stats.bytes, stats.hits, stats.misses, stats.rejected) == (1, size, 1, 0, 0)
        assert stats.read_bytes == size and stats.read_seconds > 0
    finally:
        second.close()


def test_find_takes_the_longest_exact_prefix_and_longer_ok_a_longer_common_one(store: DiskStore) -> None:
    for tokens in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 9, 9, 9], [5, 6, 7]):
        _put(store, tokens)
    before = store.stats()
    assert _tokens_of(store, store.find([1, 2, 3, 4, 5])) == [1, 2, 3, 4]
    assert _length(store.find([1, 2, 3])) == 2
    assert store.find([8, 1, 2]) is None
    assert store.find([]) is None
    found = store.find([1, 2, 3], longer_ok=True)  # [1, 2, 3, 4] and [1, 2, 3, 9, 9, 9] share 3: the smaller file
    assert found is not None and found[0] == 3 and _tokens_of(store, found) == [1, 2, 3, 4]
    found = store.find([1, 2, 3, 9, 9, 7], longer_ok=True)
    assert found is not None and found[0] == 5 and _tokens_of(store, found) == [1, 2, 3, 9, 9, 9]
    assert _length(store.find([1, 2, 3, 4, 8], longer_ok=True)) == 4  # the exact prefix is the longer
    assert _tokens_of(store, store.find([1, 2, 7], longer_ok=True)) == [1, 2]  # and wins a tie: nothing to trim
    assert _length(store.find([5, 6, 7, 8], longer_ok=True)) == 3
    after = store.stats()
    # a hit is a file read back (_tokens_of reads 4); a miss is the caller's to count (``miss``)
    assert (after.hits - before.hits, after.misses - before.misses) == (4, 0)


def _foreign(tmp_path: Path, tokens: list[int]) -> bytes:
    """The same entry as a store of another model writes it."""
    other = _open(tmp_path / "other", identity={**IDENTITY, "config": "another-model"})
    path = _put(other, tokens)
    other.close()
    return path.read_bytes()


DAMAGES: dict[str, Callable[[bytes, bytes], bytes]] = {
    "flipped payload byte": lambda data, _: data[:-100] + bytes([data[-100] ^ 0x10]) + data[-99:],
    "flipped checksum byte": lambda data, _: data[:-1] + bytes([data[-1] ^ 0x01]),
    "truncated": lambda data, _: data[: len(data) - 33],
    "empty": lambda data, _: b"",
    "garbage": lambda data, _: (b"\x00garbage\xff" * len(data))[: len(data)],
    "another format version": lambda data, _: data[:5] + struct.pack("<H", 99) + data[7:],
    "another identity": lambda _, foreign: foreign,
}


@pytest.mark.parametrize("restart", [False, True], ids=["while-open", "at-restart"])
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_bad_file_is_ignored_deleted_and_counted(
    tmp_path: Path, kv_dir: Path, damage: str, restart: bool, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = _foreign(tmp_path, TOKENS)
    s = _open(kv_dir)
    try:
        path = _put(s, TOKENS)
        bad = DAMAGES[damage](path.read_bytes(), foreign)
        if restart:
            s.close()
            path.write_bytes(bad)
            s = _open(kv_dir)
        else:
            path.write_bytes(bad)
        with caplog.at_level(logging.WARNING, "vlmserve.engine.disk_store"):
            found = s.find(TOKENS)
            assert found is None or s.read(found[1]) is None
        assert not path.exists()
        assert (s.stats().rejected, s.stats().entries, s.stats().bytes) == (1, 0, 0)
        assert path.name in caplog.text
        assert _put(s, TOKENS) == path and _tokens_of(s, s.find(TOKENS)) == TOKENS  # the store goes on
    finally:
        s.close()


def test_a_missing_file_is_a_miss_not_an_error(store: DiskStore) -> None:
    path = _put(store, TOKENS)
    path.unlink()
    found = store.find(TOKENS)
    assert found is not None and store.read(found[1]) is None
    assert store.stats().entries == 0 and store.entry_bytes(found[1]) == 0


def test_a_renamed_file_is_never_served_for_the_other_tokens(kv_dir: Path) -> None:
    s = _open(kv_dir)
    try:
        a, b = _put(s, [1, 2, 3], seed=1), _put(s, [4, 5, 6], seed=2)
        shutil.copyfile(a, b)  # a's entry under b's name, while open
        found = s.find([4, 5, 6])
        assert found is not None and s.read(found[1]) is None and not b.exists()
        b = _put(s, [4, 5, 6], seed=2)
        s.close()
        os.replace(a, b)  # and at a restart
        s = _open(kv_dir)
        assert s.find([1, 2, 3]) is None and s.find([4, 5, 6]) is None
        assert s.stats().rejected == 1 and _entries(kv_dir) == []
    finally:
        s.close()


def test_lru_by_bytes_evicts_the_least_recently_used_and_reads_refresh(kv_dir: Path) -> None:
    s = _open(kv_dir)
    size = _put(s, [1] * 8).stat().st_size
    s.close()
    s = _open(kv_dir, max_bytes=2 * size + size // 2)  # fits two entries
    try:
        a, b = s.find([1] * 8), _put(s, [2] * 8)
        assert a is not None and s.read(a[1]) is not None  # a is now newer than b
        c = _put(s, [3] * 8)
        assert s.find([2] * 8) is None and not b.exists()
        assert s.stats().evictions == 1 and s.stats().bytes == 2 * size
        assert s.read(a[1]) is not None and c.exists()  # a is the newest again, and that survives a restart
        s.close()
        s = _open(kv_dir, max_bytes=2 * size + size // 2)
        _put(s, [4] * 8)
        assert s.find([3] * 8) is None and s.find([1] * 8) is not None and len(_entries(kv_dir)) == 2
    finally:
        s.close()


def test_an_entry_larger_than_the_budget_is_not_kept(kv_dir: Path) -> None:
    s = _open(kv_dir, max_bytes=1024)
    try:
        s.put(TOKENS, {}, _arrays())
        assert s.flush(5) and s.find(TOKENS) is None and _entries(kv_dir) == []
    finally:
        s.close()


def test_a_second_store_on_the_directory_is_refused_until_the_first_closes(kv_dir: Path) -> None:
    first = _open(kv_dir)
    with pytest.raises(DiskStoreLocked, match=str(kv_dir)):
        _open(kv_dir)
    with pytest.raises(DiskStoreLocked):  # the refused one's close did not release the first's lock
        _open(kv_dir)
    first.close()
    first.close()  # idempotent
    second = _open(kv_dir)
    second.close()


Held = tuple[threading.Event, list[list[str]]]  # the writer's release, and the directory at each fsync


@pytest.fixture
def held_fsync(kv_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    """Holds the writer inside its fsync until released, noting the directory as it was then."""
    release, seen, real_fsync = threading.Event(), [], os.fsync

    def fsync(fd: int) -> None:
        seen.append(_entries(kv_dir))
        assert release.wait(5)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield release, seen
    release.set()


def test_writes_are_atomic_and_flush_waits_for_them(store: DiskStore, held_fsync: Held) -> None:
    release, seen = held_fsync
    store.put(TOKENS, {}, _arrays())  # returns at once, the writer holds
    assert not store.flush(timeout=0.05) and store.stats().writes_pending == 1
    assert store.find(TOKENS) is None
    release.set()
    assert store.flush(5) and store.stats().writes_pending == 0
    assert [n.startswith(".tmp-") for n in seen[0]] == [True]  # while written, only a temp file existed
    assert [n.endswith(SUFFIX) for n in _entries(store.directory)] == [True]


def test_puts_past_max_pending_bytes_are_dropped(kv_dir: Path, held_fsync: Held) -> None:
    release, _ = held_fsync
    s = _open(kv_dir, max_pending_bytes=3 * sum(a.nbytes for a in _arrays()))
    try:
        for i in range(4):
            s.put([i], {}, _arrays())
        s.put([0], {}, _arrays())  # already queued: skipped, not dropped
        assert s.stats().writes_dropped >= 1
        release.set()
        assert s.flush(5) and s.stats().entries + s.stats().writes_dropped == 4
    finally:
        release.set()
        s.close()


def test_a_failed_write_leaves_nothing_and_the_store_goes_on(store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def failing(fd: int) -> None:
        monkeypatch.setattr(os, "fsync", real_fsync)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing)
    store.put(TOKENS, {}, _arrays())
    assert store.flush(5) and _entries(store.directory) == [] and store.stats().entries == 0
    assert _put(store, TOKENS).exists()


def test_a_stale_temp_file_is_removed_at_start_and_never_indexed(kv_dir: Path) -> None:
    s = _open(kv_dir)
    path = _put(s, TOKENS)
    s.close()
    os.replace(path, kv_dir / ".tmp-abandoned")  # a whole entry, but never renamed into place
    s = _open(kv_dir)
    try:
        assert _entries(kv_dir) == [] and s.find(TOKENS) is None and s.stats().rejected == 0
    finally:
        s.close()


def test_bad_meta_is_refused_on_the_callers_thread(store: DiskStore) -> None:
    with pytest.raises(TypeError):
        store.put(TOKENS, {"not json": object()}, _arrays())
    with pytest.raises(ValueError):
        store.put(TOKENS, {}, [np.array([object()])])
    assert store.flush(1) and store.stats().writes_pending == 0
