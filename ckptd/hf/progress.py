"""Progress of long exports and imports: a redrawn bar on a terminal, a line every ~10 s otherwise.

Off a terminal (a batch job's log, ``| tee``) a redrawn bar is unreadable and silence looks
like a hang, so a plain line is printed now and then instead; ``enabled=False`` silences both.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

LINE_INTERVAL_S = 10.0


class Progress:
    """``update(n_bytes)`` as work is done; ``close()`` ends it. On a terminal (or ``enabled=True``)
    a bar redrawn at most 10 times a second; otherwise (``enabled=None``) one line every
    ``interval`` seconds, and a last one at close if any was printed."""

    def __init__(self, what: str, total: int, enabled: bool | None = None, stream: TextIO | None = None,
                 interval: float = LINE_INTERVAL_S) -> None:
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty() if enabled is None else enabled
        self.lines = enabled is None and not self.bar
        self.interval, self.printed = interval, 0
        self.what, self.total, self.done = what, total, 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.bar and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)
        elif self.lines and now - self._last >= self.interval:
            self._last = now
            self._line(now)

    def _numbers(self, now: float) -> tuple[float, str]:
        frac = self.done / self.total if self.total else 1.0
        rate = self.done / max(now - self.t0, 1e-6) / 1e6
        return frac, f"{frac:6.1%} {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB {rate:,.0f} MB/s"

    def _draw(self, now: float) -> None:
        frac, numbers = self._numbers(now)
        self.stream.write(f"\r{self.what} [{'#' * int(frac * 30):<30}] {numbers}")
        self.stream.flush()

    def _line(self, now: float) -> None:
        self.stream.write(f"{self.what}: {self._numbers(now)[1].strip()}, {now - self.t0:.0f}s\n")
        self.stream.flush()
        self.printed += 1

    def close(self) -> None:
        if self.bar:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        elif self.lines and self.printed:
            self._line(time.monotonic())
