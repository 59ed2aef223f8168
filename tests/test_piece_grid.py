"""piece_grid: a sharded tensor's pieces stored as a rule. Layouts come from torch's own Shard
arithmetic (``Shard.local_shard_size_and_offset``), the one DTensor saves with."""
from __future__ import annotations

import itertools
import json
import random

import pytest
from torch.distributed.tensor.placement_types import Shard

from ckptd.core.errors import FormatError
from ckptd.core.global_index import SHARDED, GlobalTensor, Piece, build_from_records, parse_tensor_map
from ckptd.core.map_check import MapCheck
from ckptd.core.piece_grid import fit
from ckptd.core.publish import build_index
from ckptd.core.rank_record import RankRecord, RecordEntry
from ckptd.core.regions import Region
from ckptd.core.schema import Manifest, Placement, TensorEntry, make_index_file, parse_index


def torch_pieces(shape: tuple[int, ...], mesh: tuple[int, ...], dims: tuple[int | None, ...],
                 order: tuple[int, ...] | None = None) -> list[tuple[int, Region]]:
    """(rank, region) of each writing rank of a row-major ``mesh`` whose dimension m shards tensor
    dimension ``dims[m]`` (None: replicated there, so only coordinate 0 writes), as DTensor computes them;
    ``order``: the mesh dimensions in the order they cut (FSDP over TP on one dimension: TP's first)."""
    out = []
    for rank, coord in enumerate(itertools.product(*map(range, mesh))):
        if any(c and d is None for c, d in zip(coord, dims, strict=True)):
            continue
        offsets, sizes = [0] * len(shape), list(shape)
        for m in order or range(len(mesh)):
            d = dims[m]
            if d is not None:
                size, off = Shard.local_shard_size_and_offset(sizes[d], mesh[m], coord[m])
                offsets[d] += off
                sizes[d] = size
        out.append((rank, Region(tuple(offsets), tuple(sizes))))
    return out


LAYOUTS = [
    ((4096, 11008), (8,), (0,)),              # FSDP, even
    ((11008, 4096), (7,), (0,)),              # uneven: the last shard shorter
    ((5,), (8,), (0,)),                       # more ranks than rows: trailing empty shards
    ((1, 64), (4,), (0,)),                    # one row over four ranks: three empty
    ((4096, 4096), (2, 4), (0, 1)),           # FSDP x TP, dim 0 and dim 1
    ((4096, 4096), (2, 4), (1, 0)),           # TP on dim 0 outside, FSDP on dim 1 inside
    ((9, 10, 3), (2, 3), (2, 0)),             # 3-D, uneven on both
    ((128, 64), (2, 4), (None, 0)),           # HSDP: replica 0's ranks only, stride 1
    ((128, 64), (4, 2), (0, None)),           # sharded outside, replicated inside: stride 2
    ((3, 3), (4, 4), (0, 1)),                 # empties along both dimensions
]


@pytest.mark.parametrize("shape,mesh,dims", LAYOUTS)
def test_torch_layouts_fit_a_grid_that_gives_back_the_same_pieces(shape, mesh, dims) -> None:
    pieces = torch_pieces(shape, mesh, dims)
    grid = fit(shape, pieces)
    assert grid is not None, pieces
    assert grid.pieces() == pieces
    assert grid.fault(max(r for r, _ in pieces) + 1) is None
    for rank, region in pieces:                       # the rank a piece came from finds it again
        cell = grid.cell_of_rank(rank)
        assert cell is not None and grid.region_of(cell) == region
    held = {r for r, _ in pieces}
    assert all(grid.cell_of_rank(r) is None for r in range(max(held) + 2) if r not in held)


@pytest.mark.parametrize("shape,mesh,dims", LAYOUTS)
def test_overlapping_finds_exactly_the_pieces_a_scan_finds(shape, mesh, dims) -> None:
    pieces = torch_pieces(shape, mesh, dims)
    grid = fit(shape, pieces)
    assert grid is not None
    rnd = random.Random(str(shape))
    for _ in range(200):
        lo = [rnd.randrange(n) for n in shape]
        region = Region(tuple(lo), tuple(rnd.randint(1, n - o) for o, n in zip(lo, shape, strict=True)))
        scan = sorted((r, p) for r, p in pieces if p.intersect(region) is not None)
        assert sorted(grid.overlapping(region), key=lambda x: x[0]) == scan
    assert grid.overlapping(Region(tuple(0 for _ in shape), tuple(0 for _ in shape))) == []


def sharded(name: str, shape: tuple[int, ...], pieces: list[tuple[int, Region]]) -> GlobalTensor:
    grid = fit(shape, pieces)        # as build_from_records decides: a grid where the pieces form one
    listed = () if grid else tuple(Piece(r, name, reg) for r, reg in pieces)
    return GlobalTensor(name, "float32", shape, SHARDED, listed, grid=grid)


def test_index_stores_the_grid_and_reads_back_the_same_map() -> None:
    world = 8
    built = {"w": sharded("w", (4096, 4096), torch_pieces((4096, 4096), (2, 4), (0, 1))),
             "b": sharded("b", (5,), torch_pieces((5,), (8,), (0,))),
             "r": sharded("r", (4, 4), [(0, Region((0, 0), (4, 4))), (1, Region((0, 0), (4, 4)))])}  # replicas
    tensors = {n: t.to_json(world) for n, t in built.items()}
    assert set(tensors["w"]) == {"dtype", "shape", "kind", "grid"} and "pieces" in tensors["r"]
    assert tensors["w"]["grid"] == {"chunks": [2048, 1024], "counts": [2, 4], "base": 0, "strides": [4, 1]}
    index, data = make_index_file("j", 3, world, [{"rank": r, "manifest_digest": "sha256:" + "0" * 64,
                                                   "raw_bytes": 0, "stored_bytes": 0} for r in range(world)],
                                  1.0, tensors, [])
    assert index["format_version"] == 3
    parsed = parse_tensor_map(parse_index(data, job="j", step=3)["tensors"], world)
    assert parsed["w"].grid is not None and "pieces" not in parsed["w"].__dict__     # not made until asked
    assert [p.rank for p in parsed["w"].overlapping(Region((2000, 1000), (100, 100)))] == [0, 1, 4, 5]
    assert parsed["w"].held_by(5) == [Piece(5, "w", Region((2048, 1024), (2048, 1024)))]
    assert len(json.dumps(tensors["w"], separators=(",", ":"))) < 130      # whatever the world size
    assert parsed == built              # every piece, in rank order, as built
    listed = built["w"].to_json(world, grids=False)
    assert len(listed["pieces"]) == 8 and make_index_file("j", 3, world, [], 1.0, {"w": listed})[0][
        "format_version"] == 2


@pytest.mark.parametrize("pieces", [
    [(0, Region((0,), (4,))), (1, Region((0,), (4,)))],                         # replicas of one region
    [(0, Region((0,), (2,))), (1, Region((4,), (2,))), (2, Region((2,), (2,)))],  # ranks out of cell order
    [(0, Region((0,), (2,))), (1, Region((2,), (1,))), (2, Region((3,), (3,)))],  # uneven, not chunk's rule
    [(0, Region((0,), (2,))), (1, Region((4,), (2,)))],                          # a gap
    [(0, Region((0,), (6,)))],                                                   # one piece: a list is as short
])
def test_layouts_that_are_not_a_grid_keep_their_list(pieces) -> None:
    assert fit((6,), pieces) is None


@pytest.mark.parametrize("grid,why", [
    ({"chunks": [2], "counts": [2], "base": 0, "strides": [1]}, "do not cover"),
    ({"chunks": [2, 4], "counts": [3, 2], "base": 0, "strides": [1, 2]}, "same rank"),
    ({"chunks": [2], "counts": [3], "base": 6, "strides": [1]}, "the world has 8"),
    ({"chunks": [6], "counts": [1], "base": 0, "strides": [3]}, "several cells"),
    ({"chunks": [2], "counts": [3], "base": -1, "strides": [1]}, "malformed"),
    ({"chunks": [2], "counts": [3]}, "malformed"),
])
def test_a_grid_from_disk_that_does_not_tile_is_refused(grid, why) -> None:
    shape = [6, 8] if len(grid.get("chunks", [])) == 2 else [6]
    with pytest.raises(FormatError, match=why):
        parse_tensor_map({"w": {"dtype": "float32", "shape": shape, "kind": "sharded", "grid": grid}}, 8)


def test_map_check_asks_a_grid_per_rank() -> None:
    world = 4
    t = sharded("w", (8, 2), torch_pieces((8, 2), (4,), (0,)))
    tensors = parse_tensor_map({"w": t.to_json(world)}, world)
    assert tensors["w"].grid is not None
    check = MapCheck(tensors, world)

    def manifest(rank: int, offsets: tuple[int, ...]) -> Manifest:
        entry = TensorEntry("w", "float32", [2, 2], 0, [], Placement((8, 2), offsets, "w"))
        return Manifest("j", 1, rank, world, [entry], {}, 0, 0)

    assert check.map_faults() == []
    assert check.rank_faults(manifest(2, (4, 0))) == []
    faults = check.rank_faults(manifest(2, (6, 0)))
    assert faults and "the index says rows 4:6" in faults[0].reason


def test_the_commit_builds_grids_from_the_ranks_records_without_making_pieces() -> None:
    world, shapes = 8, {"w": (12, 4), "b": (3,)}
    recs = []
    for rank in range(world):
        entries = []
        for name, shape in shapes.items():
            size, off = Shard.local_shard_size_and_offset(shape[0], world, rank)
            offsets = (off, *([0] * (len(shape) - 1)))
            entries.append(RecordEntry(name, "float32", (size, *shape[1:]), name, shape, offsets, None))
        if rank < 2:        # a tensor only two ranks hold, the same region each: replicas keep their list
            entries.append(RecordEntry("r", "float32", (2,), "r", (2,), (0,), "same"))
        recs.append(RankRecord(rank, "sha256:" + f"{rank:064x}", 0, 0, tuple(entries), ()))
    tensors, _ = build_from_records(recs)
    assert tensors["w"].grid is not None and tensors["b"].grid is not None and tensors["r"].grid is None
    assert "pieces" not in tensors["w"].__dict__ and tensors["w"].listed == ()
    assert [p.region for p in tensors["b"].pieces] == [Region((min(r, 3),), (1 if r < 3 else 0,)) for r in range(8)]
    built = build_index("j", 1, world, recs)
    assert built.index["format_version"] == 3 and "grid" in built.index["tensors"]["w"]
    assert "pieces" in built.index["tensors"]["r"]
    listed = build_index("j", 1, world, recs, grids=False)
    assert listed.index["format_version"] == 2
    assert parse_tensor_map(listed.index["tensors"], world) == parse_tensor_map(built.index["tensors"], world)


def test_a_local_tensor_held_by_every_rank_is_read_without_a_piece_per_rank() -> None:
    world = 32768
    tensors = parse_tensor_map({
        "step": {"dtype": "float32", "shape": [], "kind": "local", "held_by": "all", "same": True},
        "buf": {"dtype": "int64", "shape": [5], "kind": "local", "held_by": "all", "same": False,
                "copies": {"7": {"dtype": "int32", "shape": [6]}}},
        "few": {"dtype": "float32", "shape": [2], "kind": "local", "held_by": [3, 9], "same": False}}, world)
    step, buf, few = tensors["step"], tensors["buf"], tensors["few"]
    assert step.holder_ranks() == range(world) and "pieces" not in step.__dict__
    assert step.held_by(31000) == [Piece(31000, "step", Region((), ()))]
    assert buf.held_by(7) == [Piece(7, "buf", Region((0,), (6,)), "int32")]
    assert buf.held_by(8) == [Piece(8, "buf", Region((0,), (5,)))]
    assert few.held_by(4) == [] and list(few.holder_ranks()) == [3, 9]
    check = MapCheck(tensors, world)
    assert check.map_faults() == [] and "pieces" not in step.__dict__        # checked without enumerating
    assert step.to_json(world) == {"dtype": "float32", "shape": [], "kind": "local", "held_by": "all", "same": True}
    with pytest.raises(FormatError, match="'copies' names '40000'"):
        parse_tensor_map({"b": {"dtype": "int64", "shape": [5], "kind": "local", "held_by": "all", "same": False,
                                "copies": {"40000": {"dtype": "int32", "shape": [6]}}}}, world)


STRIDED = [((4096, 1024), (2, 2)), ((4096, 64), (4, 2)), ((4096, 64), (2, 4)), ((96, 8), (3, 4)),
           ((1024, 8), (512, 8)),     # 128 rows a TP part over 512 FSDP ranks: empty cells inside each part
           ((10, 4), (2, 2))]         # TP cuts 5 + 5, FSDP 3 + 2 of each: uneven, still two chunk rules


@pytest.mark.parametrize("shape,mesh", STRIDED)
def test_fsdp_over_tp_on_one_dimension_is_a_grid_of_two_levels(shape, mesh) -> None:
    """FSDP2 over TP's column-parallel weights (``_StridedShard``): TP cuts dim 0 first, FSDP cuts
    each TP part; the cells run tp-major along dim 0 while ranks run dp-major."""
    dp, tp = mesh
    pieces = torch_pieces(shape, mesh, (0, 0), order=(1, 0))
    grid = fit(shape, pieces)
    c_tp = -(-shape[0] // tp)
    assert grid is not None and grid.levels[0] == ((tp, 1, c_tp), (dp, tp, -(-c_tp // dp)))
    assert grid.counts == (dp * tp, 1)
    assert grid.pieces() == pieces
    for rank, region in pieces:
        cell = grid.cell_of_rank(rank)
        assert cell is not None and grid.region_of(cell) == region
    rnd = random.Random(1)
    for _ in range(100):
        lo = rnd.randrange(shape[0])
        region = Region((lo, 0), (rnd.randint(1, shape[0] - lo), shape[1]))
        assert sorted(grid.overlapping(region), key=lambda x: x[0]) == \
            sorted((r, p) for r, p in pieces if p.intersect(region) is not None)
    doc = grid.to_json()
    assert doc["counts"] == [[tp, dp], 1] and doc["strides"] == [[1, tp], 0]
    assert doc["chunks"] == [[c_tp, -(-c_tp // dp)], shape[1]]
    parsed = parse_tensor_map({"w": {"dtype": "float32", "shape": list(shape), "kind": "sharded", "grid": doc}},
                              dp * tp)["w"]
    assert parsed.grid == grid and parsed.pieces == sharded("w", shape, pieces).pieces


@pytest.mark.parametrize("counts,strides,why", [
    ([[2, 2], 1], [[1, 1], 0], "same rank"),          # two digits of one stride
    ([[2, 2], 1], [[1], 0], "malformed"),             # a count without its stride
    ([[2, 3], 1], [[1, 2], 0], "the world has 4"),
    ([[2, 1], 1], [[1, 0], 0], "1 cells of 2 do not cover 4"),   # the inner cut leaves half of each part
])
def test_a_several_level_grid_from_disk_is_checked(counts, strides, why) -> None:
    grid = {"chunks": [[4, 2], 8], "counts": counts, "base": 0, "strides": strides}
    with pytest.raises(FormatError, match=why):
        parse_tensor_map({"w": {"dtype": "float32", "shape": [8, 8], "kind": "sharded", "grid": grid}}, 4)
