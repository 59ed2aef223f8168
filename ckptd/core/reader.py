"""Reading committed steps: listing, the step reader, and ``verify``.

Readers never trust a file: indexes and manifests are size-limited regular files (never a
link, FIFO or device), manifests must match the digest the index recorded, and every chunk's
checksum is checked before it is decoded.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import storage
from .codec import ChunkMeta, checksum, decode_chunk
from .errors import ChecksumError, FormatError
from .names import INDEX_NAME, parse_step_dir_name, rank_data_name, rank_manifest_name, validate_job
from .schema import (
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    TensorEntry,
    digest_bytes,
    parse_index,
    parse_manifest,
)


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


def list_steps(job_path: str) -> list[StepInfo]:
    """Every step directory of a job, oldest first; ``committed`` means index.json is present."""
    try:
        names = os.listdir(job_path)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        step = parse_step_dir_name(name)
        path = os.path.join(job_path, name)
        if step is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        out.append(StepInfo(step, path, os.path.isfile(os.path.join(path, INDEX_NAME))))
    return sorted(out, key=lambda s: s.step)


def latest_committed(job_path: str) -> StepInfo | None:
    committed = [s for s in list_steps(job_path) if s.committed]
    return committed[-1] if committed else None


def split_step_path(step_path: str) -> tuple[str, str, int]:
    """(root, job, step) of ``<root>/<job>/step-N``; raises FormatError for anything else."""
    step_path = os.path.abspath(step_path)
    job_path, name = os.path.split(step_path)
    root, job = os.path.split(job_path)
    step = parse_step_dir_name(name)
    if step is None:
        raise FormatError(f"{step_path}: not a step directory (expected .../<job>/step-<12 digits>)")
    try:
        validate_job(job)
    except ValueError as e:
        raise FormatError(str(e)) from None
    return root, job, step


class StepReader:
    """Reads one committed step: its index, any rank's manifest, tensors chunk by chunk."""

    def __init__(self, step_path: str) -> None:
        self.path = os.path.abspath(step_path)
        _, self.job, self.step = split_step_path(self.path)
        index_path = os.path.join(self.path, INDEX_NAME)
        if not os.path.isfile(index_path):
            raise FormatError(f"{self.path}: not committed (no {INDEX_NAME})")
        self.index = parse_index(_read_small(index_path, MAX_INDEX_BYTES, "the index"), job=self.job, step=self.step)
        self.world_size: int = self.index["world_size"]

    def manifest(self, rank: int) -> Manifest:
        if not 0 <= rank < self.world_size:
            raise FormatError(f"rank {rank} not in step {self.step} (world size {self.world_size})")
        path = os.path.join(self.path, rank_manifest_name(rank))
        data = _read_small(path, MAX_MANIFEST_BYTES, f"the rank {rank} manifest")
        if digest_bytes(data) != self.index["ranks"][rank]["manifest_digest"]:
            raise FormatError(f"{path}: manifest digest does not match index.json")
        return parse_manifest(data, job=self.job, step=self.step, rank=rank)

    def data_path(self, rank: int) -> str:
        return os.path.join(self.path, rank_data_name(rank))

    def open_data(self, rank: int) -> int:
        """A read-only fd of rank ``rank``'s data file: never through a link, never a FIFO or device."""
        path = self.data_path(rank)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:     # ELOOP: a link, refused; ENOENT: a committed step missing its data
            raise FormatError(f"{path}: cannot open the rank {rank} data file: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FormatError(f"{path}: not a regular file")
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
            stored = storage.read_at(fd, file_pos, meta.stored_len)
            decode_chunk(stored, meta, entry.dtype, memoryview(out).cast("B")[raw_pos: raw_pos + meta.raw_len])
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


@dataclass
class Fault:
    file: str
    tensor: str | None
    reason: str

    def __str__(self) -> str:
        where = f"tensor {self.tensor!r} in {self.file}" if self.tensor else self.file
        return f"{where}: {self.reason}"


def verify_step(step_path: str, progress: Callable[[str], None] | None = None) -> list[Fault]:
    """Check every manifest digest and every chunk checksum of a committed step (no decompression)."""
    try:
        reader = StepReader(step_path)
    except (ValueError, OSError) as e:     # FormatError is a ValueError
        return [Fault(os.path.join(step_path, INDEX_NAME), None, str(e))]
    faults: list[Fault] = []
    for rank in range(reader.world_size):
        mpath = os.path.join(reader.path, rank_manifest_name(rank))
        try:
            manifest = reader.manifest(rank)
        except (ValueError, OSError) as e:
            faults.append(Fault(mpath, None, str(e)))
            continue
        dpath = reader.data_path(rank)
        try:
            fd = reader.open_data(rank)
        except (ValueError, OSError) as e:
            faults.append(Fault(dpath, None, str(e)))
            continue
        try:
            for entry in manifest.tensors:
                try:
                    for _, meta, stored in reader.iter_chunks(fd, entry):
                        if checksum(stored) != meta.checksum:
                            raise ChecksumError("chunk checksum mismatch")
                except (ChecksumError, EOFError) as e:
                    faults.append(Fault(dpath, entry.name, str(e)))
        finally:
            os.close(fd)
        if progress:
            progress(f"rank {rank}: {len(manifest.tensors)} tensors checked")
    return faults
