"""Global geometry of sharded steps: ``ckptd verify`` checks it, ``ckptd inspect`` shows it.

Sharded steps are made the way a trainer makes them: several "ranks" (raw protocol connections to
ONE real daemon, world_size 2, commit mode local) each save their pieces with a global placement
(a layout entry's 6th element), and the daemon commits the step. Faulty steps are made two
realistic ways: ranks that declare overlapping or gapped placements in the first place (what the
daemon does with them is recorded here), and an index.json whose tensor map was rewritten after
the commit (its own digest recomputed, as an attacker with write access or a buggy tool would).
The CLI runs as a subprocess on the real files. Unit tests of the geometry arithmetic close the file.
"""
# mypy: disable-error-code="index"
# (replies are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import protocol
from ckptd.core.errors import FormatError
from ckptd.core.global_index import LOCAL, SHARDED, GlobalTensor, Piece
from ckptd.core.map_check import MapCheck, MapFault, geometry_faults, region_text, tiling_faults, uncovered_block
from ckptd.core.piece_grid import PieceGrid
from ckptd.core.reader import StepReader, verify_step
from ckptd.core.regions import Region, coverage_faults
from ckptd.core.schema import digest_bytes, index_digest

from conftest import REPO, start_daemon

HANG_GUARD_S = 60.0
SLOT_BYTES = 4096


# ---- one daemon for the module; ranks as raw protocol connections ------------------------------

@pytest.fixture(scope="module")
def geo_daemon() -> Iterator[Any]:
    base = Path(f"/tmp/ckg-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    base.mkdir()
    d = start_daemon(base / "root", base / "d.sock", "--step-timeout", "30")
    yield d
    d.kill()
    shutil.rmtree(base, ignore_errors=True)


# A tensor a rank saves: (name, dtype, shape, bytes, placement or None).
Saved = tuple[str, str, list[int], bytes, "dict[str, Any] | None"]


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def block(rows: int, cols: int, base: int) -> bytes:
    return f32(*(float(base + i) for i in range(rows * cols)))


def save_step(d: Any, job: str, step: int, ranks: list[list[Saved]], trees: list[Any] | None = None) -> list[dict]:
    """Every rank connects (world size len(ranks)), writes its tensors into its slot and saves ``step``
    in local commit mode; returns each rank's final event (committed or failed)."""
    conns: list[tuple[Any, protocol.FrameReceiver]] = []
    try:
        for rank, tensors in enumerate(ranks):
            s = protocol.connect(str(d.socket), timeout=HANG_GUARD_S)
            rx = protocol.FrameReceiver(s)
            conns.append((s, rx))
            protocol.send_frame(s, {"op": "hello", "req": 1, "job": job, "rank": rank, "world_size": len(ranks),
                                    "pid": os.getpid(), "slot_bytes": SLOT_BYTES, "num_slots": 1})
            assert rx.read()["op"] == "ok"
            (fd,) = rx.take_fds(1)
            layout, offset = [], 0
            with mmap.mmap(fd, SLOT_BYTES) as slot:
                for name, dtype, shape, data, placement in tensors:
                    slot[offset: offset + len(data)] = data
                    layout.append([name, dtype, shape, offset, len(data)] + ([placement] if placement else []))
                    offset += (len(data) + 63) // 64 * 64
            os.close(fd)
            tree = trees[rank] if trees else {"d": [[n, {"T": n}] for n, *_ in tensors]}
            protocol.send_frame(s, {"op": "save", "req": 2, "step": step, "slot": 0, "commit": "local",
                                    "tree": tree, "tensors": layout})
        finals = []
        for _, rx in conns:
            while True:
                ev = rx.read()
                assert ev is not None, "daemon closed the connection"
                assert ev["op"] != "error", ev
                if ev["op"] in ("committed", "failed"):
                    finals.append(ev)
                    break
        return finals
    finally:
        for s, _ in conns:
            s.close()


def step_path(d: Any, job: str, step: int = 1) -> Path:
    return d.root / job / f"step-{step:012d}"


def ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


def verify_faults(path: Path) -> tuple[int, list[str]]:
    r = ckptd("verify", "-q", str(path))
    faults = [ln for ln in r.stdout.splitlines() if ln.startswith("FAULT ")]
    assert r.returncode == (1 if faults else 0), (r.returncode, r.stdout, r.stderr)
    assert r.stdout.splitlines()[-1].endswith(f"{len(faults)} fault(s)" if faults else ": OK"), r.stdout
    return r.returncode, faults


def edit_index(path: Path, mutate: Callable[[dict[str, Any]], object]) -> None:
    idx = json.loads((path / "index.json").read_text())
    mutate(idx)
    idx["digest"] = index_digest(idx)       # a checksum, not a signature: whoever edits can recompute it
    (path / "index.json").write_text(json.dumps(idx))


def listed(idx: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Tensor ``name``'s pieces as a list (the form of a map that is not a grid), to edit one."""
    t = idx["tensors"][name]
    if "grid" in t:
        g = t.pop("grid")
        grid = PieceGrid.decode(g, tuple(t["shape"]))
        t["pieces"] = [{"rank": r, "name": name, **region.to_json()} for r, region in grid.pieces()]
    pieces: list[dict[str, Any]] = t["pieces"]
    return pieces


def copy_step(src: Path, tmp: Path, job: str) -> Path:
    dst = tmp / "copies" / job / src.name
    shutil.copytree(src, dst)
    return dst


def piece(shape: list[int], offsets: list[int], key: str | None = None) -> dict[str, Any]:
    return {"shape": shape, "offsets": offsets, **({"key": key} if key else {})}


# Two ranks of a tensor-parallel model: w split by rows, m tiled 2x2 (each rank two regions, saved
# under entry names of their own with the global key), b replicated (identical plain copies), s a
# 0-d piece written once (by rank 0, the replicated placement's owner).
SHARDED_RANKS: list[list[Saved]] = [
    [("w", "float32", [4, 4], block(4, 4, 0), piece([8, 4], [0, 0])),
     ("m.p0", "float32", [2, 3], block(2, 3, 100), piece([4, 6], [0, 0], "m")),
     ("m.p1", "float32", [2, 3], block(2, 3, 200), piece([4, 6], [2, 3], "m")),
     ("b", "float32", [4], f32(1, 2, 3, 4), None),
     ("s", "int64", [], struct.pack("<q", 7), piece([], []))],
    [("w", "float32", [4, 4], block(4, 4, 16), piece([8, 4], [4, 0])),
     ("m.p0", "float32", [2, 3], block(2, 3, 300), piece([4, 6], [0, 3], "m")),
     ("m.p1", "float32", [2, 3], block(2, 3, 400), piece([4, 6], [2, 0], "m")),
     ("b", "float32", [4], f32(1, 2, 3, 4), None)],
]


# Both ranks' state trees name the global tensors (a rank that holds no piece of s still refers to it).
SHARDED_TREE = {"d": [["model", {"d": [[n, {"T": n}] for n in ("w", "m", "b", "s")]}], ["step", 1]]}


@pytest.fixture(scope="module")
def sharded_step(geo_daemon: Any) -> Path:
    finals = save_step(geo_daemon, "tp", 1, SHARDED_RANKS, [SHARDED_TREE, SHARDED_TREE])
    assert [f["op"] for f in finals] == ["committed", "committed"], finals
    return step_path(geo_daemon, "tp")


@pytest.fixture
def area() -> Iterator[Path]:
    p = Path(f"/tmp/ckg-area-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    p.mkdir()
    yield p
    shutil.rmtree(p, ignore_errors=True)


# ---- a good sharded step -----------------------------------------------------------------------

def test_sharded_step_verifies(sharded_step: Path) -> None:
    assert verify_faults(sharded_step) == (0, [])
    assert verify_step(str(sharded_step)) == []
    r = ckptd("verify", str(sharded_step))        # progress names the map check
    assert r.returncode == 0 and "tensor map: 4 tensors checked" in r.stderr, r.stderr


def test_sharded_step_inspect_text(sharded_step: Path) -> None:
    r = ckptd("inspect", str(sharded_step))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(sharded_step)
    assert lines[1] == "job tp, step 1, format 3, world size 2"
    assert lines[2].startswith("raw 264 B, stored ") and "(ratio " in lines[2]
    assert lines[3] == "per-rank keys: none"
    assert lines[4] == "4 tensors (3 sharded, 1 local), map from the index"
    rows = {ln.split()[0]: ln for ln in lines[6:]}
    assert lines[5].split() == ["TENSOR", "DTYPE", "SHAPE", "SIZE", "SPLIT"]
    assert rows["w"].split()[1:5] == ["float32", "[8,", "4]", "128"]
    assert rows["w"].endswith("sharded, 2 pieces in a grid of 2 x 1: rank 0 rows 0:4 of 8; rank 1 rows 4:8 of 8")
    assert rows["m"].endswith(
        "sharded, 4 pieces: rank 0 rows 0:2 of 4, cols 0:3 of 6 (entry 'm.p0'); "
        "rank 0 rows 2:4 of 4, cols 3:6 of 6 (entry 'm.p1'); rank 1 rows 0:2 of 4, cols 3:6 of 6 (entry 'm.p0'); "
        "rank 1 rows 2:4 of 4, cols 0:3 of 6 (entry 'm.p1')")
    assert rows["b"].endswith("local, held by all 2 ranks, same")
    assert rows["s"].split()[1:3] == ["int64", "[]"] and rows["s"].endswith("sharded, 1 piece: rank 0 whole")
    assert "GEOMETRY FAULT" not in r.stdout


def test_sharded_step_inspect_json(sharded_step: Path) -> None:
    r = ckptd("inspect", "--json", str(sharded_step))
    assert r.returncode == 0, r.stderr
    desc = json.loads(r.stdout)
    assert (desc["job"], desc["step"], desc["format_version"], desc["world_size"]) == ("tp", 1, 3, 2)
    assert desc["tensor_map"] == "index" and desc["per_rank_keys"] == [] and desc["geometry_faults"] == []
    assert desc["raw_bytes"] == sum(r["raw_bytes"] for r in desc["ranks"]) == 2 * (64 + 24 + 24 + 16) + 8
    assert list(desc["tensors"]) == ["b", "m", "s", "w"]
    w = desc["tensors"]["w"]
    assert (w["dtype"], w["shape"], w["kind"], w["nbytes"]) == ("float32", [8, 4], SHARDED, 128)
    assert w["grid"] == {"chunks": [4, 4], "counts": [2, 1], "base": 0, "strides": [1, 0]}   # rows 0:4, 4:8
    assert desc["tensors"]["b"] == {"dtype": "float32", "shape": [4], "kind": LOCAL, "held_by": "all",
                                    "same": True, "nbytes": 16}
    assert desc["tensors"]["s"]["pieces"] == [{"rank": 0, "name": "s", "offsets": [], "sizes": []}]


# ---- faulty placements declared by the ranks themselves ----------------------------------------------

def assert_refused(finals: list[dict], path: Path, needle: str) -> None:
    """The daemon refused the step on every rank, saying why, and no index exists."""
    assert all(f["op"] == "failed" for f in finals), finals
    assert all(needle in f["reason"] for f in finals), finals
    assert not (path / "index.json").exists()


def test_overlapping_pieces_are_refused_at_commit(geo_daemon: Any) -> None:
    # rank 0 declares rows 0:5, rank 1 rows 4:8: row 4 is saved twice (with different bytes).
    finals = save_step(geo_daemon, "overlap", 1, [
        [("w", "float32", [5, 4], block(5, 4, 0), piece([8, 4], [0, 0]))],
        [("w", "float32", [4, 4], block(4, 4, 50), piece([8, 4], [4, 0]))]])
    assert_refused(finals, step_path(geo_daemon, "overlap"),
                   "the ranks' pieces do not tile their tensors: tensor 'w': rank 0 and rank 1 overlap")


def test_missing_piece_is_refused_at_commit(geo_daemon: Any) -> None:
    # rank 1 never saves its half of w (it saves something else): rows 4:8 are nowhere.
    finals = save_step(geo_daemon, "gap", 1, [
        [("w", "float32", [4, 4], block(4, 4, 0), piece([8, 4], [0, 0]))],
        [("x", "float32", [2], f32(1, 2), None)]])
    assert_refused(finals, step_path(geo_daemon, "gap"),
                   "tensor 'w': regions cover 16 of 32 elements: a piece is missing; no piece holds rows 4:8 of 8; "
                   "no piece from rank 1")


def test_zero_d_piece_written_by_two_ranks_with_different_values_is_refused_at_commit(geo_daemon: Any) -> None:
    # Replicas of one piece must be byte-identical (a reader takes any one); these two differ.
    finals = save_step(geo_daemon, "scalar2", 1, [
        [("s", "float32", [], f32(1), piece([], []))], [("s", "float32", [], f32(2), piece([], []))]])
    assert_refused(finals, step_path(geo_daemon, "scalar2"),
                   "tensor 's': rank 1 and rank 0 saved the same region {'offsets': [], 'sizes': []} with "
                   "different bytes")


def test_identical_replicas_of_a_piece_are_accepted(geo_daemon: Any) -> None:
    # Data-parallel replicas of a shard that cannot tell they are replicas (DDP over TP) each write it
    # (ranks 0, 1: rows 0:2; ranks 2, 3: rows 2:4), byte-identical: one piece held twice, no fault.
    ranks: list[list[Saved]] = [[("n", "float32", [2, 2], block(2, 2, r // 2 * 4), piece([4, 2], [r // 2 * 2, 0]))]
                                for r in range(4)]
    finals = save_step(geo_daemon, "tp-dup", 1, ranks)
    assert [f["op"] for f in finals] == ["committed"] * 4, finals
    rc, faults = verify_faults(step_path(geo_daemon, "tp-dup"))
    assert rc == 0 and faults == [], faults


def test_pieces_that_disagree_on_the_global_shape_are_refused_at_commit(geo_daemon: Any) -> None:
    finals = save_step(geo_daemon, "disagree", 1, [
        [("w", "float32", [4, 4], block(4, 4, 0), piece([8, 4], [0, 0]))],
        [("w", "float32", [4, 4], block(4, 4, 0), piece([9, 4], [4, 0]))]])
    assert [f["op"] for f in finals] == ["failed", "failed"]
    assert "'w'" in finals[0]["reason"] and "rank 1" in finals[0]["reason"], finals
    assert not (step_path(geo_daemon, "disagree") / "index.json").exists()


# ---- an index whose tensor map was rewritten after the commit ---------------------------------------

def test_index_that_drops_a_piece(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: listed(idx, "w").pop(1))
    _, faults = verify_faults(path)
    assert faults == [
        f"FAULT tensor 'w' in {path}/index.json: regions cover 16 of 32 elements: a piece is missing; "
        "no piece holds rows 4:8 of 8; no piece from rank 1",
        f"FAULT tensor 'w' in {path}/rank-00001.json: rank 1's piece 'w' (rows 4:8 of 8) is not in the "
        "index's tensor map"], faults
    r = ckptd("inspect", str(path))
    assert r.returncode == 0 and "GEOMETRY FAULT tensor 'w': regions cover 16 of 32" in r.stdout, r.stdout
    # A reader (restore) of rank 1 refuses the manifest the map denies; rank 0's still reads.
    reader = StepReader(str(path))
    assert [e.name for e in reader.manifest(0).tensors] == ["w", "m.p0", "m.p1", "b", "s"]
    with pytest.raises(FormatError, match=r"rank-00001.json: does not match the index's tensor map: tensor 'w': "
                                          r"rank 1's piece 'w' \(rows 4:8 of 8\) is not in the index's tensor map"):
        reader.manifest(1)


def test_index_that_drops_a_piece_of_a_2d_tiling(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: idx["tensors"]["m"]["pieces"].pop(3))     # rank 1's entry m.p1
    _, faults = verify_faults(path)
    assert faults == [
        f"FAULT tensor 'm' in {path}/index.json: regions cover 18 of 24 elements: a piece is missing; "
        "no piece holds rows 2:4 of 4, cols 0:3 of 6",
        f"FAULT tensor 'm' in {path}/rank-00001.json: rank 1's piece 'm.p1' (rows 2:4 of 4, cols 0:3 of 6) "
        "is not in the index's tensor map"], faults


def test_index_that_moves_a_piece_onto_another(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: listed(idx, "w")[1].update(offsets=[3, 0]))
    _, faults = verify_faults(path)
    assert len(faults) == 2, faults
    assert faults[0].startswith(f"FAULT tensor 'w' in {path}/index.json: rank 0 and rank 1 overlap: "), faults
    assert faults[1] == (f"FAULT tensor 'w' in {path}/rank-00001.json: rank 1's entry 'w' holds rows 4:8 of 8, "
                         "the index says rows 3:7 of 8")


def test_index_whose_pieces_leave_the_tensor(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: (listed(idx, "w"), idx["tensors"]["w"].update(shape=[6, 4])))
    _, faults = verify_faults(path)
    assert faults[0] == (f"FAULT tensor 'w' in {path}/index.json: rank 1: region {{'offsets': [4, 0], "
                         "'sizes': [4, 4]} is outside the global shape [6, 4]"), faults
    assert f"FAULT tensor 'w' in {path}/rank-00000.json: rank 0's entry 'w' is a piece of a float32 [8, 4] " \
           "tensor, the index says float32 [6, 4]" in faults
    assert any("rank-00001.json: rank 1's entry 'w'" in f for f in faults), faults


def test_index_tensor_map_that_does_not_parse(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: listed(idx, "w")[1].update(rank=5))
    _, faults = verify_faults(path)
    assert len(faults) == 1 and faults[0].startswith(
        f"FAULT {path}/index.json: index tensor 'w': malformed piece"), faults
    r = ckptd("inspect", str(path))
    assert r.returncode == 1 and "ckptd inspect: index tensor 'w': malformed piece" in r.stderr, r.stderr


def test_index_whose_grid_tiles_otherwise_than_the_ranks_saved(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: idx["tensors"]["w"]["grid"].update(chunks=[5, 4]))    # rows 0:5 and 5:8
    _, faults = verify_faults(path)
    assert faults == [
        f"FAULT tensor 'w' in {path}/rank-00000.json: rank 0's entry 'w' holds rows 0:4 of 8, "
        "the index says rows 0:5 of 8",
        f"FAULT tensor 'w' in {path}/rank-00001.json: rank 1's entry 'w' holds rows 4:8 of 8, "
        "the index says rows 5:8 of 8",
    ], faults
    with pytest.raises(FormatError, match=r"rank-00001.json: does not match the index's tensor map: tensor 'w': "
                                          r"rank 1's entry 'w' holds rows 4:8 of 8, the index says rows 5:8 of 8"):
        StepReader(str(path)).manifest(1)


def test_index_whose_grid_does_not_tile(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    edit_index(path, lambda idx: idx["tensors"]["w"]["grid"].update(chunks=[3, 4]))    # rows 0:3, 3:6: 6:8 held by none
    _, faults = verify_faults(path)
    assert len(faults) == 1 and faults[0].startswith(f"FAULT {path}/index.json: index tensor 'w': grid ") \
        and faults[0].endswith("dimension 0: 2 cells of 3 do not cover 8 elements"), faults
    r = ckptd("inspect", str(path))
    assert r.returncode == 1 and "do not cover 8 elements" in r.stderr, r.stderr


def test_index_that_disagrees_on_dtype_and_holders(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")

    def mutate(idx: dict[str, Any]) -> None:
        idx["tensors"]["s"]["dtype"] = "float64"
        idx["tensors"]["b"]["held_by"] = [0]
        idx["tensors"]["b"]["same"] = False
        idx["tensors"]["ghost"] = {"dtype": "int8", "shape": [2], "kind": "local", "held_by": [1], "same": False}
    edit_index(path, mutate)
    _, faults = verify_faults(path)
    assert faults == [
        f"FAULT tensor 's' in {path}/rank-00000.json: rank 0's entry 's' is a piece of a int64 [] tensor, "
        "the index says float64 []",
        f"FAULT tensor 'b' in {path}/rank-00001.json: rank 1's copy is not in the index's tensor map",
        f"FAULT tensor 'ghost' in {path}/rank-00001.json: the index lists a copy on rank 1 that rank 1's "
        "manifest does not have"], faults


def test_index_that_calls_differing_copies_the_same(geo_daemon: Any, area: Path) -> None:
    finals = save_step(geo_daemon, "dp-differ", 1, [[("opt", "float32", [2], f32(1, 2), None)],
                                                    [("opt", "float32", [2], f32(1, 3), None)]])
    assert [f["op"] for f in finals] == ["committed", "committed"]
    path = copy_step(step_path(geo_daemon, "dp-differ"), area, "dp-differ")
    assert json.loads((path / "index.json").read_text())["tensors"]["opt"]["same"] is False
    assert verify_faults(path) == (0, [])
    edit_index(path, lambda idx: idx["tensors"]["opt"].update(same=True))
    _, faults = verify_faults(path)
    assert faults == [f"FAULT tensor 'opt' in {path}/rank-00001.json: rank 1's copy (marked same on every rank) "
                      "differs from rank 0's"], faults


def test_unreadable_manifest_is_one_fault_not_a_cascade(sharded_step: Path, area: Path) -> None:
    path = copy_step(sharded_step, area, "tp")
    (path / "rank-00001.json").write_text("{}")
    _, faults = verify_faults(path)
    assert len(faults) == 1 and faults[0].startswith(f"FAULT {path}/rank-00001.json: "), faults
    assert "digest" in faults[0]


# ---- local tensors and format 1 ---------------------------------------------------------------------

LOCAL_RANKS: list[list[Saved]] = [
    [("b", "float32", [4], f32(1, 2, 3, 4), None), ("opt", "float32", [2], f32(1, 2), None),
     ("only0", "int32", [3], struct.pack("<3i", 1, 2, 3), None)],
    [("b", "float32", [4], f32(1, 2, 3, 4), None), ("opt", "float32", [2], f32(5, 6), None)],
]
LOCAL_TREES = [{"d": [["b", {"T": "b"}], ["opt", {"T": "opt"}], ["only0", {"T": "only0"}], ["rng", 0]]},
               {"d": [["b", {"T": "b"}], ["opt", {"T": "opt"}], ["rng", 1]]}]


@pytest.fixture(scope="module")
def local_step(geo_daemon: Any) -> Path:
    finals = save_step(geo_daemon, "dp", 1, LOCAL_RANKS, LOCAL_TREES)
    assert [f["op"] for f in finals] == ["committed", "committed"], finals
    return step_path(geo_daemon, "dp")


def local_rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("TENSOR"))
    return {ln.split()[0]: ln for ln in lines[head + 1:]}


def test_local_step_inspect(local_step: Path) -> None:
    assert verify_faults(local_step) == (0, [])
    r = ckptd("inspect", str(local_step))
    assert r.returncode == 0, r.stderr
    assert "per-rank keys: only0, opt, rng" in r.stdout
    assert "3 tensors (0 sharded, 3 local), map from the index" in r.stdout
    rows = local_rows(r.stdout)
    assert rows["b"].endswith("local, held by all 2 ranks, same")
    assert rows["opt"].endswith("local, held by all 2 ranks, per-rank")
    assert rows["only0"].split()[1:3] == ["int32", "[3]"]
    assert rows["only0"].endswith("local, held by 1/2 ranks (0), per-rank")


def make_v1(src: Path, area: Path) -> Path:
    """The same step as format 1 wrote it: manifests at version 1, an index without the tensor map."""
    path = copy_step(src, area, src.parent.name)
    idx = json.loads((path / "index.json").read_text())
    for r in range(idx["world_size"]):
        m = json.loads((path / f"rank-{r:05d}.json").read_text())
        assert not any("global" in t for t in m["tensors"])
        m["format_version"] = 1
        data = json.dumps(m).encode()
        (path / f"rank-{r:05d}.json").write_bytes(data)
        idx["ranks"][r]["manifest_digest"] = digest_bytes(data)
    for key in ("tensors", "per_rank_keys", "digest"):
        idx.pop(key, None)
    idx["format_version"] = 1
    (path / "index.json").write_text(json.dumps(idx))
    return path


def test_v1_step_verify_and_inspect(local_step: Path, area: Path) -> None:
    path = make_v1(local_step, area)
    assert StepReader(str(path)).format_version == 1
    assert verify_faults(path) == (0, [])
    r = ckptd("inspect", str(path))
    assert r.returncode == 0, r.stderr
    assert "job dp, step 1, format 1, world size 2" in r.stdout
    assert "3 tensors (0 sharded, 3 local), map from the manifests (format 1)" in r.stdout
    assert "per-rank keys: only0, opt, rng" in r.stdout
    assert local_rows(r.stdout) == local_rows(ckptd("inspect", str(local_step)).stdout)
    v1 = json.loads(ckptd("inspect", "--json", str(path)).stdout)
    v2 = json.loads(ckptd("inspect", "--json", str(local_step)).stdout)
    assert v1["tensor_map"] == "derived from the manifests" and v1["tensors"] == v2["tensors"]


def test_inspect_refuses_what_is_not_a_committed_step(area: Path) -> None:
    r = ckptd("inspect", str(area))          # a usage error (exit 2), not a broken step (exit 1)
    assert r.returncode == 2 and "not a step directory" in r.stderr, r.stderr
    (area / "job" / "step-000000000003").mkdir(parents=True)
    r = ckptd("inspect", str(area / "job" / "step-000000000003"))
    assert r.returncode == 1 and "not committed" in r.stderr


# ---- the geometry, unit by unit ----------------------------------------------------------------------

def sharded(shape: tuple[int, ...], *regions: tuple[tuple[int, ...], tuple[int, ...]], name: str = "t",
            ranks: list[int] | None = None) -> GlobalTensor:
    return GlobalTensor(name, "float32", shape, SHARDED,
                        tuple(Piece(ranks[i] if ranks else i, name, Region(o, s)) for i, (o, s) in enumerate(regions)))


def grid_tiling(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Region]:
    """The blocks of ``shape`` cut at ``cuts`` in each dimension, row-major."""
    bounds = [[0, *c, n] for c, n in zip(cuts, shape, strict=True)]
    out: list[Region] = [Region((), ())]
    for b in bounds:
        out = [Region((*r.offsets, lo), (*r.sizes, hi - lo)) for r in out for lo, hi in zip(b, b[1:], strict=False)]
    return out


def test_zero_d_tensor() -> None:
    assert tiling_faults(sharded((), ((), ())), 1) == []
    assert geometry_faults({"t": sharded((), ((), ()))}, 1) == []
    missing = tiling_faults(sharded((), ), 2)
    assert missing == ["regions cover 0 of 1 elements: a piece is missing; no piece holds the whole tensor; "
                       "no piece from ranks 0, 1"]
    assert tiling_faults(sharded((), ((), ()), ((), ())), 2) == []           # replicas of one piece
    assert tiling_faults(sharded((), ((), ()), ((), ()), ((), ())), 3) == []


def test_coverage_faults_zero_d_pieces() -> None:
    assert coverage_faults((), [("a", Region((), ())), ("b", Region((), ()))]) == [
        "a and b overlap: each holds the whole 0-d tensor"]
    assert coverage_faults((), [("a", Region((), ()))]) == []
    assert coverage_faults((), []) == ["regions cover 0 of 1 elements: a piece is missing"]


def test_empty_dimensions() -> None:
    assert coverage_faults((0, 4), []) == []
    assert tiling_faults(sharded((0, 4), ((0, 0), (0, 4)), ((0, 0), (0, 4))), 2) == []    # empty pieces never overlap
    assert tiling_faults(sharded((3, 0), ((0, 0), (2, 0)), ((2, 0), (1, 0))), 2) == []
    out = tiling_faults(sharded((0, 4), ((1, 0), (0, 4))), 1)
    assert out == ["rank 0: region {'offsets': [1, 0], 'sizes': [0, 4]} is outside the global shape [0, 4]"]


def test_one_piece_whole_or_shifted() -> None:
    """A one-rank mesh saves each tensor as one piece that is all of it (tiling_faults answers that at
    once); the same sizes one column over are out of bounds."""
    assert tiling_faults(sharded((8, 4), ((0, 0), (8, 4))), 1) == []
    assert tiling_faults(sharded((8, 4), ((0, 1), (8, 4))), 1) == [
        "rank 0: region {'offsets': [0, 1], 'sizes': [8, 4]} is outside the global shape [8, 4]"]
    assert tiling_faults(sharded((8, 4), ((0, 0), (8, 3))), 1) == [
        "regions cover 24 of 32 elements: a piece is missing; no piece holds cols 3:4 of 4"]


def test_out_of_bounds() -> None:
    assert tiling_faults(sharded((8,), ((0,), (4,)), ((4,), (5,))), 2) == [
        "rank 1: region {'offsets': [4], 'sizes': [5]} is outside the global shape [8]"]
    assert coverage_faults((8, 4), [("r0", Region((0,), (8,)))]) == [
        "r0: region {'offsets': [0], 'sizes': [8]} is outside the global shape [8, 4]"]     # wrong rank
    assert coverage_faults((4,), [("r0", Region((0,), (4,))), ("r1", Region((4,), (0,)))]) == []   # empty, at the end
    assert coverage_faults((4,), [("r0", Region((2,), (0,)))]) == ["regions cover 0 of 4 elements: a piece is missing"]


def test_3d_tiling_exact_overlap_and_gap() -> None:
    shape = (4, 6, 5)
    blocks = grid_tiling(shape, [[1], [2, 3], [4]])
    assert len(blocks) == 12
    whole = sharded(shape, *((r.offsets, r.sizes) for r in blocks))
    assert tiling_faults(whole, 12) == [] and geometry_faults({"t": whole}, 12) == []
    gone = blocks[7]
    gap = sharded(shape, *((r.offsets, r.sizes) for r in blocks if r != gone),
                  ranks=[i for i in range(12) if i != 7])
    assert tiling_faults(gap, 12) == [
        f"regions cover {120 - gone.numel} of 120 elements: a piece is missing; no piece holds "
        f"{region_text(gone, shape)}; no piece from rank 7"]
    assert region_text(gone, shape) == "rows 1:4 of 4, cols 0:2 of 6, dim 2 4:5 of 5"
    moved = [*blocks[:7], Region((1, 2, 3), gone.sizes), *blocks[8:]]
    out = tiling_faults(sharded(shape, *((r.offsets, r.sizes) for r in moved)), 12)
    assert [f.split(" overlap")[0] for f in out] == ["rank 8 and rank 7", "rank 7 and rank 10"], out


def test_gap_located_in_random_tilings() -> None:
    rng = random.Random(20261130)
    for _ in range(200):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 7) for _ in range(ndim))
        cuts = [sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1)))) if n > 1 else [] for n in shape]
        blocks = grid_tiling(shape, cuts)
        assert tiling_faults(sharded(shape, *((r.offsets, r.sizes) for r in blocks)), len(blocks)) == []
        if len(blocks) < 2:
            continue
        drop = rng.randrange(len(blocks))
        rest = [r for i, r in enumerate(blocks) if i != drop]
        assert uncovered_block(shape, rest) == blocks[drop]
        assert uncovered_block(shape, blocks) is None
        out = tiling_faults(sharded(shape, *((r.offsets, r.sizes) for r in rest)), len(blocks))
        assert len(out) == 1 and "a piece is missing" in out[0], out


def test_uncovered_block_is_uncovered_and_bounded() -> None:
    # An L-shaped hole: the block found is all hole, grown from its first cell.
    shape = (4, 4)
    held = [Region((0, 0), (4, 2)), Region((0, 2), (2, 2))]
    hole = uncovered_block(shape, held)
    assert hole == Region((2, 2), (2, 2))
    assert all(hole.intersect(r) is None for r in held)
    diagonal = [Region((i, i), (1, 1)) for i in range(0, 2048, 2)]     # cut 2048 x 2048 ways: not located
    assert uncovered_block((2048, 2048), diagonal) is None
    assert uncovered_block((2048, 2048), diagonal[:200]) == Region((0, 1), (2, 2047))    # rows 0:2 from col 1


def test_map_check_flags_an_entry_listed_twice() -> None:
    t = sharded((4,), ((0,), (2,)), ((2,), (2,)), ranks=[0, 0])       # tiles, but names one entry twice
    assert MapCheck({"t": t}, 1).map_faults() == [
        MapFault("t", 0, "rank 0's entry 't' is listed twice in the index (also under 't')")]


def test_the_daemon_refuses_to_commit_pieces_that_do_not_tile(geo_daemon: Any) -> None:
    """A step whose pieces overlap must never become the latest committed step (retention could
    then delete the good ones before it); the ranks are told why."""
    finals = save_step(geo_daemon, "refused", 1, [
        [("w", "float32", [5, 4], block(5, 4, 0), piece([8, 4], [0, 0]))],
        [("w", "float32", [4, 4], block(4, 4, 50), piece([8, 4], [4, 0]))]])
    assert [f["op"] for f in finals] == ["failed", "failed"], finals
    assert "do not tile" in finals[0]["reason"] and "'w'" in finals[0]["reason"], finals
    assert not (step_path(geo_daemon, "refused") / "index.json").exists()
