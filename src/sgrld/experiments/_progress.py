"""A tiny progress bar on stderr (no tqdm dependency).

On a terminal the bar redraws in place at most ``min_interval`` seconds apart; otherwise (logs,
pipes, tests) it prints nothing until :meth:`Progress.close`, which writes one summary line, so
captured output stays short.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, "monge") as bar: ... bar.update(n)``.

    Args:
        total: number of units (e.g. sampler steps) expected, > 0.
        label: text shown before the bar.
        stream: where to write (default ``sys.stderr``).
        min_interval: seconds between redraws.
        width: characters of the bar itself.
        enabled: ``False`` silences it completely; ``None`` draws only on a terminal.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        min_interval: float = 0.2,
        width: int = 30,
        enabled: bool | None = None,
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.width = width
        self.done = 0
        self.silent = enabled is False
        isatty = getattr(self.stream, "isatty", None)
        self.live = not self.silent and (enabled is True or bool(isatty and isatty()))
        self._start = time.perf_counter()
        self._last = -float("inf")

    def update(self, n: int = 1) -> None:
        """Add ``n`` finished units and redraw if enough time has passed."""
        self.done = min(self.done + n, self.total)
        now = time.perf_counter()
        if self.live and (now - self._last >= self.min_interval or self.done == self.total):
            self._last = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()

    def _line(self, now: float) -> str:
        frac = self.done / self.total
        filled = round(frac * self.width)
        elapsed = now - self._start
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        bar = "#" * filled + "-" * (self.width - filled)
        return f"{self.label:<10} [{bar}] {100 * frac:5.1f}% {elapsed:6.1f}s (eta {eta:5.1f}s)"

    def close(self) -> None:
        """Finish the line (terminal) or print one summary line (anything else)."""
        if self.silent:
            return
        now = time.perf_counter()
        if self.live:
            self.stream.write("\r" + self._line(now) + "\n")
        else:
            elapsed = now - self._start
            self.stream.write(f"{self.label}: {self.done}/{self.total} in {elapsed:.1f}s\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
