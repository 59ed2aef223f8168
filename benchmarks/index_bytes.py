"""What one restoring rank reads of a sharded step's index, and what the commit encodes, at scale:
pieces listed (format 2, before) vs stored as grids (format 3, after), same step, one run.

The state is a Llama-70B-like stack of decoder layers (q, k, v, o, gate, up, down, two norms;
each with AdamW's exp_avg and exp_avg_sq: 27 sharded tensors a layer, 2,160 for 80 layers),
FSDP2-sharded on dim 0 over every rank (DTensor's Shard arithmetic, trailing empty shards
included). Real: the commit's index code (``publish.build_index`` from the ranks' records: map,
tiling check, encoding, digest; ``publish_index``: lean side files and index.json written and
fsynced) and the reader a restoring rank runs (``StepReader``: the head, its rank-table block, the
tensor map parsed, then the pieces its region overlaps). Bytes read are the process's own
``rchar`` (/proc/self/io) around the reader's calls. Simulated: the records (built in-process,
as each rank's daemon would send them). A layer count below 80 is measured and also scaled to 80
(the index grows linearly with tensors).

    flock /tmp/ckptd-bench.lock python benchmarks/index_bytes.py --ranks 4096 32768 --layers 1
"""
from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Shard

from ckptd.core.errors import FormatError
from ckptd.core.names import INDEX_NAME, step_dir
from ckptd.core.publish import build_index, publish_index
from ckptd.core.rank_record import RankRecord, RecordEntry
from ckptd.core.reader import StepReader
from ckptd.core.regions import Region
from ckptd.core.schema import MAX_INDEX_BYTES

from common import fmt, machine_info, table, write_results

HIDDEN, KV, FFN = 8192, 1024, 28672
LAYER = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
         "gate": (FFN, HIDDEN), "up": (FFN, HIDDEN), "down": (HIDDEN, FFN), "attn_norm": (HIDDEN,),
         "ffn_norm": (HIDDEN,)}


def tensors(layers: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for i in range(layers):
        for name, shape in LAYER.items():
            for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
                out[f"{kind}/layers.{i}.{name}"] = shape
    return out


ROLE = {"q": "col", "k": "col", "v": "col", "gate": "col", "up": "col", "o": "row", "down": "row"}   # else: norms


def placement(name: str, shape: tuple[int, ...], rank: int, world: int, tp: int) -> tuple[Region, bool]:
    """(the region rank ``rank`` holds of ``name``, whether it writes it) on a (world/tp) x tp mesh:
    FSDP2 Shard(0) over dp; with tp > 1, column-parallel weights TP-cut on dim 0 first (FSDP inside:
    _StridedShard), row-parallel ones on dim 1, norms replicated over tp (tp coordinate 0 writes)."""
    dp, (i, j) = world // tp, divmod(rank, tp)
    role = ROLE.get(name.rsplit(".", 1)[1], "norm") if tp > 1 else "norm"
    cuts = {"col": [(0, tp, j), (0, dp, i)], "row": [(1, tp, j), (0, dp, i)], "norm": [(0, dp, i)]}[role]
    offsets, sizes = [0] * len(shape), list(shape)
    for d, parts, c in cuts:
        size, off = Shard.local_shard_size_and_offset(sizes[d], parts, c)
        offsets[d] += off
        sizes[d] = size
    return Region(tuple(offsets), tuple(sizes)), role != "norm" or j == 0


def records(world: int, shapes: dict[str, tuple[int, ...]], tp: int = 1) -> list[RankRecord]:
    """Every rank's record of the FSDP2 (x TP) state, as its daemon sends it."""
    out = []
    for r in range(world):
        entries: tuple[RecordEntry, ...] = ()
        for name, shape in shapes.items():
            region, writes = placement(name, shape, r, world, tp)
            if writes:
                entries += (RecordEntry(name, "float32", region.sizes, name, shape, region.offsets, None),)
        # AdamW's step counter of each parameter: a plain 0-d tensor every rank holds, all equal
        entries += tuple(RecordEntry(step, "float32", (), step, None, None, "step")
                         for step in (n.replace("model/", "optim/step/", 1) for n in shapes if n.startswith("model/")))
        out.append(RankRecord(r, "sha256:" + f"{r:064x}", 0, 0, entries, ()))
    return out


def restore_read(path: str, rank: int, world: int, shapes: dict[str, tuple[int, ...]], tp: int) -> dict[str, Any]:
    """One restoring rank at the saved layout: its rank record and, per tensor, the pieces its own
    region overlaps — bytes read (rchar) and seconds."""
    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        return 0
    gc.collect()
    before, t0 = rchar(), time.perf_counter()
    try:
        reader = StepReader(path)
        reader.rank_entry(rank)
        tmap, _ = reader.tensor_map()
        reader.map_check()          # what checking its first manifest against the map builds
        for name, shape in shapes.items():
            need = placement(name, shape, rank, world, tp)[0]
            assert bool(tmap[name].overlapping(need)) == bool(need.numel), name
        error = None
    except FormatError as e:      # e.g. a tensor map over the reader's MAX_INDEX_BYTES
        error = str(e)[-160:]
    return {"read_bytes": rchar() - before, "read_s": time.perf_counter() - t0, "error": error}


def one(world: int, layers: int, grids: bool, area: Path, tp: int = 1) -> dict[str, Any]:
    shapes = tensors(layers)
    recs = records(world, shapes, tp)
    t0 = time.perf_counter()
    built = build_index("llama", 1, world, recs, grids=grids)
    build_s = time.perf_counter() - t0
    path = Path(step_dir(str(area / f"w{world}-tp{tp}-{'grid' if grids else 'list'}"), "llama", 1))
    path.mkdir(parents=True)
    t0 = time.perf_counter()
    publish_index(str(path), built, recs)
    publish_s = time.perf_counter() - t0
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    del recs, built
    res = restore_read(str(path), world // 2 + 1, world, shapes, tp)
    shutil.rmtree(path)
    return {"world": world, "tp": tp, "layers": layers, "tensors": len(shapes) + 9 * layers,
            "form": "grid" if grids else "list",
            "build_s": build_s, "publish_s": publish_s, "index_bytes": files[INDEX_NAME],
            "tensors_json_bytes": files.get("tensors.json", 0), **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8],
                    help="tensor-parallel degrees (1: FSDP2 only; 8: a (ranks/8) x 8 FSDP x TP mesh)")
    ap.add_argument("--out", default="benchmarks/results/index_bytes")
    ap.add_argument("--dir", default=None, help="where to write the steps (default: a temp dir)")
    args = ap.parse_args()
    area = Path(tempfile.mkdtemp(prefix="ckptd-index-bytes-", dir=args.dir))
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        for world in args.ranks:
            for tp in args.tp:
                for grids in (False, True):
                    rows.append(one(world, args.layers, grids, area, tp))
                print(rows[-1], flush=True)
    finally:
        shutil.rmtree(area, ignore_errors=True)
    scale = 80 / args.layers
    md_rows = []
    for r in rows:
        # What the rank reads is the head and its rank block (independent of the state) plus
        # tensors.json (linear in tensors); a refused map was not read: it would have been.
        fixed = r["read_bytes"] - (0 if r["error"] else r["tensors_json_bytes"])
        whole = fixed + r["tensors_json_bytes"] if r["tensors_json_bytes"] else r["read_bytes"]
        at80 = fixed + r["tensors_json_bytes"] * scale if r["tensors_json_bytes"] else r["read_bytes"] * scale
        read = f"{whole:,}" + (" (refused: the map is over the reader's limit)" if r["error"] else "")
        mesh = "FSDP2" if r["tp"] == 1 else f"FSDP2 x TP{r['tp']}"
        md_rows.append([f"{r['world']:,}", mesh, r["form"], f"{r['tensors']:,}", f"{r['index_bytes']:,}", read,
                        f"{at80 / 1e6:,.2f} MB", fmt(r["read_s"], 3, " s"), fmt(r["build_s"], 2, " s"),
                        fmt(r["publish_s"], 3, " s")])
    md = "\n".join([
        "# Index bytes one restoring rank reads: sharded step, pieces listed vs grids",
        "",
        f"Llama-70B-like layers x{args.layers} (27 sharded tensors a layer: weights + AdamW moments; "
        "9 plain 0-d step counters), "
        "FSDP2 Shard(0) over every rank, or over dp of a dp x TP mesh (column-parallel weights "
        "TP-cut on dim 0 first: _StridedShard; row-parallel on dim 1; norms replicated over TP). "
        "`read by one rank` = bytes the restoring rank's reader read (rchar) "
        "for its rank record and the tensor map (the index head, its 256-rank block of ranks.bin, "
        f"tensors.json), then found its pieces; `at 80 layers` scales the tensor map's part by {scale:g}. "
        "`build` = the committing daemon's `build_index` from the records (map, tiling check, encoding, "
        "digest); `publish` = side files and index.json written and fsynced. The reader refuses a tensor "
        f"map over {MAX_INDEX_BYTES >> 20} MiB (it then reads only the head and block; the table shows "
        "what it would have read).",
        "",
        table(["ranks", "mesh", "form", "tensors", "index.json bytes", "read by one rank", "at 80 layers",
               "reader s", "build s", "publish s"], md_rows),
        "",
        f"Machine: {machine_info()}",
    ])
    write_results(Path(args.out), {"rows": rows, "layers": args.layers, "machine": machine_info(),
                                   "wall_s": time.perf_counter() - t0}, md)


if __name__ == "__main__":
    main()
