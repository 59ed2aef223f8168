"""A one-line progress display for long exports and imports: on a terminal only, quiet otherwise."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(n_bytes)`` as work is done; ``close()`` ends the line. Draws at most 10 times a
    second, and only when ``stream`` is a terminal (or ``enabled=True``)."""

    def __init__(self, what: str, total: int, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.what, self.total, self.done = what, total, 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        rate = self.done / max(now - self.t0, 1e-6) / 1e6
        self.stream.write(f"\r{self.what} [{bar:<30}] {frac:6.1%} {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
                          f"{rate:,.0f} MB/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
