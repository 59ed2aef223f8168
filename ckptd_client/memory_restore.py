"""Restoring from the daemon's memory tier: a copy out of a memfd, no storage read, no decoding.

The restore chain's first source (``sources.DaemonMemory``) asks its daemon (``memory_fetch``,
FORMAT.md): the daemon answers with the rank's held shard — the raw bytes the trainer saved, in a
memfd passed with SCM_RIGHTS, plus its layout, state tree and per-chunk checksums — after checking
that the shard is the one the committed index.json records (its manifest digest). A daemon that lost
it (a replacement node) fetches it from a peer daemon's memory first. Here each tensor is read
straight into the live tensor (``preadv`` from the memfd, a cache-sized piece at a time on the
restore threads: ``held_map``), each piece's bytes fed to its chunk's xxh3 while still in cache,
every chunk's checksum checked, and only then is the state tree applied. Before any of it, the held tree and
layout are checked against the live state as a restore from storage checks them (restore_check.py:
the same step, the same answer): a mismatch raises CheckpointError, nothing written. Anything else
— no daemon, a step not held, a resharding restore or a sharded tensor's piece that is not exactly
a live DTensor's local shard (held_pieces.py serves those), a checksum mismatch — raises
:class:`MemoryUnavailable` with the reason, which the source answers as its "cannot serve, because".
A DTensor state at its saved layout is read here too: each held piece straight into the local shard
it is (``_same_piece``), and the DTensor itself goes into the loaded tree, so applying it copies
nothing. A sharded model and its optimizers given as objects are read through their FQN state dicts
(``fqn_load.read_into``, as a restore from storage reads them: AdamW's state is created first, as
DTensors like the parameters) and loaded back through torch's ``set_*_state_dict``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ckptd.core import protocol
from ckptd.core.errors import FormatError
from ckptd.core.held import HeldMeta
from ckptd.core.names import base_job, is_memory_job
from ckptd.core.schema import TensorLayout
from ckptd.core.tree import decode_tree

from .connection import Exchange
from .dtensor import is_dtensor, local_placement, local_tensor, sharded_model_of
from .errors import CheckpointError, DaemonRefused, Unreachable
from .fqn_load import read_into
from .held_map import HeldMap
from .live_state import fqn_keyed, live_tensors, tree_items
from .reshard import DTYPES, decodable_into, tensor_bytes
from .restore import apply_loaded
from .restore_check import Outcome, check_plain, saved_leaves
from .restore_threads import RestoreThreads

MEMORY, PEER = "memory", "peer"
log = logging.getLogger("ckptd_client")
FETCH_TIMEOUT_S = 300.0       # a replacement node's daemon may first fetch the shard from a peer
TASK_BYTES = 64 << 20         # a restore thread's share of a tensor at a time
SMALL_READS = 256 << 10       # reads this small on average: one thread (more contend for the GIL, see _read_all)


class MemoryUnavailable(Exception):
    """The memory tier cannot serve this restore; the message says why (storage is used).
    ``pieces``: the whole-shard copy cannot, but reading the step as pieces may (held_pieces.py)."""

    def __init__(self, reason: str, pieces: bool = False) -> None:
        super().__init__(reason)
        self.pieces = pieces


class CorruptCopy(MemoryUnavailable):
    """A held copy's chunk failed its checksum: the daemon is asked once more, for a checked copy."""


@dataclass(frozen=True)
class MemoryCopy:
    """A restore served from a held shard: ``source`` is ``memory`` (this node's daemon held it) or
    ``peer`` (its daemon fetched a peer daemon's copy); ``raw_bytes`` were copied; ``outcome``:
    what was restored and what the step lacked."""
    source: str
    raw_bytes: int
    outcome: Outcome = Outcome()


def _read_into(held: HeldMap, t: TensorLayout, out: torch.Tensor, sums: tuple[str, ...], chunk: int, first: int,
               last: int) -> None:
    """Chunks ``first``..``last`` of tensor ``t``: copied from the memfd into ``out``, each
    chunk's checksum checked."""
    view = tensor_bytes(out)
    for i in range(first, last):
        start, end = i * chunk, min((i + 1) * chunk, t.nbytes)
        try:
            digest = held.copy_hashed(t.offset + start, view[start:end])
        except ValueError as e:
            raise MemoryUnavailable(f"held shard: tensor {t.name!r}: {e}") from None
        if digest != sums[i]:
            raise CorruptCopy(f"corrupt: memory copy of tensor {t.name!r}: chunk {i} (bytes {start}..{end}) "
                              "fails its checksum")


def _read_all(held: HeldMap, reads: list[tuple[TensorLayout, torch.Tensor, tuple[str, ...], int, int]], chunk: int,
              threads: int) -> None:
    """Every ``_read_into`` of ``reads``: on ``threads`` restore threads, or in this one when it is 1.
    Each thread takes the next read from one shared list until none is left (a task per read cost a
    future and a hand-off each: ~4 ms of 13 for 108 MiB in 96 tensors); the first error stops them all,
    and so does this thread raising (``restore_threads``: a KeyboardInterrupt too; none writes after).
    Reads of ``SMALL_READS`` or less on average run on this thread alone: each releases the GIL for a
    short ``preadv`` and waits to get it back, so two threads took 85 ms where one took 47 (30 MiB in
    2,048 tensors; 21 against 16 ms at 256 tensors; 6 against 9 ms at 80)."""
    if threads > 1 and sum(min(last * chunk, t.nbytes) - first * chunk for t, _, _, first, last in reads) \
            <= SMALL_READS * len(reads):
        threads = 1
    todo = iter(reads)              # (a list iterator hands each item to one thread: its next() holds the GIL)
    failed: list[BaseException] = []
    with RestoreThreads(threads, "ckptd-memrestore") as pool:     # one thread: ``work`` runs here

        def work() -> None:
            for t, out, sums, first, last in todo:
                if failed or pool.stopping:
                    return
                try:
                    _read_into(held, t, out, sums, chunk, first, last)
                except BaseException as e:
                    failed.append(e)
                    return
        for f in [pool.submit(work) for _ in range(min(max(1, threads), len(reads)))]:
            f.result()
    if failed:
        raise failed[0]


def fetch_held(socket_path: str, job: str, step: int, rank: int,
               world_size: int, verify: bool = False) -> tuple[Exchange, HeldMeta, int, str]:
    """(exchange, meta, memfd, source); the daemon keeps the shard pinned until the exchange is closed.
    ``job``: a job, or the job key of its memory-level steps (``names.memory_job``). ``verify``: the
    copy served before failed its checksums: the daemon checks its own first (a peer's if it is bad)."""
    level = protocol.SaveLevel.MEMORY if is_memory_job(job) else protocol.SaveLevel.STORAGE
    try:
        x = Exchange(socket_path, protocol.MemoryFetch(base_job(job), rank, world_size, step, level.value, verify),
                     timeout=FETCH_TIMEOUT_S, connect_timeout=5.0)
    except Unreachable as e:
        raise MemoryUnavailable(str(e)) from None
    except DaemonRefused as e:
        raise MemoryUnavailable(e.reason[:500]) from None
    except (CheckpointError, FormatError) as e:
        raise MemoryUnavailable(f"memory fetch failed: {e}") from None
    fd = x.reply["_fds"][0]
    try:
        meta = HeldMeta.from_wire(x.reply)
        if (meta.job, meta.step, meta.rank, meta.world_size) != (job, step, rank, world_size):
            raise MemoryUnavailable(f"the daemon answered with another shard ({meta.what})")
        return x, meta, fd, PEER if x.reply.get("source") == PEER else MEMORY
    except BaseException as e:
        os.close(fd)
        x.close()
        if isinstance(e, (CheckpointError, FormatError)):
            raise MemoryUnavailable(f"memory fetch failed: {e}") from None
        raise


def _same_piece(live: Any, t: TensorLayout) -> torch.Tensor | None:
    """The live DTensor's local tensor when it is exactly the held piece ``t`` (same global tensor, same
    region, readable in place), else None (the restore reads the step as pieces instead)."""
    if t.placement is None or not is_dtensor(live):
        return None
    try:
        place = local_placement(live)
    except TypeError:                # padded or otherwise unusual local shards
        return None
    local = local_tensor(live)
    if (place.global_shape, place.offsets) != (tuple(t.placement.global_shape), tuple(t.placement.offsets)) \
            or not decodable_into(local, t.dtype, t.shape):
        return None
    return local


def _check(meta: HeldMeta, layout: dict[str, tuple[TensorLayout, Any]], state: dict[str, Any], strict: bool,
           model: torch.nn.Module | None
           ) -> tuple[dict[Any, Any], list[str], dict[str, torch.Tensor], dict[str, torch.Tensor], Outcome, Any]:
    """(The held subtree of each entry of ``state``, the tensor names to copy, the live DTensors'
    local tensors that are held pieces read in place — a sharded state at its saved layout — the live
    tensors by name, the Outcome, and ``read_into``'s values: beside a sharded ``model`` its state dicts read into.)"""
    items = tree_items(meta.tree)
    if items is None:
        raise MemoryUnavailable("the held state tree is not a dict")
    held = {k: sub for k, sub in items if k in state}
    if model is not None and any(isinstance(state[k], torch.optim.Optimizer) and not fqn_keyed(sub)
                                 for k, sub in held.items()):
        raise MemoryUnavailable("an optimizer saved keyed by index is re-keyed for the sharded model", pieces=True)
    values = read_into(state, held, model)       # beside a sharded model: its FQN state dicts (dtensor.py)
    live, lazy = live_tensors(values)
    leaves = saved_leaves(held)
    names = [name for found in leaves.values() for _, name in found]
    in_place: dict[str, torch.Tensor] = {}
    for name in names:
        t = layout[name][0] if name in layout else None
        if t is None:      # (a replica another rank wrote: a sharded restore reads it from that rank's shard)
            raise MemoryUnavailable(f"tensor {name!r} of the held state tree is not in its layout", pieces=True)
        target = live.get(name)
        if is_dtensor(target):        # its local shard must be exactly the held piece (a 1-rank mesh's: all of it)
            local = _same_piece(target, t)
            if local is None:
                raise MemoryUnavailable(f"tensor {name!r}: the held piece is not this rank's local shard", pieces=True)
            in_place[name] = local
        elif t.placement is not None and tuple(t.placement.global_shape) != tuple(t.shape):
            raise MemoryUnavailable(f"tensor {name!r} is held as a piece of a sharded tensor", pieces=True)
    if any(is_dtensor(v) for path, v in live.items() if path not in in_place):
        raise MemoryUnavailable("a DTensor of the state is not a held piece of this rank", pieces=True)

    def saved(name: str) -> Any:        # a piece read in place is checked as the whole DTensor it belongs to
        t = layout[name][0]
        return SimpleNamespace(dtype=t.dtype, shape=t.placement.global_shape) if name in in_place and t.placement \
            else t
    subtrees, outcome = check_plain(state, items, saved, f"step {meta.step} (held in the daemon's memory)", strict,
                                    (live, lazy, leaves))
    return subtrees, list(dict.fromkeys(names)), in_place, live, outcome, values


def restore_from_memory(socket_path: str, job: str, step: int, rank: int, world_size: int,
                        state: dict[str, Any], threads: int, strict: bool = True) -> MemoryCopy:
    """Load ``step`` into ``state`` from the daemon's memory (see the module docstring): a state at the
    saved world size whose tensors are plain, or DTensors whose local shards are the held pieces. A
    copy that fails its checksums is asked for again, once, checked by the daemon first: it drops a
    corrupt copy of its own for a peer's (the bytes read so far are all written over)."""
    try:
        return _restore_once(socket_path, job, step, rank, world_size, state, threads, strict, False)
    except CorruptCopy as e:
        log.warning("ckptd: %s; asking the daemon for a checked copy", e)
        try:
            return _restore_once(socket_path, job, step, rank, world_size, state, threads, strict, True)
        except MemoryUnavailable as again:
            raise MemoryUnavailable(f"{e}; asked again for a checked copy: {again}", pieces=again.pieces) from None


def _restore_once(socket_path: str, job: str, step: int, rank: int, world_size: int, state: dict[str, Any],
                  threads: int, strict: bool, verify: bool) -> MemoryCopy:
    conn, meta, fd, source = fetch_held(socket_path, job, step, rank, world_size, verify)
    try:
        layout = {t.name: (t, sums) for t, sums in zip(meta.layout, meta.checksums, strict=True)}
        model = sharded_model_of(state)
        wanted, names, in_place, live, outcome, values = _check(meta, layout, state, strict, model)
        tensors: dict[str, torch.Tensor] = {}
        chunk = max(8, meta.chunk_bytes - meta.chunk_bytes % 8)     # as codec.chunk_ranges cuts them
        size = os.fstat(fd).st_size
        if size < meta.nbytes:
            raise MemoryUnavailable(f"held shard is {size} bytes, its layout needs {meta.nbytes}")
        reads: list[tuple[TensorLayout, torch.Tensor, tuple[str, ...], int, int]] = []
        for name in names:
            t, sums = layout[name]
            target = live.get(name)
            if name in in_place:         # read into the DTensor's local shard; the tree gets the DTensor
                out, tensors[name] = in_place[name], live[name]
            else:
                out = target if target is not None and decodable_into(target, t.dtype, t.shape) else \
                    torch.empty(t.shape, dtype=DTYPES[t.dtype])
                tensors[name] = out
            per = max(1, TASK_BYTES // chunk)
            reads += [(t, out, sums, i, min(i + per, len(sums))) for i in range(0, len(sums), per)]
        held = HeldMap(fd, meta.nbytes)
        try:
            _read_all(held, reads, chunk, threads)
        finally:
            held.close()
        try:
            loaded = {k: decode_tree(sub, tensors.__getitem__) for k, sub in wanted.items()}
        except (FormatError, KeyError) as e:
            raise MemoryUnavailable(f"bad held state tree: {e}") from None
    finally:
        os.close(fd)
        conn.close()                 # unpins the shard on the daemon
    apply_loaded(state, loaded, model, strict, values)
    return MemoryCopy(source, sum(t.nbytes for t in meta.layout), outcome)
