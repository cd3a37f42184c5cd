"""[pool] A server-wide budget for image pixels being decoded at once, and memory given back after."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# After a decode this large, freed memory goes back to the system: glibc keeps what a thread's arena
# freed (its mmap threshold rises after each large free), so 189 MB stayed held after one 49 MP image.
TRIM_AFTER_PIXELS = 4_000_000


class DecodeBudget:
    """Pixels being decoded at once, across all pool threads and models. An image larger than the
    whole budget waits until it has the budget to itself; one image is held at a time per thread
    (never several), so two requests can never each hold part of what the other waits for."""

    def __init__(self, pixels: int) -> None:
        if pixels < 1:
            raise ValueError("the decode budget must be at least one pixel")
        self.pixels = pixels
        self._used = 0
        self._changed = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        """Wait until ``pixels`` (at most the whole budget) fit, hold them while the body runs."""
        need = min(max(pixels, 0), self.pixels)
        with self._changed:
            self._changed.wait_for(lambda: self._used + need <= self.pixels)
            self._used += need
        try:
            yield
        finally:
            with self._changed:
                self._used -= need
                self._changed.notify_all()
            if pixels >= TRIM_AFTER_PIXELS:
                give_memory_back()


def give_memory_back() -> None:
    """Return freed heap memory to the system where the C library can: ``malloc_trim`` (glibc),
    ``malloc_zone_pressure_relief`` (macOS). Elsewhere, nothing."""
    if _TRIM is not None:
        _TRIM()


def _find_trim() -> Callable[[], object] | None:
    try:
        if sys.platform == "darwin":
            relief = ctypes.CDLL(ctypes.util.find_library("c")).malloc_zone_pressure_relief
            relief.argtypes, relief.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t
            return lambda: relief(None, 0)
        trim = ctypes.CDLL(None).malloc_trim
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return lambda: trim(0)
    except (OSError, AttributeError):  # not glibc (musl), or no such library
        return None


_TRIM = _find_trim()
