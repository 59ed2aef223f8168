"""What ``ckptd inspect`` shows of a committed step: every tensor's dtype, global shape and how it is
split across ranks, the per-rank keys, the world size and the sizes — as JSON-ready data
(``describe_step``) and as text (``render_step``).

A format-2 step is described from index.json alone (its tensor map; no manifest is read); a format-1
step has no map, so it is derived from every rank's manifest (digest-checked), every tensor local.
The tiling of each sharded tensor is checked on the way (no file read for it); ``ckptd verify``
checks the map against the manifests and every byte.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from .global_index import SHARDED
from .map_check import geometry_faults, region_text
from .piece_grid import PieceGrid
from .reader import StepReader
from .regions import Region
from .schema import DTYPE_ITEMSIZE

MAX_PIECES_SHOWN = 8     # per tensor in text; --json lists every piece, or the grid they follow


def describe_step(reader: StepReader) -> dict[str, Any]:
    """The step as JSON-ready data; raises FormatError (a ValueError) or OSError."""
    tensors, per_rank = reader.tensor_map()
    ws = reader.world_size
    ranks = [{"rank": r["rank"], "raw_bytes": r["raw_bytes"], "stored_bytes": r["stored_bytes"]}
             for r in reader.index["ranks"]]
    return {
        "path": reader.path, "job": reader.job, "step": reader.step, "format_version": reader.format_version,
        "tensor_map": "index" if reader.format_version >= 2 else "derived from the manifests",
        "world_size": ws, "created_unix": reader.index.get("created_unix"),
        "raw_bytes": sum(r["raw_bytes"] for r in ranks), "stored_bytes": sum(r["stored_bytes"] for r in ranks),
        "ranks": ranks, "per_rank_keys": per_rank,
        "tensors": {name: {**t.to_json(ws), "nbytes": math.prod(t.shape) * DTYPE_ITEMSIZE[t.dtype]}
                    for name, t in sorted(tensors.items())},
        "geometry_faults": geometry_faults(tensors, ws),
    }


def split_text(name: str, t: dict[str, Any], world_size: int) -> str:
    """How one tensor (a ``describe_step`` entry) is held: ``sharded, 2 pieces: rank 0 rows 0:4 of 8;
    ...`` or ``local, held by all 8 ranks, same``."""
    if t["kind"] == SHARDED:
        if "grid" in t:         # stored as a rule (piece_grid.py): the first few pieces, made from it
            g = t["grid"]
            grid = PieceGrid.decode(g, tuple(t["shape"]))
            count, how = len(grid), f" in a grid of {' x '.join(map(str, grid.counts))}"
            first = [(r, region, name) for r, region in itertools.islice(
                ((grid.rank_of(c), grid.region_of(c)) for c in grid.cells()), MAX_PIECES_SHOWN)]
        else:
            count, how = len(t["pieces"]), ""
            first = [(p["rank"], Region(tuple(p["offsets"]), tuple(p["sizes"])), p["name"])
                     for p in t["pieces"][:MAX_PIECES_SHOWN]]
        shown = [f"rank {r} {region_text(region, t['shape'])}" + (f" (entry {entry!r})" if entry != name else "")
                 for r, region, entry in first]
        more = f"; ... {count - MAX_PIECES_SHOWN} more" if count > MAX_PIECES_SHOWN else ""
        return f"sharded, {count} piece{'s' if count != 1 else ''}{how}: " + "; ".join(shown) + more
    held = t["held_by"]
    if held == "all":
        who = f"all {world_size} rank{'s' if world_size != 1 else ''}"
    else:
        listed = ", ".join(map(str, held[:MAX_PIECES_SHOWN])) + (", ..." if len(held) > MAX_PIECES_SHOWN else "")
        who = f"{len(held)}/{world_size} ranks ({listed})"
    own = len(t.get("copies", {}))
    return (f"local, held by {who}, {'same' if t['same'] else 'per-rank'}"
            + (f", {own} cop{'ies' if own != 1 else 'y'} of another shape or dtype" if own else ""))


def human_size(n: float) -> str:
    """``"3.9 KiB"``: what every command prints for a person (JSON output keeps the bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render_step(desc: dict[str, Any], size: Callable[[float], str]) -> list[str]:
    """``describe_step``'s data as text lines; ``size`` formats a byte count."""
    ws, tensors = desc["world_size"], desc["tensors"]
    raw, stored = desc["raw_bytes"], desc["stored_bytes"]
    n_sharded = sum(t["kind"] == SHARDED for t in tensors.values())
    lines = [f"{desc['path']}",
             f"job {desc['job']}, step {desc['step']}, format {desc['format_version']}, world size {ws}",
             f"raw {size(raw)}, stored {size(stored)}" + (f" (ratio {raw / stored:.3f})" if stored else ""),
             f"per-rank keys: {', '.join(desc['per_rank_keys']) or 'none'}",
             f"{len(tensors)} tensor{'s' if len(tensors) != 1 else ''} ({n_sharded} sharded, "
             f"{len(tensors) - n_sharded} local), map from the "
             + ("index" if desc["format_version"] >= 2 else "manifests (format 1)")]
    lines += [f"GEOMETRY FAULT {f}" for f in desc["geometry_faults"]]
    if not tensors:
        return lines
    rows = [(name, t["dtype"], str(t["shape"]), size(t["nbytes"]), split_text(name, t, ws))
            for name, t in tensors.items()]
    head = ("TENSOR", "DTYPE", "SHAPE", "SIZE", "SPLIT")
    widths = [min(max(len(r[i]) for r in [head, *rows]), 60) for i in range(4)]
    for r in [head, *rows]:
        lines.append("  ".join([f"{r[0]:{widths[0]}}", f"{r[1]:{widths[1]}}", f"{r[2]:{widths[2]}}",
                                f"{r[3]:>{widths[3]}}", r[4]]).rstrip())
    return lines
