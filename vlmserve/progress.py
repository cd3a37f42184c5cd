"""[any] Progress for long jobs: a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws itself with carriage returns; in a log file, a CI log or a pipe those frames pile
up into one unreadable line. Off a terminal, ``progress`` prints whole lines instead: one when
the job starts, one each time it passes a quarter of its total or ``every_s`` seconds have gone
by, and one when it ends, with the elapsed time. Both speak tqdm's names (``update``,
``set_postfix``, ``write``, iteration), so callers do not care which they got.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, Protocol, TextIO, cast

EVERY_S = 30.0  # off a terminal, at most this long between lines (unless a quarter is passed)
STEPS = 4  # and a line at each quarter of a known total


class Progress(Protocol):
    """The part of tqdm's interface that vlmserve uses; a tqdm bar is one, so is ``LineProgress``."""

    def update(self, n: float = 1) -> Any: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...
    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> Any: ...
    def write(self, s: str, file: TextIO | None = None, end: str = "\n", nolock: bool = False) -> Any: ...
    def refresh(self) -> Any: ...
    def close(self) -> Any: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> Any: ...


def progress(iterable: Iterable[Any] | None = None, *, desc: str = "", total: float | None = None, unit: str = "it",
             file: TextIO | None = None, every_s: float = EVERY_S, **bar: Any) -> Progress:
    """A tqdm bar when ``file`` (stderr by default) is a terminal, else a ``LineProgress``.

    ``bar`` (e.g. ``bar_format``, ``leave``) goes to tqdm only; ``every_s`` to the lines only."""
    file = file or sys.stderr
    if is_tty(file):
        from tqdm import tqdm

        return cast(Progress, tqdm(iterable, desc=desc, total=total, unit=unit, file=file, **bar))
    return LineProgress(iterable, desc=desc, total=total, unit=unit, file=file, every_s=every_s)


def is_tty(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


class LineProgress:
    """tqdm's interface printed as whole lines, never a carriage return: for logs, pipes and CI."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, desc: str = "", total: float | None = None,
                 unit: str = "it", file: TextIO | None = None, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.desc, self.unit, self.every_s, self.clock = desc, unit, every_s, clock
        self.file = file or sys.stderr
        self.n: float = 0
        self.postfix = ""
        self.start = self._last = clock()
        self._quarter = 0
        self._closed = False
        self._say("started" + (f", {_num(self.total)} {unit}" if self.total else ""))

    def update(self, n: float = 1) -> None:
        self.n += n
        self._maybe_say()

    def refresh(self) -> None:
        self._maybe_say()  # a caller that only waits gets a line every ``every_s``

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def write(self, s: str, file: TextIO | None = None, end: str = "\n", nolock: bool = False) -> None:
        _emit(file or sys.stdout, s + end)  # where tqdm.write writes

    def close(self, stopped: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        count = f", {self._count()}" if self.n or self.total else ""
        self._say(f"{'stopped' if stopped else 'done'}{count} in {_duration(self.clock() - self.start)}")

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "LineProgress(iterable) to iterate"
        finished = False
        try:
            for item in self.iterable:
                yield item
                self.update(1)
            finished = True
        finally:
            self.close(stopped=not finished)  # a break or an exception stopped it

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(stopped=kind is not None)

    def _maybe_say(self) -> None:
        now = self.clock()
        quarter = int(STEPS * self.n / self.total) if self.total else 0
        passed = self.total is not None and quarter > self._quarter and self.n < self.total  # the last: close()'s
        if passed or now - self._last >= self.every_s:
            self._quarter = max(quarter, self._quarter)
            self._say(f"{self._count()}, {_duration(now - self.start)}")

    def _count(self) -> str:
        if not self.total:
            return f"{_num(self.n)} {self.unit}"
        return f"{_num(self.n)}/{_num(self.total)} {self.unit} ({100 * self.n / self.total:.0f}%)"

    def _say(self, status: str) -> None:
        self._last = self.clock()
        _emit(self.file, f"{self.desc}: {status}" + (f" - {self.postfix}" if self.postfix else "") + "\n")


def _emit(file: TextIO, text: str) -> None:
    file.write(text)
    file.flush()


def _length(iterable: Iterable[Any] | None) -> float | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def _num(value: float) -> str:
    if isinstance(value, int) or value == int(value):
        return str(int(value))
    return f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"
