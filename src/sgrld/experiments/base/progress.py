"""The funnel's progress bar on stderr: tqdm on a terminal, else one summary line at the end."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

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
        self.done = 0
        self.silent = enabled is False
        isatty = getattr(self.stream, "isatty", None)
        self.live = not self.silent and (enabled is True or bool(isatty and isatty()))
        self._start = time.perf_counter()
        self._bar: tqdm | None = None
        if self.live:
            self._bar = tqdm(
                total=self.total,
                file=self.stream,
                mininterval=min_interval,
                bar_format=f"{label:<10} [{{bar:{width}}}] {{percentage:5.1f}}% {{elapsed}}"
                " (eta {remaining})",
                ascii=" #",
            )

    def update(self, n: int = 1) -> None:
        """Add ``n`` finished units (the bar redraws when enough time has passed)."""
        n = min(n, self.total - self.done)
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Finish the bar (terminal) or print one summary line (anything else)."""
        if self.silent:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            return
        elapsed = time.perf_counter() - self._start
        self.stream.write(f"{self.label}: {self.done}/{self.total} in {elapsed:.1f}s\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
