"""Parity codec throughput per core, and the memory / bytes-sent arithmetic of docs/erasure-coding.md.

One thread, pieces of ``--mib`` MiB (default 64), every buffer touched before it is timed (a first
touch costs a page fault per page: not the codec's cost), medians of ``--rounds`` rounds:

- XOR (P = 1, ckptd's XorCodec): a parity holder's fold (parity ^= piece), and the decode of one
  lost row from the k others.
- Reed-Solomon through ckptd's ReedSolomonCodec (pyeclib): ``isa_l_rs_cauchy`` (the daemon's choice)
  and ``liberasurecode_rs_vand`` (portable C, no SIMD), P = 2: one-shot encode of all k rows, the
  fold of one row (what a parity holder pays per row received: one whole-stripe library call per
  frame), and the decode of P lost data rows.
- ``zfec`` (when installed; GPL, so a comparison only): one-shot encode and decode through its own API.

Then, for S = 80 GB per node: extra memory and bytes sent per checkpoint for K = 1 copy and for
parity G = 4 / 8, P = 1 / 2, by the design's formulas and as laid out by ckptd.daemon.tiers.peers.
stripes (page-aligned pieces), with the core-seconds the measured throughputs imply.
Writes benchmarks/results/parity.md and .json. Every result is checked bit-exact outside the timing.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.daemon.tiers.peers import stripes  # noqa: E402
from ckptd.daemon.tiers.peers.erasure import ReedSolomonCodec, XorCodec  # noqa: E402

from common import RESULTS, fmt, machine_info, median, table, write_results  # noqa: E402

GB = 1e9
S_NODE = 80 * 10**9            # the design's node: 8 GPUs, 80 GB of shards


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``rounds`` calls after one warm-up."""
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return median(out)


def touched(n: int, rng: np.random.Generator | None = None) -> np.ndarray:
    a = rng.integers(0, 256, n, dtype=np.uint8) if rng is not None else np.ones(n, np.uint8)
    if rng is None:
        a.fill(0)
    return a


def bench_xor(k: int, size: int, rounds: int, rng: np.random.Generator) -> dict[str, float]:
    codec = XorCodec(k)
    rows = [touched(size, rng) for _ in range(k)]
    parity, out = touched(size), touched(size)
    for j in range(k):
        codec.fold(parity.data, 0, {j: rows[j].data})
    survivors = {j: rows[j].data for j in range(1, k)} | {k: parity.data}
    codec.decode(survivors, [0], size, out={0: out.data})
    assert np.array_equal(out, rows[0])
    fold = timed(lambda: codec.fold(parity.data, 0, {1: rows[1].data}), rounds)
    dec = timed(lambda: codec.decode(survivors, [0], size, out={0: out.data}), rounds)
    return {"fold_gbs": size / fold / GB, "decode_out_gbs": size / dec / GB, "decode_in_gbs": k * size / dec / GB}


def bench_rs(backend: str, k: int, p: int, size: int, rounds: int, rng: np.random.Generator) -> dict[str, float]:
    codec = ReedSolomonCodec(k, p, backend=backend)
    rows = [touched(size, rng) for _ in range(k)]
    par = [touched(size) for _ in range(p)]
    outs = {r: touched(size) for r in range(p)}
    codec.encode([r.data for r in rows], out=[x.data for x in par])
    folded = touched(size)
    for j in range(k):
        codec.fold(folded.data, 0, {j: rows[j].data})
    assert np.array_equal(folded, par[0])
    survivors = {j: rows[j].data for j in range(p, k)} | {k + q: par[q].data for q in range(p)}
    codec.decode(survivors, list(range(p)), size, out={r: outs[r].data for r in range(p)})
    assert all(np.array_equal(outs[r], rows[r]) for r in range(p))
    enc = timed(lambda: codec.encode([r.data for r in rows], out=[x.data for x in par]), rounds)
    fold = timed(lambda: codec.fold(folded.data, 0, {1: rows[1].data}), rounds)
    dec = timed(lambda: codec.decode(survivors, list(range(p)), size, out={r: outs[r].data for r in range(p)}),
                rounds)
    return {"encode_gbs": k * size / enc / GB, "fold_gbs": size / fold / GB,
            "decode_out_gbs": p * size / dec / GB, "decode_in_gbs": k * size / dec / GB}


def bench_zfec(k: int, p: int, size: int, rounds: int, rng: np.random.Generator) -> dict[str, float] | None:
    try:
        zfec: Any = importlib.import_module("zfec")
    except ImportError:
        return None
    rows = [touched(size, rng).tobytes() for _ in range(k)]
    enc, dec = zfec.Encoder(k, k + p), zfec.Decoder(k, k + p)
    par = enc.encode(rows, list(range(k, k + p)))
    nums = list(range(p, k + p))
    blocks = rows[p:] + list(par)
    assert [bytes(b) for b in dec.decode(blocks, nums)[:p]] == rows[:p]
    te = timed(lambda: enc.encode(rows, list(range(k, k + p))), rounds)
    td = timed(lambda: dec.decode(blocks, nums), rounds)
    return {"encode_gbs": k * size / te / GB, "decode_in_gbs": k * size / td / GB, "decode_out_gbs": p * size / td / GB}


def layout_rows(xor: dict[int, dict[str, float]], rs: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """Memory and bytes sent per node per checkpoint for S_NODE, by formula and by the stripe layout."""
    out: list[dict[str, Any]] = [{"scheme": "copies K = 1", "mem_formula": S_NODE, "mem_layout": S_NODE,
                                  "sent_formula": S_NODE, "sent_layout": S_NODE,
                                  "survives": "1 loss (not node + target)", "core_s": 0.0}]
    for g, p in ((4, 1), (4, 2), (8, 1), (8, 2)):
        k = g - p
        sizes = [S_NODE] * g
        mem = sum(stripes.stripe_size(sizes, g, p, s) for s in stripes.parity_stripes(g, p, 0))
        cut = stripes.cut(S_NODE, g, p, 0)
        sent = p * sum(x.length for x in cut.pieces)          # each data piece to its stripe's P holders
        # CPU per node per checkpoint: P = 1 folds S bytes of XOR; P >= 2 computes its pieces'
        # contributions (one fold-rate pass over S) and its holders XOR P·S bytes.
        fold = (xor.get(k) or {}).get("fold_gbs") if p == 1 else (rs.get(k) or {}).get("fold_gbs")
        xor_rate = (xor.get(g - 1) or next(iter(xor.values()))).get("fold_gbs", 0.0)
        core_s = (S_NODE / GB / fold + (0 if p == 1 else p * S_NODE / GB / xor_rate)) if fold else float("nan")
        out.append({"scheme": f"parity G = {g}, P = {p}", "mem_formula": p * S_NODE / k, "mem_layout": mem,
                    "sent_formula": p * S_NODE, "sent_layout": sent, "survives": f"{p} loss{'es' if p > 1 else ''} "
                    "per group", "core_s": core_s})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="piece size in MiB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    info = machine_info()
    for dist in ("pyeclib", "zfec"):
        try:
            info["versions"][dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][dist] = "not installed"
    size, rng = args.mib << 20, np.random.default_rng(0)
    xor = {g - 1: bench_xor(g - 1, size, args.rounds, rng) for g in (4, 8)}
    rs = {backend: {g - 2: bench_rs(backend, g - 2, 2, size, args.rounds, rng) for g in (4, 5, 8)}
          for backend in ("isa_l_rs_cauchy", "liberasurecode_rs_vand")}
    zf = {g - 2: bench_zfec(g - 2, 2, size, args.rounds, rng) for g in (4, 8)}
    lay = layout_rows(xor, rs["isa_l_rs_cauchy"])
    wall = time.perf_counter() - t0
    res = {"machine": info, "piece_mib": args.mib, "rounds": args.rounds, "xor": xor, "rs": rs, "zfec": zf,
           "layout": lay, "wall_s": wall}

    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    v = info["versions"]
    md = ["# ckptd parity codec benchmark\n",
          f"Generated by `benchmarks/bench_parity.py` (`make bench-parity`) on {when} in {wall:.0f} s. Machine: "
          f"{info['cpu']}, {info['cores_available']} cores available (a shared VM), {info['ram_gib']} GiB RAM, "
          f"Linux {info['kernel']}, Python {v['python']}, numpy {v['numpy']}, pyeclib {v['pyeclib']} (its wheel's "
          f"liberasurecode and ISA-L), zfec {v['zfec']}; load average at start "
          f"{', '.join(f'{x:.2f}' for x in info['loadavg_at_start'])}.\n",
          f"One thread; pieces of {args.mib} MiB; every buffer touched before timing; median of {args.rounds} "
          "rounds after a warm-up; every result checked bit-exact. GB/s = 10⁹ bytes a second.\n",
          "## Throughput per core\n"]
    rows: list[list[str]] = []
    for k, r in xor.items():
        rows.append(["XOR (ckptd XorCodec)", f"G = {k + 1}, P = 1", "n/a (fold is the encode)", fmt(r["fold_gbs"], 2),
                     f"{fmt(r['decode_out_gbs'], 2)} out / {fmt(r['decode_in_gbs'], 2)} in"])
    for backend, per in rs.items():
        for k, r in per.items():
            rows.append([f"RS `{backend}` (ckptd ReedSolomonCodec)", f"G = {k + 2}, P = 2", fmt(r["encode_gbs"], 2),
                         fmt(r["fold_gbs"], 2), f"{fmt(r['decode_out_gbs'], 2)} out / {fmt(r['decode_in_gbs'], 2)} in"])
    for k, z in zf.items():
        rows.append(["RS zfec (its own API)", f"G = {k + 2}, P = 2", fmt(z["encode_gbs"], 2) if z else "not installed",
                     "n/a", f"{fmt(z['decode_out_gbs'], 2)} out / {fmt(z['decode_in_gbs'], 2)} in" if z else "n/a"])
    md.append(table(["codec", "code", "one-shot encode, GB/s of data in", "fold of one row, GB/s of that row",
                     "decode of P lost data rows, GB/s"], rows))
    md.append("\n*One-shot encode*: all k data rows at once (what a node holding every row would do). *Fold*: "
              "what a parity holder (or, sender-side, a data holder) pays per byte of one data row as it "
              "arrives: for XOR one pass, for RS one whole-stripe library call with the other rows zero, so "
              "about k times the one-shot cost per byte. *Decode*: P lost data rows (1 for XOR) from k "
              "survivors; `out` = bytes rebuilt, `in` = survivor bytes read.\n")
    md.append("## Memory and bytes sent per node per checkpoint, S = 80 GB\n")
    md.append(table(["scheme", "extra memory (formula)", "extra memory (layout)", "÷ K = 1", "sent (formula)",
                     "sent (layout)", "survives", "core-seconds (measured rates)"],
                    [[r["scheme"], f"{r['mem_formula'] / GB:.1f} GB", f"{r['mem_layout'] / GB:.1f} GB",
                      f"{r['mem_layout'] / S_NODE:.3f}×", f"{r['sent_formula'] / GB:.0f} GB",
                      f"{r['sent_layout'] / GB:.0f} GB", r["survives"], fmt(r["core_s"], 0)] for r in lay]))
    md.append("\nFormula: parity P·S/(G − P) held, P·S sent (each data piece goes to its stripe's P parity "
              "holders); layout: what `stripes.cut` / `stripes.stripe_size` give (pieces rounded up to "
              f"{stripes.PIECE_ALIGN} bytes). Core-seconds: XOR folds S bytes at memory speed; RS computes the "
              "contributions of the node's S bytes at the measured fold rate (ISA-L) plus P·S bytes of XOR at "
              "the holders. The sent bytes are measured from the layout, not from real daemons: the wiring "
              "is not built yet.\n")
    write_results(RESULTS / "parity", res, "\n".join(md))


if __name__ == "__main__":
    main()
