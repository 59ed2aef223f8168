"""Which way the next shard goes to the disk: through the page cache, or around it (``O_DIRECT``).

A write through the page cache costs a copy on the daemon's CPU (slot → page cache) and then the
disk's writeback; a direct write has the disk read the slot itself, no copy, but each write waits
for the device, and some devices are slower that way. Which is faster differs by disk and by day:
on the 2-core VM the benchmarks run on, 1 GiB went to the disk in 0.25 s direct against 0.43 s
buffered one day, and at 0.4 GB/s direct against 1 GB/s buffered the day before. So with
``direct_io = "auto"`` the daemon measures: it writes shards buffered and direct in turn until it
has ``KEEP`` of each, then keeps to the faster by each way's best of its last ``KEEP``
throughputs, and tries the other way again every ``RETRY`` shards. One sample each was too few:
on the benchmarks' VM a daemon's first large shard took 1.4 s where the next took 0.34 s, and
that one slow start kept it on the other way for the next 16 shards. The way changes only on a
retry, judged by its own sample, which replaces the tried way's older ones: those were taken on
the disk of ``RETRY`` or more shards ago. (Comparing them with the way in use let one from a
daemon's first saves win two 1 GiB shards for the page cache on a day the disk had slowed: 1.09 s
and 0.49 s to durable, where direct took 0.36-0.49 s in the rounds around them.) ``"on"`` /
``"off"`` fix the way. A file system that refuses ``O_DIRECT`` (tmpfs) gets buffered writes
whatever the setting (shard_writer.write_shard).
"""
from __future__ import annotations

import collections
import threading

from ckptd.daemon.settings.write import DIRECT_IO

RETRY = 16           # auto: shards between tries of the way not in use
MIN_BYTES = 64 << 20  # auto: a shard smaller than this tells too little of the disk to count
KEEP = 2             # auto: samples kept per way; a way's rate is the best of them (a slow one is noise)


class WriteWay:
    """The per-tier choice (module docstring); shards may be written on several threads at once."""

    def __init__(self, mode: str) -> None:
        if mode not in DIRECT_IO:
            raise ValueError(f"direct_io must be one of {', '.join(DIRECT_IO)}, got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        # way (direct?) → its last KEEP measured bytes per second
        self._rates: dict[bool, collections.deque[float]] = {w: collections.deque(maxlen=KEEP) for w in (False, True)}
        self._since = 0                         # shards since the other way was last tried
        self._way: bool | None = None           # the way in use once both were measured (direct?)
        self._retry: bool | None = None         # the way being retried: its next sample replaces its old ones

    def pick(self) -> bool:
        """Whether the next shard goes direct."""
        if self.mode != "auto":
            return self.mode == "on"
        with self._lock:
            if self._way is None:
                counts = {way: len(r) for way, r in self._rates.items()}
                if min(counts.values()) < KEEP:     # still measuring: the way with fewer samples, buffered first
                    return counts[True] < counts[False]
                self._way = self._faster()
            self._since += 1
            if self._since >= RETRY:
                self._since = 0
                self._retry = not self._way
                return not self._way
            return self._way

    def record(self, direct: bool, nbytes: int, direct_bytes: int, seconds: float) -> None:
        """A shard written ``direct`` (asked), ``nbytes`` in all, ``direct_bytes`` of them around the
        page cache, in ``seconds``. A direct shard whose bytes mostly went through the page cache
        (encoded chunks, a misaligned layout, a file system without O_DIRECT) says nothing of the
        direct way: not counted."""
        if self.mode != "auto" or nbytes < MIN_BYTES or seconds <= 0 or (direct and 2 * direct_bytes < nbytes):
            return
        with self._lock:
            retried = self._retry is direct
            if retried:
                self._retry = None
                self._rates[direct].clear()
            self._rates[direct].append(nbytes / seconds)
            if retried:
                self._way = self._faster()

    def _faster(self) -> bool:
        """(Under the lock, both ways measured) whether direct's best sample beats buffered's."""
        return max(self._rates[True]) > max(self._rates[False])

    def rates(self) -> dict[str, float]:
        """Each measured way's bytes per second: the best of its last ``KEEP`` samples."""
        with self._lock:
            return {("direct" if way else "buffered"): max(r) for way, r in self._rates.items() if r}

    def view(self) -> dict[str, object]:
        """What ``ckptd status`` shows: the setting and each way's measured raw bytes per second."""
        return {"mode": self.mode, "bytes_per_s": self.rates()}
