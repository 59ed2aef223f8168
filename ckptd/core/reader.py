"""Reading committed steps: listing, the step reader, and ``verify``.

Readers never trust a file: indexes and manifests are size-limited regular files (never a
link, FIFO or device), manifests must match the digest the index recorded and (format 2) agree
with the index's tensor map (``map_check``), and every chunk's checksum is checked before it is
decoded. ``verify_step`` also checks the map's geometry: every sharded tensor tiled exactly.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import storage
from .codec import ChunkMeta, checksum, decode_chunk
from .errors import ChecksumError, FormatError
from .global_index import GlobalTensor, build_tensor_map, parse_tensor_map
from .map_check import MapCheck
from .names import (
    HEAD_NAME,
    INDEX_NAME,
    MEMORY_LEVEL_DIR,
    job_dir,
    memory_job,
    parse_step_dir_name,
    rank_data_name,
    rank_manifest_name,
    validate_job_key,
)
from .rank_table import (
    BLOCK_RANKS,
    MAX_HEAD_BYTES,
    SMALL_INDEX_BYTES,
    IndexHead,
    parse_head,
    read_block,
    read_tensors,
    side_file_faults,
)
from .schema import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    TensorEntry,
    digest_bytes,
    parse_index,
    parse_manifest,
)
from .step_files import committed_or_raise, is_committed, os_reason


def _read_small(path: str, limit: int, what: str) -> bytes:
    """An index or manifest: a regular file (never a link, FIFO or directory) of at most ``limit`` bytes."""
    try:
        return storage.read_limited(path, limit)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise FormatError(f"{path}: cannot read {what}: {reason}") from None




@dataclass
class StepInfo:
    step: int
    path: str
    committed: bool
    unreadable: str | None = None   # why the directory cannot be read (``EACCES: Permission denied``):
    #                                 committed or not is unknown; readers skip it, retention never removes it


def list_steps(job_path: str) -> list[StepInfo]:
    """Every step directory of a job, oldest first; ``committed`` means index.json is present. A step
    whose directory cannot be searched is listed with ``unreadable`` set (and ``committed`` false): one
    bad step never hides the others. A job directory that cannot be read raises OSError (none: [])."""
    try:
        with os.scandir(job_path) as it:
            entries = [(e.name, e.path) for e in it if e.is_dir(follow_symlinks=False)]   # no link, d_type
    except FileNotFoundError:
        return []
    out = []
    for name, path in entries:
        step = parse_step_dir_name(name)
        if step is None:
            continue
        try:
            out.append(StepInfo(step, path, committed_or_raise(path)))
        except OSError as e:
            out.append(StepInfo(step, path, False, os_reason(e)))
    return sorted(out, key=lambda s: s.step)


def memory_level_steps(root: str, job: str) -> list[StepInfo]:
    """The memory-level step directories of ``job`` (``<job>/_memory``), oldest first; none through a
    symlinked ``_memory``: its steps are not this job's to read or remove."""
    path = job_dir(root, memory_job(job))
    return [] if os.path.islink(path) else list_steps(path)


def is_memory_level(step_path: str) -> bool:
    """Whether ``step_path`` is a memory-level step's directory (``<root>/<job>/_memory/step-N``): its
    index and manifests are on disk, its bytes only in the daemons' memory (FORMAT.md)."""
    return os.path.basename(os.path.dirname(os.path.abspath(step_path))) == MEMORY_LEVEL_DIR


def latest_committed(job_path: str) -> StepInfo | None:
    committed = [s for s in list_steps(job_path) if s.committed]
    return committed[-1] if committed else None


class StepsUnreadable(OSError):
    """A restore's step choice met a directory it cannot read where the newest committed step may be:
    ``path``, why (``reason``), and the newest committed step it could read (``readable``, or None)."""

    def __init__(self, path: str, reason: str, readable: int | None) -> None:
        super().__init__(f"{path} cannot be read ({reason})")
        self.path, self.reason, self.readable = path, reason, readable


def newest_committed(job_path: str) -> StepInfo | None:
    """The newest committed step for a restore that names none: ``latest_committed``, but a step
    directory above it that cannot be read (or the job directory) raises StepsUnreadable. It may be
    the newest committed step; taking an older one silently would resume the run from the past (and
    its saves then rank below that step), taking none would start it afresh."""
    try:
        steps = list_steps(job_path)
    except OSError as e:
        raise StepsUnreadable(job_path, os_reason(e), None) from None
    committed = [s for s in steps if s.committed]
    newest = committed[-1] if committed else None
    above = [s for s in steps if s.unreadable is not None and (newest is None or s.step > newest.step)]
    if above:
        raise StepsUnreadable(above[-1].path, above[-1].unreadable or "", None if newest is None else newest.step)
    return newest


def split_step_path(step_path: str) -> tuple[str, str, int]:
    """(root, job, step) of ``<root>/<job>/step-N`` (or ``(root, "<job>/_memory", step)`` of a
    memory-level step's ``<root>/<job>/_memory/step-N``); raises FormatError for anything else."""
    step_path = os.path.abspath(step_path)
    job_path, name = os.path.split(step_path)
    root, job = os.path.split(job_path)
    if job == MEMORY_LEVEL_DIR:
        root, job = os.path.split(root)
        job = f"{job}/{MEMORY_LEVEL_DIR}"
    step = parse_step_dir_name(name)
    if step is None:
        raise FormatError(f"{step_path}: not a step directory (expected .../<job>/step-<12 digits>)")
    try:
        validate_job_key(job)
    except ValueError as e:
        raise FormatError(str(e)) from None
    return root, job, step


class StepReader:
    """Reads one committed step: its index, any rank's manifest, tensors chunk by chunk."""

    def __init__(self, step_path: str) -> None:
        self.path = os.path.abspath(step_path)
        _, self.job, self.step = split_step_path(self.path)
        index_path = os.path.join(self.path, INDEX_NAME)
        if os.path.islink(self.path):      # (as listings and retention skip it: never read through a link)
            raise FormatError(f"{self.path}: a symlink, not a step directory; ckptd never reads through links")
        if not is_committed(self.path):
            raise FormatError(f"{self.path}: not committed (no {INDEX_NAME})")
        self._index: dict[str, Any] | None = None
        self._head: IndexHead | None = None
        self._blocks: dict[int, list[dict[str, Any]]] = {}
        head_path = os.path.join(self.path, HEAD_NAME)
        # A large index is not read whole: its head, the rank's block of the rank table, and the
        # tensor map when needed (rank_table.py); a small one is (one read beats three).
        if os.stat(index_path).st_size > SMALL_INDEX_BYTES and os.path.isfile(head_path):
            self._head = parse_head(_read_small(head_path, MAX_HEAD_BYTES, "the index head"),
                                    job=self.job, step=self.step)
            self.world_size: int = self._head.world_size
            self._format = self._head.format_version
        else:
            self.world_size = self.index["world_size"]
            self._format = int(self.index["format_version"])
        self._map: tuple[dict[str, GlobalTensor], list[str]] | None = None
        self._map_check: MapCheck | None = None

    @property
    def index(self) -> dict[str, Any]:
        """index.json, parsed and checked (read on first use when the reader started from its head)."""
        if self._index is None:
            index_path = os.path.join(self.path, INDEX_NAME)
            self._index = parse_index(_read_small(index_path, MAX_INDEX_BYTES, "the index"),
                                      job=self.job, step=self.step)
        return self._index

    @property
    def format_version(self) -> int:
        return self._format

    def rank_entry(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s entry of the index (``manifest_digest``, ``raw_bytes``, ``stored_bytes``)."""
        if self._head is None:
            entry: dict[str, Any] = self.index["ranks"][rank]
            return entry
        block = rank // BLOCK_RANKS
        if block not in self._blocks:
            self._blocks[block] = read_block(self.path, self._head, block)
        return self._blocks[block][rank % BLOCK_RANKS]

    def tensor_map(self) -> tuple[dict[str, GlobalTensor], list[str]]:
        """(tensor map, per-rank keys): index.json's (format 2: parsed; each manifest read is checked
        against it, its geometry by ``verify_step``), or derived from every rank's manifest (format 1,
        where every tensor is local). Raises FormatError."""
        if self._map is None:
            if self._head is not None and self.format_version >= 2:
                obj = read_tensors(self.path, self._head, MAX_INDEX_BYTES)
                self._map = parse_tensor_map(obj, self.world_size), list(self._head.per_rank_keys)
            elif self.format_version >= 2:
                self._map = parse_tensor_map(self.index["tensors"], self.world_size), list(self.index["per_rank_keys"])
            else:
                self._map = build_tensor_map([self.manifest(r) for r in range(self.world_size)])
        return self._map

    def map_check(self) -> MapCheck:
        """The format-2 tensor map's checker (``map_check.MapCheck``); raises FormatError."""
        if self._map_check is None:
            self._map_check = MapCheck(self.tensor_map()[0], self.world_size)
        return self._map_check

    def manifest(self, rank: int, check_map: bool = True) -> Manifest:
        """Rank ``rank``'s manifest, its digest checked against the index and (format 2, unless
        ``check_map`` is false) its entries against the index's tensor map, both ways."""
        if not 0 <= rank < self.world_size:
            raise FormatError(f"rank {rank} not in step {self.step} (world size {self.world_size})")
        path = os.path.join(self.path, rank_manifest_name(rank))
        data = _read_small(path, MAX_MANIFEST_BYTES, f"the rank {rank} manifest")
        if digest_bytes(data) != self.rank_entry(rank)["manifest_digest"]:
            raise FormatError(f"{path}: manifest digest does not match index.json")
        m = parse_manifest(data, job=self.job, step=self.step, rank=rank)
        if check_map and self.format_version >= 2:
            faults = self.map_check().rank_faults(m)
            if faults:
                more = f" (and {len(faults) - 1} more; ckptd verify lists them)" if len(faults) > 1 else ""
                where = f"tensor {faults[0].tensor!r}: " if faults[0].tensor else ""
                raise FormatError(f"{path}: does not match the index's tensor map: {where}{faults[0].reason}{more}")
        return m

    def data_path(self, rank: int) -> str:
        return os.path.join(self.path, rank_data_name(rank))

    def open_data(self, rank: int) -> int:
        """A read-only fd of rank ``rank``'s data file: never through a link, never a FIFO or device,
        and exactly as long as the index says (its chunks back to back: a truncated file or bytes
        appended after the commit are refused before anything is decoded)."""
        path = self.data_path(rank)
        try:
            fd, st = storage.open_regular(path)
        except OSError as e:     # ELOOP: a link, refused; ENOENT: a committed step missing its data
            raise FormatError(f"{path}: cannot open the rank {rank} data file: {e.strerror}") from None
        except storage.NotRegular as e:
            raise FormatError(str(e)) from None
        expected = self.rank_entry(rank)["stored_bytes"]
        if st.st_size != expected:
            os.close(fd)
            raise FormatError(f"{path}: {st.st_size} bytes, the index says {expected} (truncated or appended to)")
        return fd

    def iter_chunks(self, fd: int, entry: TensorEntry) -> Iterator[tuple[int, ChunkMeta, bytes]]:
        """(raw offset within tensor, meta, stored bytes) for each chunk of one tensor."""
        for file_pos, raw_pos, meta in entry.chunk_spans():
            yield raw_pos, meta, storage.read_at(fd, file_pos, meta.stored_len)

    def read_chunk_into(self, fd: int, entry: TensorEntry, file_pos: int, raw_pos: int, meta: ChunkMeta,
                        out: memoryview) -> None:
        """Read, verify and decode one chunk of ``entry`` into its place in ``out`` (the whole tensor);
        chunks are independent, so callers may run these in parallel."""
        try:
            read_decoded(fd, file_pos, meta, entry.dtype, memoryview(out).cast("B")[raw_pos: raw_pos + meta.raw_len])
        except (ChecksumError, EOFError) as e:
            raise ChecksumError(f"tensor {entry.name!r} in {self._data_file_of(fd)}: {e}") from None

    def read_tensor_into(self, fd: int, entry: TensorEntry, out: memoryview) -> None:
        """Decode one tensor into ``out``; raises ChecksumError naming the tensor and file."""
        for file_pos, raw_pos, meta in entry.chunk_spans():
            self.read_chunk_into(fd, entry, file_pos, raw_pos, meta, out)

    def _data_file_of(self, fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return f"fd {fd}"


def read_decoded(fd: int, file_pos: int, meta: ChunkMeta, dtype: str, out: memoryview,
                 read_at: Callable[[int, int, int], bytes] = storage.read_at) -> int:
    """Read one chunk's stored bytes at ``file_pos`` of data file ``fd``, verify and decode them into
    ``out``; returns the bytes read. A raw chunk read the default way goes straight into ``out`` (one
    copy from the page cache, no buffer) and is checked there: on a mismatch ``out`` holds the bad
    bytes and ChecksumError is raised, as a decode that fails midway leaves its part written."""
    if meta.codec == "none" and read_at is storage.read_at:
        if len(out) != meta.raw_len or meta.segments != [[meta.raw_len, "r"]]:
            raise ChecksumError(f"a 'none' chunk of {meta.raw_len} bytes must be one raw segment into as many")
        storage.read_into(fd, file_pos, out)
        if checksum(out) != meta.checksum:
            raise ChecksumError("chunk checksum mismatch")
        return meta.raw_len
    stored = read_at(fd, file_pos, meta.stored_len)
    decode_chunk(stored, meta, dtype, out)
    return len(stored)


def chunk_faults(fd: int, manifest: Manifest, first_only: bool = False) -> list[tuple[str, str]]:
    """(tensor, reason) for each tensor of ``manifest`` whose stored chunks in ``fd`` (its data file)
    fail their checksum or end past the file; the stored bytes are checked, nothing is decoded."""
    faults = []
    for entry in manifest.tensors:
        for i, (file_pos, _raw_pos, meta) in enumerate(entry.chunk_spans()):
            try:
                stored = storage.read_at(fd, file_pos, meta.stored_len)
            except EOFError as e:
                faults.append((entry.name, f"chunk {i}: {e}"))
                break
            if checksum(stored) != meta.checksum:
                faults.append((entry.name, f"chunk {i} (bytes {file_pos}-{file_pos + meta.stored_len - 1} of the "
                                           "file): chunk checksum mismatch"))
                break
        if faults and first_only:
            break
    return faults


@dataclass
class Fault:
    file: str
    tensor: str | None
    reason: str

    def __str__(self) -> str:
        where = f"tensor {self.tensor!r} in {self.file}" if self.tensor else self.file
        return f"{where}: {self.reason}"


def verify_step(step_path: str, progress: Callable[[str], None] | None = None) -> list[Fault]:
    """Check every manifest digest and every chunk checksum of a committed step (no decompression),
    and a format-2 step's global geometry: the index's tensor map parses, agrees with the manifests,
    and tiles every sharded tensor exactly (``map_check``). A memory-level step (``is_memory_level``)
    has no data files: its index and manifests are checked, its bytes (in the daemons' memory) are not."""
    try:
        reader = StepReader(step_path)
    except (ValueError, OSError) as e:     # FormatError is a ValueError
        return [Fault(os.path.join(step_path, INDEX_NAME), None, str(e))]
    index_path = os.path.join(reader.path, INDEX_NAME)
    held_only = is_memory_level(reader.path)
    faults: list[Fault] = []
    check: MapCheck | None = None
    if reader.format_version >= 2:
        try:
            check = reader.map_check()
            faults += [Fault(index_path, f.tensor, f.reason) for f in check.map_faults()]
        except FormatError as e:
            faults.append(Fault(index_path, None, str(e)))
    try:
        faults += [Fault(index_path, None, f) for f in side_file_faults(reader.path, reader.index)]
    except (ValueError, OSError) as e:
        faults.append(Fault(index_path, None, str(e)))
    for rank in range(reader.world_size):
        mpath = os.path.join(reader.path, rank_manifest_name(rank))
        try:
            manifest = reader.manifest(rank, check_map=False)
        except (ValueError, OSError) as e:
            faults.append(Fault(mpath, None, str(e)))
            continue
        if check:
            faults += [Fault(mpath, f.tensor, f.reason) for f in check.rank(manifest)]
        if held_only:
            if progress:
                progress(f"rank {rank}: manifest checked ({len(manifest.tensors)} tensors; its bytes are in memory)")
            continue
        dpath = reader.data_path(rank)
        try:
            fd = reader.open_data(rank)
        except (ValueError, OSError) as e:
            faults.append(Fault(dpath, None, str(e)))
            continue
        try:
            faults += [Fault(dpath, tensor, reason) for tensor, reason in chunk_faults(fd, manifest)]
        finally:
            os.close(fd)
        if progress:
            progress(f"rank {rank}: {len(manifest.tensors)} tensors checked")
    if check and progress:
        progress(f"tensor map: {len(check.tensors)} tensors checked against the manifests and their geometry")
    return faults
