"""A held shard's memfd, read a cache-sized piece at a time with ``preadv`` and hashed as it goes.

Both memory restores (``memory_restore``: a rank's own shard whole; ``held_pieces``: shards as pieces
of a sharded or resharding restore) copy raw chunks out of a memfd the daemon passed and check each
chunk's xxh3. Each piece is read by the kernel straight into its destination (one copy, the GIL
released) and hashed while it is in the CPU's cache. No mapping: mapping the memfd with
``MAP_POPULATE`` and copying out of it measured slower once two ranks restored at once (their page
table fills and unmaps cost ~30 ms per 288 MiB on a 2-core VM: a 4 → 2 reshard from memory took
0.097 s against 0.068 s for the same bytes read with ``preadv`` from the page cache), and on one
thread alone 82 ms against 72 ms for 288 MiB (``benchmarks``: the sharded bench's profile).
"""
from __future__ import annotations

import os

from ckptd.core.codec import checksum_stream

PIECE = 512 << 10             # read and hashed at once: fits a core's L2 cache


class HeldMap:
    """The first ``size`` bytes of memfd ``fd`` (the fd stays the caller's), read on request."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def copy_hashed(self, pos: int, out: memoryview) -> str:
        """Copy ``len(out)`` bytes from ``pos`` into ``out``; the xxh3 (hex) of the bytes copied.
        Raises ValueError for a range outside the shard or a memfd that ends early."""
        n = len(out)
        if pos < 0 or pos + n > self.size:
            raise ValueError(f"bytes {pos}..{pos + n} are outside the {self.size}-byte held shard")
        dst = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        h = checksum_stream()
        for at in range(0, n, PIECE):
            piece = dst[at:at + min(PIECE, n - at)]
            got = 0
            while got < len(piece):            # a read from a memfd is whole unless it ends early
                k = os.preadv(self.fd, [piece[got:]], pos + at + got)
                if k <= 0:
                    raise ValueError(f"the held shard ends at byte {pos + at + got}, its layout needs {pos + n}")
                got += k
            h.update(piece)
        return str(h.hexdigest())

    def close(self) -> None:
        """Nothing to release (the fd is the caller's); kept so callers need not know."""
