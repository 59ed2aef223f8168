"""Restoring from the daemon's memory tier: a copy out of a memfd, no storage read, no decoding.

``Checkpointer.restore`` asks its daemon first (``memory_fetch``, FORMAT.md): the daemon answers
with the rank's held shard — the raw bytes the trainer saved, in a memfd passed with SCM_RIGHTS,
plus its layout, state tree and per-chunk checksums — after checking that the shard is the one
the committed index.json records (its manifest digest). A daemon that lost it (a replacement
node) fetches it from a peer daemon's memory first. Here each tensor is read straight into the
live tensor (``preadv`` from the memfd: one kernel copy, no page-table setup for a mapping), every
chunk's xxh3 checksum is checked, and only then is the state tree applied. Anything else —
no daemon, a step not held, a resharding restore, a DTensor state, a checksum mismatch — raises
:class:`MemoryUnavailable` with the reason, and the caller reads storage.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.core import protocol
from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.core.held import HeldMeta, verify
from ckptd.core.schema import TensorLayout
from ckptd.core.tree import decode_tree, join_path

from .dtensor import is_dtensor
from .live_state import live_tensors, tensor_leaves, tree_items
from .reshard import DTYPES, decodable_into, tensor_bytes
from .restore import _apply

MEMORY, PEER, STORAGE = "memory", "peer", "storage"
TASK_BYTES = 64 << 20         # a restore thread's share of a tensor at a time


class MemoryUnavailable(Exception):
    """The memory tier cannot serve this restore; the message says why (storage is used)."""


@dataclass(frozen=True)
class RestoreInfo:
    """How the last ``restore`` went: ``source`` is ``memory`` (this node's daemon), ``peer`` (a
    peer daemon's copy, through this node's daemon) or ``storage``; ``fallback`` says why memory
    was not used."""
    step: int
    source: str
    seconds: float
    raw_bytes: int = 0
    fallback: str | None = None


def _read_into(fd: int, t: TensorLayout, view: memoryview, sums: tuple[str, ...], chunk: int, first: int,
               last: int) -> None:
    """Chunks ``first``..``last`` of tensor ``t``: each read from the memfd into ``view`` (the live
    tensor's bytes) and checksummed at once, while it is still in the CPU's cache."""
    for i in range(first, last):
        s = i * chunk
        n = min(chunk, t.nbytes - s)
        got = 0
        while got < n:
            k = os.preadv(fd, [view[s + got:s + n]], t.offset + s + got)
            if k <= 0:
                raise MemoryUnavailable(f"held shard ended early at tensor {t.name!r}")
            got += k
        try:
            verify(view[s:s + n], sums[i:i + 1], chunk, f"memory copy of tensor {t.name!r} chunk {i}")
        except ChecksumError as e:
            raise MemoryUnavailable(f"corrupt: {e}") from None


def _fetch(socket_path: str, job: str, step: int, rank: int, world_size: int) -> tuple[Any, HeldMeta, int, str]:
    """(connection, meta, memfd, source); the daemon keeps the shard pinned while the connection is open."""
    try:
        sock = protocol.connect(socket_path, timeout=5.0)
    except ConnectionError as e:
        raise MemoryUnavailable(str(e)) from None
    try:
        sock.settimeout(300.0)          # a replacement node may first fetch the shard from a peer
        protocol.send_frame(sock, protocol.to_wire(protocol.MemoryFetch(job, rank, world_size, step), 1))
        rx = protocol.FrameReceiver(sock)
        reply = rx.read()
        if reply is None or reply.get("op") != "ok":
            raise MemoryUnavailable(str((reply or {}).get("reason", "the daemon closed the connection"))[:500])
        fd = rx.take_fds(1)[0]
        meta = HeldMeta.from_wire(reply)
        if (meta.job, meta.step, meta.rank, meta.world_size) != (job, step, rank, world_size):
            os.close(fd)
            raise MemoryUnavailable(f"the daemon answered with another shard ({meta.what})")
        source = PEER if reply.get("source") == PEER else MEMORY
        return sock, meta, fd, source
    except (OSError, ProtocolError, FormatError) as e:
        sock.close()
        raise MemoryUnavailable(f"memory fetch failed: {e}") from None
    except BaseException:
        sock.close()
        raise


def restore_from_memory(socket_path: str, job: str, step: int, rank: int, world_size: int,
                        state: dict[str, Any], threads: int) -> RestoreInfo:
    """Load ``step`` into ``state`` from the daemon's memory (see the module docstring)."""
    started = time.monotonic()
    live, lazy = live_tensors(state)
    if any(is_dtensor(t) for t in live.values()):
        raise MemoryUnavailable("a sharded (DTensor) state restores from storage")
    sock, meta, fd, source = _fetch(socket_path, job, step, rank, world_size)
    try:
        layout = {t.name: (t, sums) for t, sums in zip(meta.layout, meta.checksums, strict=True)}
        items = tree_items(meta.tree)
        if items is None:
            raise MemoryUnavailable("the held state tree is not a dict")
        wanted = [(k, sub) for k, sub in items if k in state]
        leaves: list[tuple[str, str]] = []
        for k, sub in wanted:
            tensor_leaves(sub, join_path("", k), leaves)
        names, saved = [name for _, name in leaves], {path for path, _ in leaves}
        if any(p not in saved and not any(p.startswith(x) for x in lazy) for p in live):
            raise MemoryUnavailable("the state has tensors the held step lacks")
        tensors: dict[str, torch.Tensor] = {}
        chunk = max(8, meta.chunk_bytes - meta.chunk_bytes % 8)     # as codec.chunk_ranges cuts them
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptd-memrestore") as pool:
            futures = []
            for name in dict.fromkeys(names):
                if name not in layout:
                    raise MemoryUnavailable(f"tensor {name!r} of the held state tree is not in its layout")
                t, sums = layout[name]
                target = live.get(name)
                out = target if target is not None and decodable_into(target, t.dtype, t.shape) else \
                    torch.empty(t.shape, dtype=DTYPES[t.dtype])
                tensors[name] = out
                view, per_task = tensor_bytes(out), max(1, TASK_BYTES // chunk)
                futures += [pool.submit(_read_into, fd, t, view, sums, chunk, i, min(i + per_task, len(sums)))
                            for i in range(0, len(sums), per_task)]
            for f in futures:
                f.result()
        try:
            loaded = {k: decode_tree(sub, tensors.__getitem__) for k, sub in wanted}
        except (FormatError, KeyError) as e:
            raise MemoryUnavailable(f"bad held state tree: {e}") from None
    finally:
        os.close(fd)
        sock.close()                 # unpins the shard on the daemon
    _apply(state, loaded, None)
    return RestoreInfo(step, source, time.monotonic() - started, sum(t.nbytes for t in meta.layout))
