"""Restoring into whatever the live state is, and lazy partial loads (ckptd_client.reshard/restore/lazy).

Unit tests write real steps with the daemon's own writer and commit (``write_shard``,
``write_index``: real chunks, checksums, manifests, index.json) and count what a load reads
through the injectable ``read_at`` and ``ReadStats`` — no mocks. The multi-process tests run real
gloo rank groups (this file is also their rank script) against a real daemon: FSDP2 models are
saved on 2 ranks and restored on 2 (same layout: own files only), on 3 (uneven ``Shard(0)``, and
``Shard(1)``) and into a plain model in this process, compared bit for bit with ``full_tensor()``.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from ports import free_port

import ckptd_client
from ckptd.core import storage
from ckptd.core.reader import StepReader
from ckptd.core.regions import Region, row_span
from ckptd.core.schema import Placement, TensorLayout
from ckptd.core.tree import encode_tree
from ckptd.daemon.settings.write import WriteSettings
from ckptd.daemon.tiers.fs.commit import write_index
from ckptd.daemon.tiers.fs.writer import write_shard
from ckptd_client.restore import restore_state
from ckptd_client.state import dtype_name

HERE = Path(__file__).resolve()
ROW = 32 * 4                  # bytes per row of the [64, 32] float32 test tensor
CHUNK = 1024                  # 8 rows per chunk


# ---- writing steps without a daemon ------------------------------------------------------------

def write_step(root: Path, job: str, step: int, states: list[dict[str, Any]], *,
               placements: dict[tuple[int, str], Placement] | None = None, chunk_bytes: int = CHUNK,
               codec: str = "none") -> Path:
    """A committed step of ``len(states)`` ranks; ``placements[(rank, name)]`` makes that tensor a piece
    of a sharded global tensor; a placement whose offsets are None makes the tensor referenced by the
    tree but not written (a replicated piece another rank owns)."""
    placements = placements or {}
    step_path = root / job / f"step-{step:012d}"
    digests = {}
    with ThreadPoolExecutor(2) as pool:
        for rank, state in enumerate(states):
            tensors: list[tuple[str, torch.Tensor]] = []

            def on_tensor(path: str, t: torch.Tensor, rank: int = rank, tensors: list = tensors) -> str:
                tensors.append((path, t))
                return path

            def on_other(path: str, obj: Any) -> Any:
                if ckptd_client.state.is_stateful(obj):
                    return obj.state_dict()
                raise TypeError(path)

            tree = encode_tree(state, on_tensor, on_other, lambda o: isinstance(o, torch.Tensor))
            layout, offset, blobs = [], 0, []
            for name, t in tensors:
                p = placements.get((rank, name))
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                layout.append(TensorLayout(name, dtype_name(t.dtype), tuple(t.shape), offset, len(data), p))
                blobs.append(data)
                offset += len(data)
            slot = memoryview(bytearray(b"".join(blobs)) or bytearray(1))
            res = write_shard(str(step_path), job, step, rank, len(states), slot, layout, tree,
                              WriteSettings(codec=codec, chunk_bytes=chunk_bytes), pool, 4, lambda: None)
            digests[rank] = res.digest
    write_index(str(step_path), job, step, len(states), digests)
    return step_path


def rows_of(full: torch.Tensor, n: int) -> list[tuple[torch.Tensor, Placement]]:
    """``full`` cut into ``n`` row blocks (torch.chunk, like Shard(0)) with their placements."""
    out, start = [], 0
    for block in torch.chunk(full, n):
        out.append((block.clone(), Placement(tuple(full.shape), (start, *([0] * (full.dim() - 1))))))
        start += block.shape[0]
    return out


def sharded_step(root: Path, job: str = "j", codec: str = "none") -> tuple[Path, dict[str, torch.Tensor]]:
    """2 ranks: ``model/w`` [64, 32] float32 in row halves, ``model/b`` [64] halves, a plain ``small``
    tensor identical on both ranks, a per-rank ``loader`` position."""
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    b = torch.randn(64, dtype=torch.float32)
    small = torch.tensor([1.5, 2.5, 3.5], dtype=torch.float64)
    states, placements = [], {}
    for r, ((wp, wpl), (bp, bpl)) in enumerate(zip(rows_of(w, 2), rows_of(b, 2), strict=True)):
        states.append({"model": {"w": wp, "b": bp}, "small": small.clone(), "loader": {"pos": 10 * r + 5}})
        placements[(r, "model/w")] = wpl
        placements[(r, "model/b")] = bpl
    return write_step(root, job, 1, states, placements=placements, codec=codec), {"w": w, "b": b, "small": small}


class Reads:
    """A counting ``read_at``: every (fd's file, offset, length) a load reads from a data file."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, fd: int, offset: int, length: int) -> bytes:
        with self.lock:
            self.calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        return storage.read_at(fd, offset, length)

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.calls)


# ---- the planner: which chunks a region costs -------------------------------------------------

def test_row_slice_reads_only_the_chunks_of_its_rows(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    stats, reads = ckptd_client.ReadStats(), Reads()
    got = ckptd_client.load_tensor(step, "model/w", (slice(10, 20),), stats=stats, read_at=reads)
    assert torch.equal(got, ref["w"][10:20])
    # rows 10..19 of rank 0's piece: chunks 1 (rows 8-15) and 2 (rows 16-23), nothing of rank 1
    assert stats.manifests == [0] and stats.entries == {(0, "model/w")}
    assert stats.chunks == 2 and stats.bytes == 2 * CHUNK == reads.bytes
    entry = StepReader(str(step)).manifest(0).by_name()["model/w"]
    assert sorted(o for _, o, _ in reads.calls) == [entry.offset + CHUNK, entry.offset + 2 * CHUNK]


def test_slice_across_pieces_reads_both_ranks_boundary_chunks(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    stats = ckptd_client.ReadStats()
    got = ckptd_client.load_tensor(step, "model/w", (slice(30, 34), slice(5, 9)), stats=stats)
    assert torch.equal(got, ref["w"][30:34, 5:9])
    assert sorted(stats.manifests) == [0, 1] and stats.chunks == 2 and stats.bytes == 2 * CHUNK


def test_column_slice_costs_every_row_it_crosses(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    stats = ckptd_client.ReadStats()
    got = ckptd_client.load_tensor(step, "model/w", (slice(None), slice(0, 4)), stats=stats)
    assert torch.equal(got, ref["w"][:, :4])
    assert stats.bytes == 64 * ROW and stats.chunks == 8        # the whole tensor: every row is crossed
    stats = ckptd_client.ReadStats()
    got = ckptd_client.load_tensor(step, "model/w", (slice(0, 8), slice(0, 4)), stats=stats)
    assert torch.equal(got, ref["w"][:8, :4]) and stats.chunks == 1 and stats.bytes == CHUNK


def test_int_index_scalar_and_region(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    assert torch.equal(ckptd_client.load_tensor(step, "model/w", (40, slice(3, 7))), ref["w"][40, 3:7])
    assert torch.equal(ckptd_client.load_tensor(step, "model/w", Region((33, 1), (2, 2))), ref["w"][33:35, 1:3])
    assert torch.equal(ckptd_client.load_tensor(step, "model/b", (-1,)), ref["b"][-1])
    assert torch.equal(ckptd_client.load_tensor(step, "model/b"), ref["b"])
    with pytest.raises(ckptd_client.CheckpointError, match="step 1 slices|only step 1"):
        ckptd_client.load_tensor(step, "model/w", (slice(0, 8, 2),))
    with pytest.raises(ckptd_client.CheckpointError, match="out of range"):
        ckptd_client.load_tensor(step, "model/w", (64,))


def test_lazy_load_of_one_tensor_reads_nothing_else(tmp_path: Path) -> None:
    big = torch.randn(4096, dtype=torch.float32)
    small = torch.randn(100, dtype=torch.bfloat16)
    step = write_step(tmp_path, "lazy", 3, [{"big": big, "n": 7, "small": small, "other": big * 2}], codec="bplane")
    entry = StepReader(str(step)).manifest(0).by_name()["small"]
    stats, reads = ckptd_client.ReadStats(), Reads()
    got = ckptd_client.load_tensor(step, "small", stats=stats, read_at=reads)
    assert torch.equal(got, small) and got.dtype == torch.bfloat16
    assert stats.bytes == entry.stored_bytes == reads.bytes and stats.chunks == len(entry.chunks)
    assert all(entry.offset <= o and o + n <= entry.offset + entry.stored_bytes for _, o, n in reads.calls)
    with pytest.raises(ckptd_client.CheckpointError, match="'nope' is not in checkpoint step 3"):
        ckptd_client.load_tensor(step, "nope")


def test_plain_tensor_copies_per_rank(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    stats = ckptd_client.ReadStats()
    assert torch.equal(ckptd_client.load_tensor(step, "small", stats=stats), ref["small"])
    assert stats.manifests == [0]
    stats = ckptd_client.ReadStats()
    assert torch.equal(ckptd_client.load_tensor(step, "small", rank=1, stats=stats), ref["small"])
    assert stats.manifests == [1]
    differ = write_step(tmp_path, "differ", 1, [{"x": torch.zeros(3)}, {"x": torch.ones(3)}])
    with pytest.raises(ckptd_client.CheckpointError, match="pass rank="):
        ckptd_client.load_tensor(differ, "x")
    assert torch.equal(ckptd_client.load_tensor(differ, "x", rank=1), torch.ones(3))


def test_replicas_that_each_saved_a_piece_are_read_once(tmp_path: Path) -> None:
    """Ranks 0,1 and 2,3 each saved the same half (a DTensor on a sub-mesh, replicated over the rest)."""
    full = torch.randn(8, 4)
    states, placements = [], {}
    for r in range(4):
        block, pl = rows_of(full, 2)[r // 2]
        states.append({"n": block})
        placements[(r, "n")] = pl
    step = write_step(tmp_path, "dup", 1, states, placements=placements)
    state: dict[str, Any] = {"n": torch.zeros(8, 4)}
    stats = ckptd_client.ReadStats()
    restore_state(str(step), state, rank=1, world_size=4, threads=2, stats=stats)
    assert torch.equal(state["n"], full) and sorted(stats.manifests) == [1, 2]      # its own half, once
    stats = ckptd_client.ReadStats()
    assert torch.equal(ckptd_client.load_tensor(step, "n", stats=stats), full) and stats.chunks == 2


def test_corrupt_chunk_is_named(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    entry = StepReader(str(step)).manifest(1).by_name()["model/w"]
    data = step / "rank-00001.data"
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 3 * CHUNK + 7] ^= 0x10            # rank 1's rows 56..63
    data.write_bytes(bytes(raw))
    assert torch.equal(ckptd_client.load_tensor(step, "model/w", (slice(0, 56),)), ref["w"][:56])   # untouched
    with pytest.raises(ckptd_client.CheckpointError) as err:
        ckptd_client.load_tensor(step, "model/w", (slice(60, 61),))
    assert "'model/w'" in str(err.value) and "rank-00001.data" in str(err.value) and "checksum" in str(err.value)


def test_many_small_tensors_restore_in_gathered_reads_and_a_corrupt_one_is_named(tmp_path: Path) -> None:
    """Small whole chunks are read a few MiB to a restore task (reshard.BATCH): 600 tensors of 16 KiB
    restore bit-exact; one flipped byte in tensor 301 fails the restore naming it, in a task that
    reads others too."""
    g = torch.Generator().manual_seed(5)
    ref = {f"t{i:03d}": torch.randn(4096, generator=g) for i in range(600)}
    step = write_step(tmp_path, "many", 1, [ref])
    state: dict[str, Any] = {k: torch.zeros(4096) for k in ref}
    restore_state(str(step), state, rank=0, world_size=1, threads=2)
    assert all(torch.equal(state[k], v) for k, v in ref.items())
    entry = StepReader(str(step)).manifest(0).by_name()["t301"]
    data = step / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 100] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ckptd_client.CheckpointError, match="'t301'.*checksum"):
        restore_state(str(step), {k: torch.zeros(4096) for k in ref}, rank=0, world_size=1, threads=2)


# ---- restore into the live state (no process group: rank/world size given) ----------------------

def test_restore_consolidates_and_reads_own_files_at_the_same_layout(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path, codec="bplane")
    # one process, the whole model: both pieces of w and b, rank 0's copy of small
    state: dict[str, Any] = {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(64)},
                             "small": torch.zeros(3, dtype=torch.float64)}
    stats = ckptd_client.ReadStats()
    restore_state(str(step), state, rank=0, world_size=1, threads=2, stats=stats)
    assert torch.equal(state["model"]["w"], ref["w"]) and torch.equal(state["model"]["b"], ref["b"])
    assert torch.equal(state["small"], ref["small"]) and sorted(set(stats.manifests)) == [0, 1]
    # same world size: rank 1 reads its own manifest and entries only, per-rank entries included
    state = {"small": torch.zeros(3, dtype=torch.float64), "loader": {"pos": -1}}
    stats = ckptd_client.ReadStats()
    restore_state(str(step), state, rank=1, world_size=2, threads=2, stats=stats)
    assert state["loader"] == {"pos": 15} and torch.equal(state["small"], ref["small"])
    assert stats.manifests == [1] and {r for r, _ in stats.entries} == {1}


def test_restore_decodes_into_the_live_tensor(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)
    w = torch.zeros(64, 32)
    ptr = w.data_ptr()
    state: dict[str, Any] = {"model": {"w": w, "b": torch.zeros(64)}}
    restore_state(str(step), state, rank=0, world_size=1, threads=2)
    assert state["model"]["w"] is w and w.data_ptr() == ptr and torch.equal(w, ref["w"])
    # a non-contiguous live tensor is decoded aside and copied in
    wt = torch.zeros(32, 64).t()
    state = {"model": {"w": wt, "b": torch.zeros(64)}}
    restore_state(str(step), state, rank=0, world_size=1, threads=2)
    assert state["model"]["w"] is wt and torch.equal(wt, ref["w"])


def test_column_pieces_into_a_parameter(tmp_path: Path) -> None:
    """Shard(1) pieces, assembled whole (a strided copy per piece) into a tensor that requires grad."""
    full = torch.randn(40, 30)
    states, placements, start = [], {}, 0
    for r, block in enumerate(torch.chunk(full, 3, dim=1)):        # 10 columns each, uneven rows of chunks
        states.append({"w": block.contiguous()})
        placements[(r, "w")] = Placement((40, 30), (0, start))
        start += block.shape[1]
    step = write_step(tmp_path, "cols", 1, states, placements=placements, chunk_bytes=256, codec="bplane")
    w = torch.nn.Parameter(torch.zeros(40, 30))
    state: dict[str, Any] = {"w": w}
    stats = ckptd_client.ReadStats()
    restore_state(str(step), state, rank=0, world_size=1, threads=2, stats=stats)
    assert state["w"] is w and torch.equal(w.detach(), full) and sorted(stats.manifests) == [0, 1, 2]
    got = ckptd_client.load_tensor(step, "w", (slice(5, 9), slice(8, 23)))
    assert torch.equal(got, full[5:9, 8:23])


class Loader:
    def __init__(self, pos: int = -1) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


def test_per_rank_entries_at_another_world_size(tmp_path: Path) -> None:
    step, ref = sharded_step(tmp_path)

    def restore(rank: int, world: int, **kw: Any) -> Loader:
        loader = Loader()
        restore_state(str(step), {"loader": loader, "small": torch.zeros(3, dtype=torch.float64)}, rank=rank,
                      world_size=world, threads=1, **kw)
        return loader

    with pytest.raises(ckptd_client.CheckpointError) as err:
        restore(2, 3)
    msg = str(err.value)
    assert "'loader'" in msg and "per_rank=" in msg and "saved by 2 ranks" in msg and "'small'" not in msg
    assert restore(2, 3, per_rank={"loader": "fresh"}).pos == -1
    assert restore(2, 3, per_rank={"loader": "rank0"}).pos == 5
    assert restore(1, 3, per_rank="same-rank").pos == 15
    assert restore(2, 3, per_rank="same-rank").pos == -1
    assert restore(0, 1, per_rank={"loader": lambda rank, saved, world: saved - 1}).pos == 15
    assert restore(0, 1, per_rank={"loader": lambda rank, saved, world: None}).pos == -1
    assert restore(1, 2).pos == 15                   # same world size: its own, no rule needed
    with pytest.raises(ValueError, match="not a rule"):
        restore(0, 1, per_rank={"loader": "rank-zero"})
    with pytest.raises(ckptd_client.CheckpointError, match="returned 7"):
        restore(0, 1, per_rank={"loader": lambda rank, saved, world: 7})


class DrawsOnLoad(Loader):
    """A load that draws random numbers (reshuffles): must not disturb the restored RNG streams."""

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        torch.rand(5)
        random.random()


def test_rng_state_is_applied_last(tmp_path: Path) -> None:
    torch.manual_seed(3)
    random.seed(3)
    state: dict[str, Any] = {"rng": ckptd_client.RNGState(), "loader": DrawsOnLoad(4), "w": torch.ones(2)}
    step = write_step(tmp_path, "rng", 1, [state])
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    live: dict[str, Any] = {"rng": ckptd_client.RNGState(), "loader": DrawsOnLoad(), "w": torch.zeros(2)}
    restore_state(str(step), live, rank=0, world_size=1, threads=1)
    assert live["loader"].pos == 4 and torch.equal(live["w"], torch.ones(2))
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_mismatches_are_named(tmp_path: Path) -> None:
    step, _ = sharded_step(tmp_path)

    def restore(state: dict[str, Any]) -> None:
        restore_state(str(step), state, rank=0, world_size=1, threads=1)

    with pytest.raises(ckptd_client.CheckpointError, match=r"'model/extra' of the state is not in the checkpoint"):
        restore({"model": {"w": torch.zeros(64, 32), "b": torch.zeros(64), "extra": torch.zeros(1)}})
    with pytest.raises(ckptd_client.CheckpointError, match=r"'model/w': the checkpoint has float32, the state bf"):
        restore({"model": {"w": torch.zeros(64, 32, dtype=torch.bfloat16), "b": torch.zeros(64)}})
    with pytest.raises(ckptd_client.CheckpointError, match=r"'model/w': the checkpoint's shape is \[64, 32\]"):
        restore({"model": {"w": torch.zeros(32, 64), "b": torch.zeros(64)}})


def _as_format_1(step: Path) -> None:
    """Rewrite a committed single-tensor-kind step as format 1 (no placements, no tensor map)."""
    from ckptd.core.schema import digest_bytes
    idx = json.loads((step / "index.json").read_text())
    for r in range(idx["world_size"]):
        path = step / f"rank-{r:05d}.json"
        m = json.loads(path.read_text())
        m["format_version"] = 1
        data = json.dumps(m).encode()
        path.write_bytes(data)
        idx["ranks"][r]["manifest_digest"] = digest_bytes(data)
    idx["format_version"] = 1
    for key in ("tensors", "per_rank_keys", "digest"):
        idx.pop(key, None)
    (step / "index.json").write_text(json.dumps(idx))


def test_format_1_steps_restore_as_before(tmp_path: Path) -> None:
    step = write_step(tmp_path, "v1", 1, [{"w": torch.full((10,), float(r)), "r": r} for r in range(2)])
    _as_format_1(step)
    state: dict[str, Any] = {"w": torch.zeros(10), "r": -1}
    restore_state(str(step), state, rank=1, world_size=2, threads=1)
    assert state["r"] == 1 and torch.equal(state["w"], torch.ones(10))
    with pytest.raises(ckptd_client.CheckpointError, match="format-1 step .* cannot be resharded"):
        restore_state(str(step), {"w": torch.zeros(10)}, rank=0, world_size=1, threads=1)
    assert torch.equal(ckptd_client.load_tensor(step, "w", rank=1), torch.ones(10))


# ---- real rank groups: FSDP2 on gloo, a real daemon ---------------------------------------------
# This file is also the rank script: ``python tests/test_reshard.py <mode> <args>`` with RANK,
# WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (see ``run_group``).

JOB = "reshard"
SAVED_WORLD = 2


class Net(torch.nn.Module):
    """Rows 10 and 7, columns 16 and 10: uneven shards at 2 and 3 ranks, in both dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 10)
        self.down = torch.nn.Linear(10, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def build(layout: str, seed: int) -> tuple[Net, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Net()
    if layout != "plain":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        fn = (lambda p: Shard(1) if p.ndim > 1 else Shard(0)) if layout == "fsdp-shard1" else None
        for sub in (model.up, model.down):
            fully_shard(sub, mesh=mesh, shard_placement_fn=fn)
        fully_shard(model, mesh=mesh, shard_placement_fn=fn)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def flat_tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(flat_tensors(v, f"{path}/{k}" if path else str(k)))
    return out


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor by FQN path, gathered whole (``full_tensor()``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from ckptd_client.dtensor import is_dtensor
    flat = flat_tensors({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)})
    return {k: (v.full_tensor() if is_dtensor(v) else v).detach().clone()  # type: ignore[attr-defined]
            for k, v in flat.items()}


def dict_state(ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Zeros in the structure of ``ref``'s names: DTensors sharded on their last dimension over every
    rank (uneven where it does not divide), 0-d tensors plain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    out: dict[str, Any] = {}
    for name, full in ref.items():
        *parents, leaf = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        zeros = torch.zeros_like(full)
        node[leaf] = zeros if full.dim() == 0 else distribute_tensor(zeros, mesh, [Shard(full.dim() - 1)])
    return out


def differences(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(got) ^ set(ref))
    bad += [k for k in sorted(set(got) & set(ref))
            if got[k].dtype != ref[k].dtype or got[k].shape != ref[k].shape or not torch.equal(got[k], ref[k])]
    return bad


def raw_save(sock: str, step: int, rank: int, world: int, state: dict[str, Any]) -> None:
    """Save ``state`` as the sharded save side does (DTensors as local shards with placements, one
    writer per replicated placement), through the wire protocol: independent of the client's save."""
    from ckptd.core import protocol
    from ckptd.core.protocol import EventOp
    from ckptd_client.dtensor import is_dtensor, local_placement, writes_bytes
    from ckptd_client.session import DaemonSession
    from ckptd_client.state import is_stateful

    tensors: list[tuple[str, torch.Tensor, Placement | None]] = []

    def on_tensor(path: str, t: torch.Tensor) -> str:
        if is_dtensor(t):
            if writes_bytes(t):
                tensors.append((path, t.to_local(), local_placement(t)))  # type: ignore[attr-defined]
        else:
            tensors.append((path, t, None))
        return path

    def on_other(path: str, obj: Any) -> Any:
        if is_stateful(obj):
            return obj.state_dict()
        raise TypeError(path)

    tree = encode_tree(state, on_tensor, on_other, lambda o: isinstance(o, torch.Tensor))
    layout, offset = [], 0
    for name, t, p in tensors:
        nbytes = t.numel() * t.element_size()
        layout.append(TensorLayout(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes, p))
        offset += -(-nbytes // 64) * 64
    done, outcome = threading.Event(), list[tuple[Any, Any]]()

    def on_event(op: Any, msg: dict[str, Any]) -> None:
        if op in (EventOp.COMMITTED, EventOp.FAILED):
            outcome.append((op, msg))
            done.set()

    def on_lost(why: str) -> None:
        outcome.append(("lost", why))
        done.set()

    session = DaemonSession(sock, JOB, rank, world, 1, on_event, on_lost)
    conn = session.ensure_slots(offset)
    slot = session.acquire()
    assert slot is not None
    with torch.no_grad():
        for entry, (_, t, _) in zip(layout, tensors, strict=True):
            session.slots[slot].view(entry, t.dtype).copy_(t.detach())
    conn.request(protocol.Save(step=step, slot=slot, tensors=[e.to_wire() for e in layout], tree=tree,
                               commit="local"))
    assert done.wait(120) and outcome[0][0] is EventOp.COMMITTED, outcome
    session.drop()


def rank_main(mode: str, root: str, sock: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step_path = os.path.join(root, JOB, "step-000000000001")
    ref_path = os.path.join(root, "reference.safetensors")
    if mode == "save":
        model, opt = build("fsdp", seed=0)
        torch.manual_seed(100 + rank)                              # per-rank RNG streams
        loss = model(torch.randn(4, 16)).square().mean()
        loss.backward()
        opt.step()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                 "loader": Loader(10 * rank + 5), "rng": ckptd_client.RNGState()}
        raw_save(sock, 1, rank, world, state)
        ref = full_state(model, opt)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in ref.items()}, ref_path)
        # Same world size and layout: each rank reads its own manifest and its own entries only.
        model2, opt2 = build("fsdp", seed=7)
        stats = ckptd_client.ReadStats()
        live: dict[str, Any] = {"model": model2, "optim": opt2, "loader": Loader(), "rng": ckptd_client.RNGState()}
        restore_state(step_path, live, rank=rank, world_size=world, threads=2, stats=stats)
        assert stats.manifests == [rank] and {r for r, _ in stats.entries} == {rank}, stats
        assert live["loader"].pos == 10 * rank + 5
        assert not differences(full_state(model2, opt2), ref), differences(full_state(model2, opt2), ref)
        print(f"SAME-LAYOUT-OK {rank} read {stats.bytes} bytes in {stats.chunks} chunks", flush=True)
        # Same world size, another layout (Shard(0) -> Shard(1); FSDP2 shards dim 1 evenly only).
        model3, opt3 = build("fsdp-shard1", seed=7)
        ck = ckptd_client.Checkpointer(JOB, socket=sock, root=root)
        assert ck.restore({"model": model3, "optim": opt3}, step=1) == 1
        assert not differences(full_state(model3, opt3), ref), differences(full_state(model3, opt3), ref)
        assert "Shard(dim=1)" in str(getattr(model3.up.weight, "placements", None))
        ck.close()
        print(f"RELAYOUT-OK {rank}", flush=True)
    else:
        ref = load_file(ref_path)
        ck = ckptd_client.Checkpointer(JOB, socket=sock, root=root)
        # Dict-style state (as get_state_dict returns), its DTensors Shard(1), uneven at 3 ranks.
        live = dict_state(ref)
        assert ck.restore(live, step=1) == 1
        got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in flat_tensors(live).items()}
        assert not differences(got, ref), differences(got, ref)
        print(f"DICTS-OK {rank}/{world} {live['model']['up.weight'].to_local().shape}", flush=True)
        # A plain model's checkpoint (one process, optimizer keyed by parameter index) into FSDP2.
        plain_ref = load_file(os.path.join(root, "plain-reference.safetensors"))
        model, opt = build("fsdp", seed=7)
        plain = ckptd_client.Checkpointer("plainsave", socket=sock, root=root)
        assert plain.restore({"model": model, "optim": opt}, step=1) == 1
        assert not differences(full_state(model, opt), plain_ref), differences(full_state(model, opt), plain_ref)
        print(f"PLAIN-TO-FSDP-OK {rank}", flush=True)
        for layout in ("fsdp",):
            model, opt = build(layout, seed=7)
            live = {"model": model, "optim": opt, "loader": Loader(), "rng": ckptd_client.RNGState()}
            try:
                ck.restore(live, step=1)
                raise AssertionError("per-rank entries restored without a rule")
            except ckptd_client.CheckpointError as e:
                assert "'loader'" in str(e) and "'rng'" in str(e) and "per_rank=" in str(e), e
            assert ck.restore(live, step=1, per_rank={"loader": "same-rank", "rng": "fresh"}) == 1
            assert live["loader"].pos == (10 * rank + 5 if rank < SAVED_WORLD else -1)
            assert not differences(full_state(model, opt), ref), (layout, differences(full_state(model, opt), ref))
            placements = {str(getattr(p, "placements", None)) for p in model.parameters()}
            model(torch.randn(4, 16)).square().mean().backward()      # the restored state trains
            opt.step()
            print(f"RESHARD-OK {layout} {rank}/{world} {sorted(placements)}", flush=True)
        ck.close()
    dist.destroy_process_group()


def run_group(world: int, *args: str, timeout: float = 150) -> list[str]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(zygote.popen([sys.executable, str(HERE), *args], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outs[r][-5000:]}"
    return outs


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 2-rank FSDP2 (Shard(0), uneven) step saved through a real daemon, with its reference."""
    from ckptd.launch import spawn_daemon
    short = Path(f"/tmp/ckr-{os.getpid()}")          # unix socket paths stay short
    short.mkdir(exist_ok=True)
    d = spawn_daemon(short / "root", short / "d.sock")
    try:
        outs = run_group(SAVED_WORLD, "save", str(d.root), str(d.socket))
        yield d, outs
    finally:
        d.stop()
        subprocess.run(["rm", "-rf", str(short)], check=False)


def test_same_layout_reads_own_files_only(saved: Any) -> None:
    _, outs = saved
    assert all(f"SAME-LAYOUT-OK {r}" in out for r, out in enumerate(outs)), outs


def test_two_ranks_to_three_uneven_shard0_and_shard1(saved: Any) -> None:
    """Also: a plain model saved in one process (optimizer keyed by index) restores into FSDP2."""
    from safetensors.torch import save_file
    d, _ = saved
    model, opt = build("plain", seed=3)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    ck = ckptd_client.Checkpointer("plainsave", socket=str(d.socket), rank=0, world_size=1)
    ck.save(1, {"model": model, "optim": opt}).wait(60)
    ck.close()
    ref = {k: v.contiguous() for k, v in full_state(model, opt).items()}
    save_file(ref, str(d.root / "plain-reference.safetensors"))
    outs = run_group(3, "restore", str(d.root), str(d.socket))
    for r, out in enumerate(outs):
        assert f"RESHARD-OK fsdp {r}/3" in out and f"DICTS-OK {r}/3" in out, out
        assert f"PLAIN-TO-FSDP-OK {r}" in out, out
    assert "DICTS-OK 2/3 torch.Size([10, 4])" in outs[2]         # 16 columns at 3 ranks: 6, 6, 4


def test_same_world_size_other_layout(saved: Any) -> None:
    _, outs = saved
    assert all(f"RELAYOUT-OK {r}" in out for r, out in enumerate(outs)), outs


def test_two_ranks_to_one_plain_model(saved: Any) -> None:
    from safetensors.torch import load_file
    d, _ = saved
    ref = load_file(str(d.root / "reference.safetensors"))
    model, opt = build("plain", seed=7)
    ck = ckptd_client.Checkpointer(JOB, root=str(d.root), socket="/nonexistent.sock", rank=0, world_size=1)
    assert ck.restore({"model": model, "optim": opt}, step=1) == 1      # per-rank entries not in the state
    got = full_state(model, opt)
    assert not differences(got, ref), differences(got, ref)
    assert all(float(s["step"]) == 1.0 for s in opt.state.values())
    step = d.root / JOB / "step-000000000001"
    stats = ckptd_client.ReadStats()
    col = ckptd_client.load_tensor(step, "optim/state/up.weight/exp_avg", (slice(None), slice(2, 5)), stats=stats)
    assert torch.equal(col, ref["optim/state/up.weight/exp_avg"][:, 2:5]) and sorted(stats.manifests) == [0, 1]
    stats = ckptd_client.ReadStats()
    row = ckptd_client.load_tensor(step, "model/up.weight", (slice(6, 8),), stats=stats)
    assert torch.equal(row, ref["model/up.weight"][6:8]) and stats.manifests == [1]     # rows 5..9 are rank 1's


if __name__ == "__main__":
    rank_main(*sys.argv[1:])


def _elements(r: Region) -> set[tuple[int, ...]]:
    import itertools
    return set(itertools.product(*(range(o, o + s) for o, s in zip(r.offsets, r.sizes, strict=True))))


def test_region_intersect_and_row_span_match_their_elements() -> None:
    """Region.intersect is the set of shared elements (None when empty), and row_span the bytes from
    the first to the last element of a part in its piece's row-major order: brute force over random
    regions of 0-3 dimensions, half of the pairs equal (a restore at the saved layout), empty ones too."""
    import itertools
    rng = random.Random(5)
    for _ in range(3000):
        n = rng.randint(0, 3)
        a = Region(tuple(rng.randint(0, 3) for _ in range(n)), tuple(rng.randint(0, 3) for _ in range(n)))
        b = a if rng.random() < 0.5 else \
            Region(tuple(rng.randint(0, 3) for _ in range(n)), tuple(rng.randint(0, 3) for _ in range(n)))
        got, shared = a.intersect(b), _elements(a) & _elements(b)
        assert (got is None) == (not shared), (a, b, got)
        if got is None:
            continue
        assert _elements(got) == shared and all(got.sizes), (a, b, got)
        itemsize = rng.choice((1, 2, 4))
        strides = [itemsize * math.prod(a.sizes[d + 1:]) for d in range(n)]
        offs = [sum((e[d] - a.offsets[d]) * strides[d] for d in range(n)) for e in _elements(got)]
        assert row_span(a, got, itemsize) == (min(offs), max(offs) + itemsize), (a, got)
    assert list(itertools.islice(_elements(Region((), ())), 2)) == [()]     # a scalar: one element


def edited_step(daemon: Any, job: str, state: dict[str, Any], manifest: Any, index: Any) -> Path:
    """Step 1 of ``job`` saved through the daemon, then its rank 0 manifest and index edited by
    ``manifest(m)`` and ``index(i)`` and re-signed (digests recomputed), as someone who can write the
    step could: every check that is not a digest must catch what was changed."""
    from test_security import craft_manifest
    with ckptd_client.Checkpointer(job, socket=str(daemon.socket)) as ck:
        ck.save(1, state).wait(60)
    step = Path(daemon.root) / job / "step-000000000001"
    craft_manifest(step, manifest, index)
    return step


def entry(m: Any, name: str) -> Any:
    (t,) = [t for t in m["tensors"] if t["name"] == name]
    return t


def test_pieces_that_overlap_and_leave_a_gap_as_large_are_refused(daemon: Any) -> None:
    """An edited step whose two pieces of a 128-element tensor cover [0, 64) and [32, 96): the restore
    counted 128 elements covered, read both (the second over the first) and left [96, 128) as it was,
    reporting success. Now the overlap is named, nothing written."""
    import copy

    def manifest(m: Any) -> None:
        w = entry(m, "w")
        w["global"] = {"shape": [128], "offsets": [0]}
        second = copy.deepcopy(w)
        second["name"], second["global"] = "wB", {"shape": [128], "offsets": [32], "key": "w"}
        m["tensors"].append(second)

    def index(i: Any) -> None:
        i["tensors"]["w"] = {"dtype": "float32", "shape": [128], "kind": "sharded",
                             "pieces": [{"rank": 0, "name": "w", "offsets": [0], "sizes": [64]},
                                        {"rank": 0, "name": "wB", "offsets": [32], "sizes": [64]}]}
    edited_step(daemon, "edited", {"w": torch.arange(64.0)}, manifest, index)
    live = {"w": torch.full((128,), 7.0)}
    reader = ckptd_client.Checkpointer("edited", root=str(daemon.root), memory=False, prepare=False)
    with pytest.raises(ckptd_client.CheckpointError, match="'w': the saved pieces overlap and leave a gap"):
        reader.restore(live, step=1)
    assert torch.equal(live["w"], torch.full((128,), 7.0))


@pytest.mark.parametrize("case", ["dim 2**63", "strides past int64", "24 bytes claiming 4 TiB"])
def test_sizes_beyond_any_tensor_are_format_errors_before_any_allocation(daemon: Any, case: str) -> None:
    """An edited step's tensor of shape [0, 2**63] or [0, 2**62, 2**62] (numel 0: verify said OK, a
    restore failed inside torch, export wrote a header safetensors cannot load), or one 24-byte zstd
    chunk claiming 4 TiB (a restore tried to allocate them; export died with numpy's MemoryError).
    Each is now refused by the manifest's parse, naming the tensor, by every reader."""
    from ckptd.core.reader import verify_step
    shape, chunks = {
        "dim 2**63": ([0, 2**63], None),
        "strides past int64": ([0, 2**62, 2**62], None),
        "24 bytes claiming 4 TiB": ([2**40], [["zstd", 2**42, 24, "2d1a3c579a15eedd", [[24, "z"]],
                                               "0000000000000000"]]),
    }[case]

    def manifest(m: Any) -> None:
        x = entry(m, "x")
        x["shape"] = shape
        if chunks is not None:
            x["chunks"] = chunks

    def index(i: Any) -> None:
        i["tensors"]["x"]["shape"] = shape
    step = edited_step(daemon, f"big{len(case)}", {"x": torch.zeros(0), "y": torch.arange(4.0)}, manifest, index)
    faults = verify_step(str(step))
    assert faults and all(f.reason for f in faults), faults
    assert "beyond any tensor" in " ".join(f.reason for f in faults) or \
        "more than any codec expands to" in " ".join(f.reason for f in faults), faults
    reader = ckptd_client.Checkpointer(f"big{len(case)}", root=str(daemon.root), memory=False, prepare=False)
    with pytest.raises(ckptd_client.CheckpointError, match="beyond any tensor|more than any codec expands to"):
        reader.restore({"y": torch.zeros(4)}, step=1)
