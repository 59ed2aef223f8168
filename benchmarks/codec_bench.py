"""Codec micro-benchmark: ckptd ``bplane`` and ``zstd`` against ZipNN, one thread each.

    .venv/bin/python benchmarks/codec_bench.py [--quick] [--reps N] [--json PATH]

For each data set (synthetic N(0, 0.02²) weights and Adam second moments, the real
all-MiniLM-L6-v2 weights) and method: compression ratio (raw ÷ stored), encode and
decode throughput in MB/s of raw bytes (10^6), best and median of ``--reps`` passes over
the whole set. ckptd encodes 4 MiB chunks like the daemon does; ZipNN gets each tensor
whole (it chunks at 256 KiB itself), with ``threads=1``. The methods take turns pass by
pass; every pass verifies the decoded bytes. Decode times include allocating the output
(as a restore does).

ZipNN 0.5.x overwrites the buffer it compresses (even a ``bytes`` object), so it is given
a fresh copy each time, made outside the timed region.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.core import codec

from common import (  # noqa: E402
    MissingBenchDependency,
    fmt,
    machine_info,
    median,
    minilm_weights,
    synthetic_weights,
    table,
    tensor_view,
)


@dataclass
class Dataset:
    name: str
    dtype: torch.dtype
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def datasets(quick: bool) -> list[Dataset]:
    """The inputs: synthetic (size set by ``quick``) and the real MiniLM weights (always whole)."""
    mib = 8 if quick else 32
    n32 = mib * 2**20 // 4
    out = [
        Dataset("synthetic N(0,0.02) weights", torch.bfloat16, [synthetic_weights(mib * 2**20 // 2, torch.bfloat16)]),
        Dataset("synthetic N(0,0.02) weights", torch.float32, [synthetic_weights(n32, torch.float32)]),
        Dataset("synthetic Adam exp_avg_sq", torch.float32, [synthetic_weights(n32, torch.float32, 1, 1e-3) ** 2]),
    ]
    try:
        for dtype in (torch.float32, torch.bfloat16):
            out.append(Dataset("all-MiniLM-L6-v2", dtype, list(minilm_weights(dtype).values())))
    except MissingBenchDependency as e:
        print(f"codec bench: skipping MiniLM: {e}", file=sys.stderr)
    return out


class Method:
    """One codec under test. ``prepare`` runs untimed before each timed ``encode``."""
    name = ""

    def available(self, ds: Dataset) -> str | None:
        """None when the method can run on ``ds``; else why not."""
        return None

    def prepare(self, t: torch.Tensor) -> Any:
        return t

    def encode(self, prepared: Any, ds: Dataset) -> Any:
        raise NotImplementedError

    def stored_bytes(self, encoded: Any) -> int:
        raise NotImplementedError

    def for_decode(self, encoded: Any) -> Any:
        """What decode reads (the stored bytes as they come back from disk); untimed."""
        return encoded

    def decode(self, stored: Any, t: torch.Tensor, ds: Dataset) -> Any:
        """The decoded bytes of ``t`` (anything ``bytes()`` accepts)."""
        raise NotImplementedError


class Ckptd(Method):
    def __init__(self, codec_name: str) -> None:
        self.codec = codec_name
        self.name = f"ckptd {codec_name}"

    def encode(self, t: torch.Tensor, ds: Dataset) -> list[tuple[int, list[Any], codec.ChunkMeta]]:
        raw = tensor_view(t)
        name = codec.choose_codec(ds.dtype_name, self.codec)
        return [(s, *codec.encode_chunk(raw[s: s + n], ds.dtype_name, name))
                for s, n in codec.chunk_ranges(len(raw), codec.DEFAULT_CHUNK_BYTES)]

    def stored_bytes(self, encoded: list[tuple[int, list[Any], codec.ChunkMeta]]) -> int:
        return sum(meta.stored_len for _, _, meta in encoded)

    def for_decode(self, encoded: list[tuple[int, list[Any], codec.ChunkMeta]]) -> list[tuple[int, bytes, Any]]:
        return [(s, b"".join(bytes(p) for p in parts), meta) for s, parts, meta in encoded]

    def decode(self, stored: list[tuple[int, bytes, codec.ChunkMeta]], t: torch.Tensor, ds: Dataset) -> Any:
        out = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
        view = out.numpy().data
        for s, data, meta in stored:
            codec.decode_chunk(data, meta, ds.dtype_name, view[s: s + meta.raw_len])
        return view


class ZipNN(Method):
    name = "zipnn"

    def __init__(self) -> None:
        self._zipnn: Any
        try:
            import zipnn
        except ImportError:
            self._zipnn = None
        else:
            self._zipnn = zipnn
        self._coders: dict[str, Any] = {}

    def available(self, ds: Dataset) -> str | None:
        return None if self._zipnn is not None else "zipnn not installed (pip install -e '.[client,bench]')"

    def _coder(self, ds: Dataset) -> Any:
        if ds.dtype_name not in self._coders:
            self._coders[ds.dtype_name] = self._zipnn.ZipNN(input_format="byte", bytearray_dtype=ds.dtype_name,
                                                            threads=1)
        return self._coders[ds.dtype_name]

    def prepare(self, t: torch.Tensor) -> bytearray:
        return bytearray(tensor_view(t))      # ZipNN overwrites its input: a fresh copy every time

    def encode(self, prepared: bytearray, ds: Dataset) -> bytes:
        return self._coder(ds).compress(prepared)

    def stored_bytes(self, encoded: bytes) -> int:
        return len(encoded)

    def decode(self, stored: bytes, t: torch.Tensor, ds: Dataset) -> Any:
        return self._coder(ds).decompress(stored)


def one_pass(method: Method, ds: Dataset, expected: list[bytes]) -> tuple[float, float, int]:
    """(encode seconds, decode seconds, stored bytes) of one pass over ``ds``; raises if a
    tensor does not round-trip bit-exactly."""
    encoded, enc_s = [], 0.0
    for t in ds.tensors:
        prepared = method.prepare(t)
        t0 = time.perf_counter()
        encoded.append(method.encode(prepared, ds))
        enc_s += time.perf_counter() - t0
    stored = sum(method.stored_bytes(e) for e in encoded)
    readable = [method.for_decode(e) for e in encoded]
    del encoded
    dec_s = 0.0
    for t, data, want in zip(ds.tensors, readable, expected, strict=True):
        t0 = time.perf_counter()
        got = method.decode(data, t, ds)
        dec_s += time.perf_counter() - t0
        if bytes(got) != want:
            raise AssertionError(f"{method.name} does not round-trip {ds.name} {ds.dtype_name}")
    return enc_s, dec_s, stored


def measure(methods: list[Method], ds: Dataset, reps: int) -> list[dict[str, Any]]:
    """Ratio and encode/decode MB/s of each method over ``reps`` passes. The methods take
    turns pass by pass, so a burst of load from elsewhere hits all of them alike."""
    expected = [bytes(tensor_view(t)) for t in ds.tensors]
    runnable = [m for m in methods if not m.available(ds)]
    passes: dict[str, list[tuple[float, float, int]]] = {m.name: [] for m in runnable}
    for _ in range(reps):
        for m in runnable:
            passes[m.name].append(one_pass(m, ds, expected))
    mb = ds.nbytes / 1e6
    rows: list[dict[str, Any]] = []
    for m in methods:
        if m not in runnable:
            rows.append({"method": m.name, "error": m.available(ds)})
            continue
        enc = [p[0] for p in passes[m.name]]
        dec = [p[1] for p in passes[m.name]]
        stored = passes[m.name][-1][2]
        rows.append({"method": m.name, "ratio": ds.nbytes / stored, "stored_bytes": stored,
                     "encode_MBps_best": mb / min(enc), "encode_MBps_median": mb / median(enc),
                     "decode_MBps_best": mb / min(dec), "decode_MBps_median": mb / median(dec)})
    return rows


def run(quick: bool = False, reps: int | None = None, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every data set × method; returns the JSON-able results."""
    torch.set_num_threads(1)
    reps = reps or (2 if quick else 5)
    methods: list[Method] = [Ckptd("bplane"), Ckptd("zstd"), ZipNN()]
    results = []
    for ds in datasets(quick):
        progress(f"codec: {ds.name} {ds.dtype_name} ({ds.nbytes / 2**20:.0f} MiB), {reps} passes of "
                 f"{', '.join(m.name for m in methods)} …")
        results.append({"dataset": ds.name, "dtype": ds.dtype_name, "raw_bytes": ds.nbytes,
                        "tensors": len(ds.tensors), "methods": measure(methods, ds, reps)})
    return {"reps": reps, "threads": 1, "chunk_bytes": codec.DEFAULT_CHUNK_BYTES, "datasets": results}


def _vs(rows: dict[str, dict[str, Any]], key: str) -> str:
    a, b = rows.get("ckptd bplane", {}), rows.get("zipnn", {})
    if key not in a or key not in b:
        return "n/a"
    return f"{a[key] / b[key]:.2f}×"


def to_markdown(res: dict[str, Any]) -> str:
    """Two tables: every method's figures, then ckptd bplane ÷ ZipNN."""
    rows, head = [], []
    for d in res["datasets"]:
        by = {m["method"]: m for m in d["methods"]}
        for m in d["methods"]:
            label = f"{d['dataset']} {d['dtype']} ({d['raw_bytes'] / 2**20:.0f} MiB)"
            if "error" in m:
                rows.append([label, m["method"], m["error"], "", "", "", ""])
                continue
            rows.append([label, m["method"], fmt(m["ratio"], 3), fmt(m["encode_MBps_best"], 0),
                         fmt(m["encode_MBps_median"], 0), fmt(m["decode_MBps_best"], 0),
                         fmt(m["decode_MBps_median"], 0)])
        head.append([f"{d['dataset']} {d['dtype']}", _vs(by, "ratio"), _vs(by, "encode_MBps_best"),
                     _vs(by, "decode_MBps_best")])
    return (f"Single thread, best and median of {res['reps']} passes; MB/s of raw bytes (10^6 B/s).\n\n"
            + table(["data", "method", "ratio", "encode MB/s best", "encode MB/s median", "decode MB/s best",
                     "decode MB/s median"], rows)
            + "\n\nckptd bplane ÷ ZipNN (ratio and best throughput; > 1 means ckptd is ahead):\n\n"
            + table(["data", "ratio", "encode speed", "decode speed"], head))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 MiB synthetic sets and 2 passes")
    p.add_argument("--reps", type=int, default=None, help="passes per measurement (default 5, quick 2)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()
    res = run(a.quick, a.reps)
    res["machine"] = machine_info()
    print(to_markdown(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
