"""[main] Phase 1's thread pool, whose threads are replaced after a model is unloaded.

The Rust ``tokenizers`` library (0.23) keeps each BPE model's word cache in a thread-local map with one
entry per model instance, and nothing removes that entry when the instance is dropped: only the thread's
exit frees it. Phase 1's threads live as long as the server and tokenize with every model's processor
copies (``PromptBuilder`` lends them to any thread), so each model loaded and unloaded left its caches
behind in every pool thread: ~77 KiB per processor copy and thread on a small vocabulary (measured), 35-40
KiB per swap in the soak with every feature on. ``renew`` gives the pool new threads; the old ones finish
what they were given and exit, and their thread-local state goes with them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class RenewablePool(Executor):
    """A ``ThreadPoolExecutor`` that can be given new threads (``renew``) while work goes on."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max_workers, self._prefix = max_workers, thread_name_prefix
        self._lock = threading.Lock()
        self._pool = self._new()
        self.renewals = 0

    def _new(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=self._prefix)

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        with self._lock:
            return self._pool.submit(fn, *args, **kwargs)

    def renew(self) -> None:
        """Work submitted from now on runs on new threads; the old threads end once their queued work is done."""
        with self._lock:
            old, self._pool = self._pool, self._new()
            self.renewals += 1
        old.shutdown(wait=False)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
