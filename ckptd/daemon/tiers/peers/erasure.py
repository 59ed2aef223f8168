"""The parity codec of one stripe: k data rows and p parity rows of equal size (stripes.py says
which node holds which row). P = 1 is XOR (numpy); P >= 2 is Reed-Solomon through pyeclib
(ISA-L's Cauchy matrix, ``isa_l_rs_cauchy``, bundled in pyeclib's wheel). No Galois-field
arithmetic is written here: RS parity comes only from the library's encoder.

Parity is built incrementally, because the data rows of a stripe live on different nodes and
arrive at different times: both codes are linear, so parity row q is the XOR of what each data
row contributes to it, and a row's contribution is what the encoder gives for that row with every
other row zero. A parity holder keeps one zeroed buffer per row it holds and folds each frame
(any byte range of one data row) into it as it arrives; it never holds the data rows. Cost: the
XOR fold is one pass at memory bandwidth; an RS contribution costs the library one whole-stripe
encode per frame (the zero rows are multiplied too), so folding all k rows one by one costs k
times a one-shot encode. Where several rows' frames are at hand, pass them together: one encode
folds them all (all k at once is exactly a one-shot encode). The contribution can also be computed
by the sender (``contribution``), which spreads the RS cost over the data holders and leaves the
parity holder an XOR (``fold_contribution``). benchmarks/bench_parity.py measures all of it.

Call order::

    codec = make_codec(k, p)                                   # XorCodec if p == 1, else ReedSolomonCodec
    parity = bytearray(stripe_size)                            # holder of parity row q: zeros
    codec.fold(parity, q, {j: frame}, offset=o)                # each frame of data row j as it comes
    # or: sender  c = codec.contribution({j: frame})[q];  holder  codec.fold_contribution(parity, c, offset=o)
    # once every byte of every data row is folded once, parity == codec.encode(rows)[q]
    lost = codec.decode({row: piece, ...}, missing=[rows], size=stripe_size)   # any k survivors

Pieces shorter than the stripe are zero-padded (stripes.py: a shard's last piece is short). No
checksums here: a survivor is trusted, so the caller checks every piece against the committed
index before decoding and the decoded pieces after.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from pyeclib.ec_iface import ECDriver

from ckptd.daemon.tiers.peers.stripes import MAX_GROUP

# Anything with the buffer protocol works (a numpy array too: pass memoryview(array) to please a type checker).
Buffer = bytes | bytearray | memoryview
Pieces = Iterator[tuple[int, int, list[np.ndarray]]]      # (start, end, one part per parity row asked)
XOR_CHUNK = 256 << 10        # XOR works through this much at a time: the output stays in L2 while k inputs pass
RS_CHUNK = 32 << 10          # bytes per row per library call: k + p rows of it stay in cache (measured best)
RS_ALIGN = 64                # a call's rows are padded to this: every backend word size divides it
RS_BACKEND = "isa_l_rs_cauchy"   # Cauchy: every k of the k + p rows decode, for any k and p (Vandermonde: not always)


def _bytes_of(buf: Buffer, what: str) -> memoryview:
    """A flat byte view of ``buf`` without copying."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"{what} must be a bytes-like object, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _array(buf: Buffer, what: str, writable: bool = False) -> np.ndarray:
    mv = _bytes_of(buf, what)
    if writable and mv.readonly:
        raise ValueError(f"{what} must be writable (a bytearray, a writable memoryview or array)")
    return np.frombuffer(mv, dtype=np.uint8)


def _target(buf: Buffer, what: str, n: int, offset: int = 0) -> np.ndarray:
    """A writable array over ``buf`` that bytes [offset, offset + n) fit in."""
    d = _array(buf, what, writable=True)
    if offset < 0 or offset + n > len(d):
        raise ValueError(f"{n} bytes at offset {offset} do not fit {what} of {len(d)} bytes")
    return d


def xor_into(dst: Buffer, src: Buffer, offset: int = 0) -> None:
    """dst[offset:offset + len(src)] ^= src, in place, ``XOR_CHUNK`` at a time."""
    s = _array(src, "contribution")
    d = _target(dst, "parity", len(s), offset)
    for a in range(0, len(s), XOR_CHUNK):
        b = min(a + XOR_CHUNK, len(s))
        np.bitwise_xor(d[offset + a: offset + b], s[a:b], out=d[offset + a: offset + b])


class ParityCodec(ABC):
    """k data rows (0..k−1) and p parity rows (k..k+p−1) of one stripe; see the module for the call order.
    Methods that produce bytes write into ``out`` buffers when given (a memfd mapping, say: new memory
    costs a page fault per page on first touch) and into new bytearrays otherwise."""

    def __init__(self, k: int, p: int) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"data rows k must be an integer >= 1, got {k!r}")
        if not isinstance(p, int) or p < 1:
            raise ValueError(f"parity rows p must be an integer >= 1, got {p!r}")
        if k + p > MAX_GROUP:
            raise ValueError(f"k + p must be at most {MAX_GROUP}, got {k} + {p}")
        self.k, self.p = k, p

    def fold(self, parity: Buffer, q: int, frames: Mapping[int, Buffer], offset: int = 0) -> None:
        """Add what the data rows' ``frames`` (row → bytes at ``offset`` of that row) contribute to
        parity row k + ``q`` into ``parity`` (writable, the stripe's size), in place. Fold every byte
        of every data row exactly once: folding twice cancels it out."""
        if not isinstance(q, int) or not 0 <= q < self.p:
            raise ValueError(f"parity row index q must be in [0, {self.p}), got {q!r}")
        views = self._frames(frames)
        dst = _target(parity, "parity", max(len(v) for v in views.values()), offset)
        for a, b, parts in self._pieces(views, (q,)):
            np.bitwise_xor(dst[offset + a: offset + b], parts[0], out=dst[offset + a: offset + b])

    def contribution(self, frames: Mapping[int, Buffer], out: Sequence[Buffer] | None = None) -> list[memoryview]:
        """What ``frames`` (data row → bytes) contribute to each parity row q (list index q), for the
        sender to compute and a holder to ``fold_contribution``; each as long as the longest frame."""
        views = self._frames(frames)
        length = max(len(v) for v in views.values())
        if out is not None and len(out) != self.p:
            raise ValueError(f"out must hold one buffer per parity row: {self.p}, got {len(out)}")
        dst = [_target(o, f"out[{q}]", length) for q, o in enumerate(out)] if out is not None else \
            [np.frombuffer(bytearray(length), np.uint8) for _ in range(self.p)]
        for a, b, parts in self._pieces(views, tuple(range(self.p))):
            for d, part in zip(dst, parts, strict=True):
                d[a:b] = part
        return [d[:length].data for d in dst]

    @staticmethod
    def fold_contribution(parity: Buffer, contribution: Buffer, offset: int = 0) -> None:
        """parity[offset:…] ^= contribution (what ``contribution`` computed for this holder's row)."""
        xor_into(parity, contribution, offset)

    def encode(self, rows: Sequence[Buffer], out: Sequence[Buffer] | None = None) -> list[memoryview]:
        """One shot: the p parity rows of all ``k`` data rows (shorter rows zero-padded)."""
        if len(rows) != self.k:
            raise ValueError(f"encode needs all k = {self.k} data rows, got {len(rows)}")
        return self.contribution(dict(enumerate(rows)), out)

    def decode(self, survivors: Mapping[int, Buffer], missing: Sequence[int], size: int,
               out: Mapping[int, Buffer] | None = None) -> dict[int, memoryview]:
        """The ``missing`` rows (each ``size`` bytes) from the surviving rows of the stripe: at least k
        of them, row → bytes (data or parity; each at most ``size`` bytes, zero-padded to it)."""
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an integer >= 0, got {size!r}")
        n = self.k + self.p
        lost = list(dict.fromkeys(missing))
        if len(lost) != len(missing):
            raise ValueError(f"missing rows repeat: {list(missing)}")
        for r in lost:
            if not isinstance(r, int) or not 0 <= r < n:
                raise ValueError(f"missing row must be in [0, {n}), got {r!r}")
            if r in survivors:
                raise ValueError(f"row {r} is both missing and among the survivors")
        views = {}
        for r, buf in survivors.items():
            if not isinstance(r, int) or not 0 <= r < n:
                raise ValueError(f"survivor row must be in [0, {n}), got {r!r}")
            views[r] = _bytes_of(buf, f"survivor row {r}")
            if len(views[r]) > size:
                raise ValueError(f"survivor row {r} has {len(views[r])} bytes, more than the stripe's {size}")
        if len(lost) > self.p or len(views) < self.k:
            raise ValueError(f"cannot decode: a stripe of k = {self.k} data and p = {self.p} parity rows needs k "
                             f"survivors (at most p lost); got {len(views)} survivors, {len(lost)} rows missing")
        if out is not None and set(out) != set(lost):
            raise ValueError(f"out must hold one buffer per missing row {sorted(lost)}, got rows {sorted(out)}")
        dst = {r: _target(out[r], f"out[{r}]", size) if out is not None else np.frombuffer(bytearray(size), np.uint8)
               for r in lost}
        if lost:
            self._decode(dict(sorted(views.items())[: self.k]), dst, size)   # data rows first: the fast path
        return {r: d[:size].data for r, d in dst.items()}

    def _frames(self, frames: Mapping[int, Buffer]) -> dict[int, memoryview]:
        if not frames:
            raise ValueError("no frames given: pass {data row: bytes}")
        out = {}
        for j, buf in frames.items():
            if not isinstance(j, int) or not 0 <= j < self.k:
                raise ValueError(f"data row must be in [0, {self.k}), got {j!r} (parity rows are not folded)")
            out[j] = _bytes_of(buf, f"frame of data row {j}")
        return out

    @abstractmethod
    def _pieces(self, frames: dict[int, memoryview], qs: tuple[int, ...]) -> Pieces:
        """(a, b, parts): parts[i] is what frames[a:b] contribute to parity row qs[i] (zero-padded
        frames), valid until the next item. Consecutive ranges cover the longest frame."""

    @abstractmethod
    def _decode(self, survivors: dict[int, memoryview], out: dict[int, np.ndarray], size: int) -> None:
        """Write the lost rows (the keys of ``out``) from exactly k validated survivors."""


class XorCodec(ParityCodec):
    """P = 1: parity = data row 0 ^ … ^ data row k−1; any one row is the XOR of the other k."""

    def __init__(self, k: int, p: int = 1) -> None:
        super().__init__(k, p)
        if p != 1:
            raise ValueError(f"XOR carries one parity row; P = {p} needs ReedSolomonCodec")

    def contribution(self, frames: Mapping[int, Buffer], out: Sequence[Buffer] | None = None) -> list[memoryview]:
        """One frame's contribution is the frame itself: returned as is (a view, not a copy) without ``out``."""
        if out is None and len(frames) == 1:
            return list(self._frames(frames).values())
        return super().contribution(frames, out)

    def _pieces(self, frames: dict[int, memoryview], qs: tuple[int, ...]) -> Pieces:
        arrays = [np.frombuffer(v, np.uint8) for v in frames.values()]
        length = max(len(a) for a in arrays)
        scratch = np.empty(min(XOR_CHUNK, length), np.uint8) if len(arrays) > 1 else None
        for a in range(0, length, XOR_CHUNK):
            b = min(a + XOR_CHUNK, length)
            if scratch is None:
                yield a, b, [arrays[0][a:b]] * len(qs)
                continue
            acc = scratch[: b - a]
            acc.fill(0)
            for x in arrays:
                part = x[a:b]
                np.bitwise_xor(acc[: len(part)], part, out=acc[: len(part)])
            yield a, b, [acc] * len(qs)

    def _decode(self, survivors: dict[int, memoryview], out: dict[int, np.ndarray], size: int) -> None:
        (dst,) = out.values()
        arrays = [np.frombuffer(v, np.uint8) for v in survivors.values()]
        for a in range(0, size, XOR_CHUNK):
            b = min(a + XOR_CHUNK, size)
            acc = dst[a:b]
            acc.fill(0)
            for x in arrays:
                part = x[a:b]
                np.bitwise_xor(acc[: len(part)], part, out=acc[: len(part)])


class ReedSolomonCodec(ParityCodec):
    """P >= 2 (P = 1 works too, though XorCodec is the faster code for it): RS over GF(2⁸) through
    pyeclib's ``backend``. Every node of a group must use the same backend: the parity bytes differ."""

    def __init__(self, k: int, p: int, backend: str = RS_BACKEND, chunk: int = RS_CHUNK) -> None:
        super().__init__(k, p)
        if chunk < RS_ALIGN or chunk % RS_ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {RS_ALIGN}, got {chunk}")
        self.backend, self.chunk = backend, chunk
        self.driver = ECDriver(k=k, m=p, ec_type=backend)
        self.zeros = bytes(k * chunk)
        self.headers: dict[int, list[bytes]] = {}
        # liberasurecode mallocs every call's k + p fragments. Above glibc's mmap threshold (128 KiB
        # until a larger mmapped block is freed) each call would map fresh pages and fault them in:
        # 5x slower measured. Freeing one block larger than a call's fragments raises the threshold
        # past them, as glibc does by itself once a process frees large buffers.
        bytes(max(1 << 20, 2 * (k + p) * (chunk + 4096)))

    def _header(self, c: int) -> list[bytes]:
        """The library's fragment headers for rows of ``c`` bytes (size, index, backend; no data
        checksum): what encode puts before each row, so raw rows can be handed back to decode."""
        h = self.headers.get(c)
        if h is None:
            frags = self.driver.encode(self.zeros[: self.k * c])
            hl = len(frags[0]) - c
            if any(len(f) != hl + c for f in frags):
                raise RuntimeError(f"{self.backend}: fragments of {c}-byte rows are not {c} bytes plus a header")
            h = self.headers[c] = [f[:hl] for f in frags]
        return h

    def _calls(self, length: int) -> Iterator[tuple[int, int, int]]:
        """(start, end, padded row size) of each library call over ``length`` bytes."""
        for a in range(0, length, self.chunk):
            b = min(a + self.chunk, length)
            yield a, b, -(-(b - a) // RS_ALIGN) * RS_ALIGN

    def _pieces(self, frames: dict[int, memoryview], qs: tuple[int, ...]) -> Pieces:
        empty = memoryview(b"")
        for a, b, c in self._calls(max(len(v) for v in frames.values())):
            hl = len(self._header(c)[0])
            parts: list[Buffer] = []
            for j in range(self.k):
                row = frames.get(j, empty)[a:b]          # a row absent or ended before a: all zeros
                parts += [row, self.zeros[: c - len(row)]]
            frags = self.driver.encode(b"".join(parts))
            yield a, b, [np.frombuffer(frags[self.k + q], np.uint8, b - a, hl) for q in qs]

    def _decode(self, survivors: dict[int, memoryview], out: dict[int, np.ndarray], size: int) -> None:
        data_lost = [r for r in out if r < self.k]
        parity_lost = sorted(r for r in out if r >= self.k)     # reconstruct answers in row order
        for a, b, c in self._calls(size):
            hdr = self._header(c)
            frags = []
            for r, v in survivors.items():
                row = v[a:b]
                frags.append(b"".join((hdr[r], row, self.zeros[: c - len(row)])))
            if data_lost:
                whole = np.frombuffer(self.driver.decode(frags), np.uint8)
                for r in data_lost:
                    out[r][a:b] = whole[r * c: r * c + b - a]
            if parity_lost:
                hl = len(hdr[0])
                for r, f in zip(parity_lost, self.driver.reconstruct(frags, list(parity_lost)), strict=True):
                    out[r][a:b] = np.frombuffer(f, np.uint8, b - a, hl)


def make_codec(k: int, p: int) -> ParityCodec:
    """The codec for ``k`` data and ``p`` parity rows: XOR for p = 1, Reed-Solomon (ISA-L) above."""
    return XorCodec(k) if p == 1 else ReedSolomonCodec(k, p)
