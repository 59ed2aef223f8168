"""A shard held in memory (the daemon's memory tier, a peer's replica): what describes its bytes.

The bytes are the rank's raw slot bytes, exactly as the trainer copied them (no codec), so a
restore is a copy. They are tied to the committed step by ``digest``: the SHA-256 of the
rank's manifest, which the step's index.json records (``ranks[r].manifest_digest``); a held
shard is served only while that digest matches the committed index. Their integrity is checked
with xxh3-64 per chunk of raw bytes (``checksums``, the algorithm the format uses for stored
chunks), computed from the slot while the codec read it, and checked again by whoever loads or
receives them. Nothing here is trusted from the wire: :func:`HeldMeta.from_wire` validates names,
layout bounds, sizes and checksum counts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Any

from .codec import HELD_CODEC, ChunkMeta, checksum, chunk_count, chunk_ranges
from .errors import ChecksumError, FormatError
from .names import are_checksums, is_digest, is_rank, is_step, validate_job_key
from .schema import Manifest, TensorEntry, TensorLayout, data_length, parse_layout

MAX_HELD_BYTES = 1 << 40          # one rank's shard; anything larger on the wire is refused
MIN_CHUNK, MAX_CHUNK = 64 * 1024, 1 << 30


def raw_checksums(data: memoryview | bytes, chunk_bytes: int) -> tuple[str, ...]:
    """xxh3-64 (hex) of each ``chunk_bytes`` piece of one tensor's bytes ``data``."""
    view = memoryview(data)
    return tuple(checksum(view[s:s + n]) for s, n in chunk_ranges(len(view), chunk_bytes))


def layout_checksums(data: memoryview, layout: Sequence[TensorLayout],
                     chunk_bytes: int) -> tuple[tuple[str, ...], ...]:
    """Each tensor's chunk checksums, the tensors placed in ``data`` by ``layout``."""
    return tuple(raw_checksums(data[t.offset:t.offset + t.nbytes], chunk_bytes) for t in layout)


def written_checksums(manifest: Manifest, layout: Sequence[TensorLayout],
                      chunk_bytes: int) -> tuple[tuple[str, ...], ...] | None:
    """What ``layout_checksums`` of the slot gives, taken from the manifest the writer made of it
    (each chunk's raw xxh3: its stored one if raw, its ``raw_checksum`` if encoded): the memory tier
    keeps the slot it was written from without hashing it again. None unless every tensor's chunks
    are ``chunk_bytes`` pieces of it with raw checksums."""
    if len(manifest.tensors) != len(layout):
        return None
    one = max(8, chunk_bytes - chunk_bytes % 8)     # a tensor this small is one chunk (as chunk_ranges cuts)
    out: list[tuple[str, ...]] = []
    for entry, t in zip(manifest.tensors, layout, strict=True):
        if t.nbytes <= one:     # (most tensors of a state of thousands: it runs on the daemon's event loop)
            chunks = entry.chunks
            if entry.name != t.name or len(chunks) != 1 or chunks[0].raw_len != t.nbytes:
                return None
            c = chunks[0]
            s = c.raw_checksum or (c.checksum if c.codec == "none" else "")
            if not s:
                return None
            out.append((s,))
            continue
        sizes = [n for _, n in chunk_ranges(t.nbytes, chunk_bytes)]
        if entry.name != t.name or [c.raw_len for c in entry.chunks] != sizes:
            return None
        sums = tuple(c.raw_checksum or (c.checksum if c.codec == "none" else "") for c in entry.chunks)
        if not all(sums):
            return None
        out.append(sums)
    return tuple(out)


def verify(data: memoryview | bytes, checksums: tuple[str, ...], chunk_bytes: int, what: str) -> None:
    """ChecksumError naming the first chunk of one tensor's bytes ``data`` whose checksum differs."""
    view = memoryview(data)
    spans = chunk_ranges(len(view), chunk_bytes)
    if len(spans) != len(checksums):
        raise ChecksumError(f"{what}: {len(checksums)} checksums for {len(spans)} chunks")
    for i, ((s, n), want) in enumerate(zip(spans, checksums, strict=True)):
        if checksum(view[s:s + n]) != want:
            raise ChecksumError(f"{what}: chunk {i} (bytes {s}..{s + n}) fails its checksum: corrupt copy")


@dataclass(frozen=True)
class HeldMeta:
    """Everything about a held shard but its bytes (``nbytes`` of them)."""
    job: str
    step: int
    rank: int
    world_size: int
    digest: str                       # the rank's manifest digest, as index.json records it
    nbytes: int
    chunk_bytes: int
    checksums: tuple[tuple[str, ...], ...]     # per tensor of ``layout``, per chunk
    layout: tuple[TensorLayout, ...]
    tree: Any

    @property
    def what(self) -> str:
        return f"job {self.job!r} step {self.step} rank {self.rank}"

    def verify(self, data: memoryview | bytes) -> None:
        """ChecksumError naming the first chunk of any tensor whose bytes in ``data`` (the shard, laid
        out as ``layout`` says) differ from its checksums."""
        view = memoryview(data)
        for t, sums in zip(self.layout, self.checksums, strict=True):
            verify(view[t.offset:t.offset + t.nbytes], sums, self.chunk_bytes, f"{self.what} tensor {t.name!r}")

    def to_wire(self) -> dict[str, Any]:
        """A dict of its own; the lists in it are built once per shard and shared (every memory fetch
        and peer copy of the shard sends them: 16 ms a time at 8,192 tensors, on the daemon's event
        loop), so a caller reads them and never changes them."""
        return dict(self._wire)

    @cached_property
    def _wire(self) -> dict[str, Any]:
        return {"job": self.job, "step": self.step, "rank": self.rank, "world_size": self.world_size,
                "digest": self.digest, "nbytes": self.nbytes, "chunk_bytes": self.chunk_bytes,
                "checksums": [list(c) for c in self.checksums], "tensors": [t.to_wire() for t in self.layout],
                "tree": self.tree}

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> HeldMeta:
        """Validated; FormatError says what is wrong."""
        try:
            job = validate_job_key(msg.get("job"))
        except (ValueError, TypeError) as e:
            raise FormatError(f"held shard: {e}") from None
        ints: list[int] = []
        for k in ("step", "rank", "world_size", "nbytes", "chunk_bytes"):
            v = msg.get(k)
            if type(v) is not int or v < 0:
                raise FormatError(f"held shard: {k} must be an integer ≥ 0")
            ints.append(v)
        step, rank, world, nbytes, chunk = ints
        if not is_step(step):            # (a step past the bound would fail every later path it names)
            raise FormatError(f"held shard: bad step {step}")
        if not (is_rank(rank, world) and nbytes <= MAX_HELD_BYTES and MIN_CHUNK <= chunk <= MAX_CHUNK):
            raise FormatError(f"held shard: bad rank {rank} / world size {world} / size {nbytes} / chunk {chunk}")
        digest, sums, tensors = msg.get("digest"), msg.get("checksums"), msg.get("tensors")
        if not is_digest(digest):
            raise FormatError("held shard: bad manifest digest")
        if not isinstance(tensors, list):
            raise FormatError("held shard: tensors must be a list")
        try:
            layout = parse_layout(tensors, nbytes)
        except ValueError as e:
            raise FormatError(f"held shard: {e}") from None
        # (each tensor's list of its chunk count, then every checksum in one pass: are_checksums)
        if not (isinstance(sums, list) and len(sums) == len(layout) and all(isinstance(c, list) for c in sums)
                and list(map(len, sums)) == [chunk_count(t.nbytes, chunk) for t in layout]
                and are_checksums(list(chain.from_iterable(sums)))):
            raise FormatError("held shard: checksums do not match its tensors")
        return cls(job, step, rank, world, digest, nbytes, chunk, tuple(tuple(c) for c in sums), tuple(layout),
                   msg.get("tree"))


def span(layout: Sequence[TensorLayout]) -> int:
    """Bytes of a slot a layout uses (its tensors' furthest end)."""
    return max((t.offset + t.nbytes for t in layout), default=0)


def held_manifest(job: str, step: int, rank: int, world_size: int, layout: Sequence[TensorLayout],
                  checksums: Sequence[Sequence[str]], chunk_bytes: int, tree: Any) -> Manifest:
    """A held shard as a rank manifest: one raw ``held`` chunk per ``chunk_bytes`` of each tensor, its
    entry's ``offset`` the tensor's offset in the memfd (so chunk positions are memfd offsets). The
    manifest of a memory-level step's rank (FORMAT.md), and how a restore reads any held shard."""
    entries = []
    for t, sums in zip(layout, checksums, strict=True):
        chunks = [ChunkMeta(HELD_CODEC, n, n, sums[i], [[n, "r"]]) for i, (_, n) in
                  enumerate(chunk_ranges(t.nbytes, chunk_bytes))]
        entries.append(TensorEntry(t.name, t.dtype, list(t.shape), t.offset, chunks, t.placement))
    return Manifest(job, step, rank, world_size, entries, tree, sum(t.nbytes for t in layout), data_length(entries))
