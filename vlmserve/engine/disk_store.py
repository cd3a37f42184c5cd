"""[worker] Disk tier for the prefix caches: KV of token prefixes as checksummed files, LRU by bytes.

No mlx: the worker hands in numpy arrays and JSON-able meta, and the store's own daemon thread writes
them (MLX arrays are thread-local). A file, named by a sha256 of identity and tokens, is
``b"VLMKV" | version u16 | header length u32 | JSON header (identity, tokens, meta, payload length,
array dtypes, shapes, offsets) | pad | arrays, raw C order, 64-aligned | sha256 of all before``.
Only verified content is trusted: a foreign, renamed or damaged file is logged, deleted and counted
in ``rejected``; nothing here raises on a bad file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

MAGIC = b"VLMKV"
FORMAT_VERSION = 1
SUFFIX = ".kv"
_PREFIX = struct.Struct("<5sHI")  # magic, format version, header length
_ALIGN = 64
_DIGEST = 32
_MAX_HEADER = 1 << 28  # a length past this is garbage, not a header to allocate for

Array = npt.NDArray[Any]
Tokens = npt.NDArray[np.int64]


class DiskStoreLocked(RuntimeError):
    """Another DiskStore, most likely another server's, holds the directory."""


class _Corrupt(Exception):
    pass


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    rejected: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_bytes: int = 0
    write_seconds: float = 0.0
    evictions: int = 0
    writes_dropped: int = 0  # puts skipped because the writer was max_pending_bytes behind


@dataclass(slots=True, frozen=True)
class DiskStoreStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    rejected: int  # files ignored as corrupt, truncated or foreign (and deleted)
    read_bytes: int
    read_seconds: float
    written_bytes: int
    write_seconds: float
    writes_pending: int
    evictions: int
    writes_dropped: int = 0
    # the caps, and the memory the writes waiting for the writer thread hold (host copies of their KV)
    limit_bytes: int = 0
    pending_bytes: int = 0
    pending_limit_bytes: int = 0


@dataclass(slots=True)
class _Entry:
    tokens: Tokens  # int64, for a vectorized common-prefix scan
    size: int
    used_ns: int


@dataclass(slots=True, frozen=True)
class _Header:
    tokens: list[int]
    meta: dict[str, Any]
    specs: list[tuple[np.dtype[Any], tuple[int, ...], int]]  # dtype, shape, offset from data_start
    data_start: int


@dataclass(slots=True, frozen=True)
class _Write:
    entry_id: str
    tokens: Tokens
    pieces: list[bytes | memoryview]  # the file but its digest: prefix, header, arrays, padding
    size: int


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _entry_id(identity: Mapping[str, str], tokens: Sequence[int]) -> str:
    digest = hashlib.sha256(json.dumps(dict(identity), sort_keys=True).encode() + b"\0")
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.hexdigest()


def _common(a: Tokens, b: Tokens) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _parse(prefix: bytes, raw: bytes | memoryview, file_size: int, expected: dict[str, str]) -> _Header:
    """The header of a file ``file_size`` long; _Corrupt if foreign or if anything does not add up."""
    magic, version, _ = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise _Corrupt("not a vlmserve KV file")
    if version != FORMAT_VERSION:
        raise _Corrupt(f"format version {version}, this server reads {FORMAT_VERSION}")
    try:
        h = json.loads(bytes(raw))
        identity, meta, payload = dict(h["identity"]), dict(h["meta"]), int(h["payload"])
        tokens = [int(t) for t in h["tokens"]]
        specs = [(np.dtype(s["dtype"]), tuple(int(d) for d in s["shape"]), int(s["offset"])) for s in h["arrays"]]
    except (ValueError, TypeError, KeyError) as e:
        raise _Corrupt(f"bad header ({e})") from None
    if identity != expected:
        raise _Corrupt("written for another model or KV format")
    data_start = _align(_PREFIX.size + len(raw))
    if data_start + payload + _DIGEST != file_size:
        raise _Corrupt(f"{file_size} bytes where the header promises {data_start + payload + _DIGEST}")
    for dtype, shape, offset in specs:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if dtype.hasobject or min(shape, default=0) < 0 or not 0 <= offset <= payload - nbytes:
            raise _Corrupt("bad array spec")
    return _Header(tokens, meta, specs, data_start)


def _read_header(path: Path, expected: dict[str, str]) -> _Header:
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size or _PREFIX.unpack(prefix)[2] > _MAX_HEADER:
            raise _Corrupt("truncated or garbage")
        return _parse(prefix, f.read(_PREFIX.unpack(prefix)[2]), os.fstat(f.fileno()).st_size, expected)


class DiskStore:
    """Prefix KV on disk. The worker calls find/read/put; the store's one daemon thread writes and evicts.

    A successful ``read`` counts a hit; the caller counts a lookup that reads nothing with ``miss``
    (only it knows whether a match was worth reading). ``put`` keeps the arrays as given until written: do
    not mutate them. bfloat16 goes in viewed as uint16 (numpy has none); say so in meta. Queued
    writes are capped at ``max_pending_bytes``: past that a put is dropped rather than hold memory.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, identity: Mapping[str, str],
                 max_pending_bytes: int = 1 << 30) -> None:
        self.directory, self.max_bytes, self.max_pending_bytes = Path(directory), max_bytes, max_pending_bytes
        self.identity = {str(k): str(v) for k, v in identity.items()}
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            msg = f"KV cache directory {self.directory} is in use by another server; give each server its own"
            raise DiskStoreLocked(msg) from None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # flush waits here for _pending to empty
        self._index: dict[str, _Entry] = {}
        self._pending: dict[str, int] = {}  # entry id -> size, until on disk
        self._bytes, self._n, self._closed = 0, _Counters(), False
        self._scan()
        with self._lock:
            evicted = self._evict_locked()  # max_bytes may have shrunk since the last run
        self._unlink(evicted)
        self._queue: queue.Queue[_Write | None] = queue.Queue()
        self._writer = threading.Thread(target=self._run, name="vlmserve-kv-disk", daemon=True)
        self._writer.start()

    def _path(self, entry_id: str) -> Path:
        return self.directory / f"{entry_id}{SUFFIX}"

    def _scan(self) -> None:
        for path in self.directory.iterdir():
            if path.name.startswith(".tmp-"):  # a write cut short; we hold the lock, so no one is writing it
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX:
                try:
                    h = _read_header(path, self.identity)
                    if path.stem != _entry_id(self.identity, h.tokens):
                        raise _Corrupt("its name does not match its tokens")
                    st = path.stat()
                except (OSError, _Corrupt, struct.error) as e:
                    self._reject(path, str(e))
                    continue
                self._index[path.stem] = _Entry(np.asarray(h.tokens, dtype=np.int64), st.st_size, st.st_mtime_ns)
                self._bytes += st.st_size

    def _reject(self, path: Path, reason: str) -> None:
        logger.warning("KV disk cache: ignoring and deleting %s: %s", path, reason)
        path.unlink(missing_ok=True)
        with self._lock:
            self._n.rejected += 1

    def find(self, tokens: Sequence[int], longer_ok: bool = False) -> tuple[int, str] | None:
        """The longest entry that is a prefix of ``tokens``, as (its length, its id); no I/O.

        With ``longer_ok``, an entry sharing a longer common prefix (an entry longer than the
        query, or diverging from it) wins as (common length, id): the caller trims it to that."""
        q = np.asarray(tokens, dtype=np.int64)
        exact, exact_id, common, common_id, common_size = 0, "", 0, "", 0
        with self._lock:
            for entry_id, e in self._index.items():
                n = _common(q, e.tokens)
                if n == len(e.tokens) and n > exact:
                    exact, exact_id = n, entry_id
                elif n < len(e.tokens) and (n > common or (n == common and e.size < common_size)):
                    common, common_id, common_size = n, entry_id, e.size  # the smaller file is cheaper to read
            found = (common, common_id) if longer_ok and common > exact else (exact, exact_id)
            return found if found[0] > 0 else None

    def miss(self) -> None:
        """Count a lookup that read nothing (the caller decides: a match may be too short to be worth it)."""
        with self._lock:
            self._n.misses += 1

    def read(self, entry_id: str) -> tuple[list[int], dict[str, Any], list[Array]] | None:
        """(tokens, meta, arrays) of a verified entry, or None (a bad file is deleted); never raises."""
        with self._lock:
            entry = self._index.get(entry_id)
        if entry is None:
            return None
        path, start = self._path(entry_id), time.perf_counter()
        try:
            data = path.read_bytes()
            tokens, meta, arrays = self._verify(data, entry)
        except Exception as e:  # any bad file is a miss, never a crash
            with self._lock:
                ours = self._index.get(entry_id) is entry  # else evicted or rewritten meanwhile
                if ours:
                    self._bytes -= self._index.pop(entry_id).size
            if ours:
                self._reject(path, f"{type(e).__name__}: {e}")
            return None
        now = time.time_ns()
        with contextlib.suppress(OSError):
            os.utime(path, ns=(now, now))  # the recency survives a restart
        with self._lock:
            entry.used_ns = now
            self._n.hits += 1
            self._n.read_bytes += len(data)
            self._n.read_seconds += time.perf_counter() - start
        return tokens, meta, arrays

    def _verify(self, data: bytes, entry: _Entry) -> tuple[list[int], dict[str, Any], list[Array]]:
        view = memoryview(data)
        if len(data) < _PREFIX.size + _DIGEST or hashlib.sha256(view[:-_DIGEST]).digest() != data[-_DIGEST:]:
            raise _Corrupt("checksum mismatch")
        end = _PREFIX.size + _PREFIX.unpack_from(data)[2]
        h = _parse(data[: _PREFIX.size], view[_PREFIX.size : end], len(data), self.identity)
        if not np.array_equal(np.asarray(h.tokens, dtype=np.int64), entry.tokens):
            raise _Corrupt("holds other tokens than its name says")
        arrays = [  # read-only views into the one buffer read: no second copy
            np.frombuffer(data, dtype, count=int(np.prod(shape)), offset=h.data_start + offset).reshape(shape)
            for dtype, shape, offset in h.specs
        ]
        return h.tokens, h.meta, arrays

    def entry_bytes(self, entry_id: str) -> int:
        """The entry's file size; 0 if it is gone (evicted since ``find``)."""
        with self._lock:
            entry = self._index.get(entry_id)
            return entry.size if entry else 0

    def put(self, tokens: Sequence[int], meta: Mapping[str, Any], arrays: Sequence[Array]) -> None:
        """Queue a write and return; skipped if these exact tokens are stored or queued.

        Raises TypeError/ValueError on the caller's thread for meta that is not JSON or an array of
        objects: those are bugs, while a full disk is only logged by the writer."""
        tokens = [int(t) for t in tokens]
        entry_id = _entry_id(self.identity, tokens)
        with self._lock:
            if not tokens or entry_id in self._index or entry_id in self._pending:
                return  # checked before the header is built: a repeated put costs one hash
        job = self._job(entry_id, tokens, meta, arrays)
        with self._lock:
            if self._closed or job.size > self.max_bytes or entry_id in self._index or entry_id in self._pending:
                return
            if sum(self._pending.values()) + job.size > self.max_pending_bytes:
                self._n.writes_dropped += 1
                return
            self._pending[entry_id] = job.size
            self._queue.put(job)  # under the lock, so close() cannot slip its stop sentinel in before

    def _job(self, entry_id: str, tokens: list[int], meta: Mapping[str, Any], arrays: Sequence[Array]) -> _Write:
        contiguous = [np.ascontiguousarray(a) if not a.flags.c_contiguous else a for a in map(np.asarray, arrays)]
        if any(a.dtype.hasobject for a in contiguous):
            raise ValueError("arrays of Python objects cannot be stored on disk")
        specs, offset, payload = [], 0, list[bytes | memoryview]()
        for a in contiguous:
            specs.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
            pad = _align(a.nbytes) - a.nbytes
            payload += [a.reshape(-1).view(np.uint8).data, b"\0" * pad]  # flat bytes: hashlib and write want 1-D
            offset += a.nbytes + pad
        header = {"identity": self.identity, "tokens": tokens, "meta": dict(meta), "arrays": specs, "payload": offset}
        raw = json.dumps(header, separators=(",", ":")).encode()
        head = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw
        head += b"\0" * (_align(len(head)) - len(head))
        return _Write(entry_id, np.asarray(tokens, dtype=np.int64), [head, *payload], len(head) + offset + _DIGEST)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._write(job)
            except Exception:
                logger.exception("KV disk cache: could not write %s", self._path(job.entry_id))
            finally:
                with self._idle:
                    self._pending.pop(job.entry_id, None)
                    self._idle.notify_all()

    def _write(self, job: _Write) -> None:
        start, path = time.perf_counter(), self._path(job.entry_id)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                digest = hashlib.sha256()
                for chunk in job.pieces:
                    f.write(chunk)
                    digest.update(chunk)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # an entry's name only ever names a whole file (a lost rename is only a miss)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[job.entry_id] = _Entry(job.tokens, job.size, time.time_ns())
            self._bytes += job.size
            self._n.written_bytes += job.size
            self._n.write_seconds += time.perf_counter() - start
            evicted = self._evict_locked()
        self._unlink(evicted)

    def _evict_locked(self) -> list[str]:
        evicted: list[str] = []
        for entry_id, e in sorted(self._index.items(), key=lambda item: item[1].used_ns):
            if self._bytes <= self.max_bytes:
                break
            del self._index[entry_id]
            self._bytes -= e.size
            self._n.evictions += 1
            evicted.append(entry_id)
        return evicted

    def _unlink(self, entry_ids: list[str]) -> None:
        for entry_id in entry_ids:
            self._path(entry_id).unlink(missing_ok=True)  # a reader that has it open still reads it whole

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """Flush, stop the writer and release the directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._queue.put(None)
        self._writer.join()
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return DiskStoreStats(len(self._index), self._bytes, writes_pending=len(self._pending), **asdict(self._n),
                                  limit_bytes=self.max_bytes, pending_bytes=sum(self._pending.values()),
                                  pending_limit_bytes=self.max_pending_bytes)
