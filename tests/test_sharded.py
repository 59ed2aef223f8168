"""Acceptance: sharded state (FSDP2, FSDP x TP) saved as local shards, restored into any layout.

Every scenario runs as real rank processes (tests/sharded_trainer.py) joined by gloo over TCP on
this machine's CPUs, saving through a real daemon subprocess. What a rank holds is compared bit
for bit with a reference taken at save time: each rank's local shards (same layout) or the full
tensors gathered then and written by rank 0 with torch.save (any other layout).
"""
# mypy: disable-error-code="union-attr,index"
# (pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote

from ckptd.core.global_index import parse_tensor_map
from ckptd.launch import spawn_daemon

import sharded_trainer as st

pytestmark = pytest.mark.timeout(600)

# The per-rank opt-in of Checkpointer.restore for a world-size change (ckptd_client/checkpointer.py):
# every rank takes the saved entry of the rank with its own number (the data loader's position and
# shuffle stream, the RNG streams).
PER_RANK_OPT_IN: dict[str, Any] = {"per_rank": {"data": "same-rank", "rng": "same-rank"}}
PER_RANK_ERROR = "ckptd_client.errors.CheckpointError"

SAVED_STEP = 3          # sharded_trainer's `save` mode trains this many steps, then saves


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


@dataclass
class Saved:
    """A committed checkpoint of one layout, in both spellings (jobs ``<job>-dicts``, ``<job>-objects``),
    with the reference written by the ranks at save time."""
    layout: str
    world: int
    job: str
    root: Path
    out: Path

    def rank_ref(self, rank: int) -> dict[str, Any]:
        return load(self.out / f"saved.rank{rank}.pt")

    def full_ref(self) -> dict[str, torch.Tensor]:
        return load(self.out / "saved.full.pt")


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    short = Path(f"/tmp/cks-{time.monotonic_ns() % 10**9}")     # unix socket paths stay short
    short.mkdir()
    yield short
    subprocess.run(["rm", "-rf", str(short)], check=False)


def save_checkpoint(base: Path, layout: str, world: int) -> Saved:
    out = base / f"out-{layout}"
    out.mkdir()
    daemon = spawn_daemon(base / "root", base / f"{layout}.sock", log=base / f"{layout}.log")
    try:
        outs = st.run_group(world, "save", "--layout", layout, "--job", layout, "--socket", str(daemon.socket),
                            "--out", str(out), "--steps", str(SAVED_STEP))
    finally:
        daemon.stop()
    assert f"COMMITTED {SAVED_STEP}" in outs[0], outs[0]
    for spelling in ("dicts", "objects"):
        step = base / "root" / f"{layout}-{spelling}" / f"step-{SAVED_STEP:012d}"
        assert (step / "index.json").is_file(), f"{step} not committed"
    return Saved(layout, world, layout, base / "root", out)


@pytest.fixture(scope="module")
def fsdp_saved(base: Path) -> Saved:
    """FSDP2 on 4 ranks: Shard(0), the 10-row head sharded 3/3/3/1."""
    return save_checkpoint(base, "fsdp", 4)


@pytest.fixture(scope="module")
def tp_saved(base: Path) -> Saved:
    """FSDP x TP on a 2x2 mesh: _StridedShard x Shard(0), Shard(0) x Shard(1), replicated biases."""
    return save_checkpoint(base, "tp", 4)


def restore(saved: Saved, world: int, layout: str, spelling: str, tag: str,
            restore_kwargs: dict[str, Any] | None = None) -> list[str]:
    outs = st.run_group(world, "restore", "--layout", layout, "--spelling", spelling,
                        "--job", f"{saved.job}-{spelling}", "--root", str(saved.root), "--out", str(saved.out),
                        "--tag", tag, "--restore-kwargs", json.dumps(restore_kwargs or {}))
    assert all(f"RESTORED {SAVED_STEP}" in o for o in outs), outs[0]
    return outs


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: tensor names differ"
    for name in sorted(want):
        a, b = got[name], want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{what} {name}: {a.dtype}{tuple(a.shape)} vs saved {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            f"{what} {name}: values differ from the saved ones"


def assert_scalars(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """step (in the tensors), lr, the schedule and the epoch: exactly the saved values."""
    assert got["lr"] == want["lr"], f"{what}: lr {got['lr']} != saved {want['lr']}"
    assert got["sched_last_epoch"] == want["sched_last_epoch"] == SAVED_STEP, what
    assert got["sched_last_lr"] == want["sched_last_lr"], what
    assert got["meta"] == want["meta"], f"{what}: {got['meta']} != saved {want['meta']}"


def expected_names(full: dict[str, torch.Tensor]) -> None:
    """The reference holds what it should: every parameter with step, exp_avg and exp_avg_sq."""
    params = [n[len("model/"):] for n in full if n.startswith("model/")]
    assert len(params) == 8
    for p in params:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert f"optim/{p}/{k}" in full, f"reference lacks optim/{p}/{k}"
    assert all(float(full[f"optim/{p}/step"]) == SAVED_STEP for p in params)


# ---- 1. same layout --------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("spelling", ["dicts", "objects"])
def test_same_layout_bit_identical(request: pytest.FixtureRequest, layout: str, spelling: str) -> None:
    """Save both spellings, restore into the same layout: every local shard and every AdamW tensor is
    bit-identical, step/lr/epoch exact."""
    saved: Saved = request.getfixturevalue(f"{layout}_saved")
    tag = f"same-{layout}-{spelling}"
    restore(saved, saved.world, layout, spelling, tag)
    full = saved.full_ref()
    expected_names(full)
    for rank in range(saved.world):
        want = saved.rank_ref(rank)
        got = load(saved.out / f"{tag}.rank{rank}.pt")
        assert got["placements"] == want["placements"], f"rank {rank}: the layout changed"
        assert_bit_identical(got["local"], want["local"], f"rank {rank} local shard")
        assert_scalars(got["scalars"], want["scalars"], f"rank {rank}")
    assert_bit_identical(load(saved.out / f"{tag}.full.pt"), full, "full tensors")


@pytest.mark.parametrize("spelling", ["dicts", "objects"])
def test_tp_replicas_written_once(tp_saved: Saved, spelling: str) -> None:
    """The FSDP x TP checkpoint really is 2-D (strided and column shards), every replicated region is
    written once — a Replicate() placement on "tp", and a DTensor on the "dp" sub-mesh, which each tp
    rank holds a replica of — and the step passes `ckptd verify`."""
    placements = tp_saved.rank_ref(0)["placements"]
    assert "_StridedShard" in placements["model/up.weight"], placements
    assert "Shard(dim=1)" in placements["model/down.weight"], placements
    assert "Replicate()" in placements["model/down.bias"], placements
    assert placements["model/head.weight"] == "(Shard(dim=0),)", placements     # on the dp sub-mesh
    step = tp_saved.root / f"tp-{spelling}" / f"step-{SAVED_STEP:012d}"
    index = json.loads((step / "index.json").read_text())
    for name in ("model/down.bias", "model/head.weight", "model/norm.weight", "optim/state/head.weight/exp_avg"):
        pieces = parse_tensor_map(index["tensors"], index["world_size"])[name].pieces    # listed or a grid
        assert len(pieces) == 2, f"{name}: {pieces}"    # 2 dp shards, each written by one of its 2 tp replicas
    # The strided (FSDP over TP on dim 0) weight is stored as a two-level grid: TP's cut, then FSDP's.
    up = index["tensors"]["model/up.weight"]
    assert up["grid"]["counts"][0] == [2, 2] and up["grid"]["strides"][0] == [1, 2], up
    verify = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(step)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]


# ---- 2. resharding ---------------------------------------------------------------------------

RESHARD_TARGETS = [
    # (id, ranks, layout, spelling)
    ("2-ranks", 2, "fsdp", "dicts"),
    ("8-ranks", 8, "fsdp", "objects"),
    ("3-ranks-uneven", 3, "fsdp", "dicts"),
    ("shard1", 4, "fsdp-shard1", "objects"),
    ("2x2-mesh", 4, "tp", "dicts"),
    ("plain-dicts", 0, "plain", "dicts"),
    ("plain-objects", 0, "plain", "objects"),
]


@pytest.mark.parametrize(("ranks", "layout", "spelling"), [t[1:] for t in RESHARD_TARGETS],
                         ids=[t[0] for t in RESHARD_TARGETS])
def test_reshard_from_fsdp4(fsdp_saved: Saved, ranks: int, layout: str, spelling: str) -> None:
    """The 4-rank FSDP2 checkpoint restores into another world size / placement / a plain model:
    full_tensor() of every parameter and Adam moment equals the reference bit for bit."""
    tag = f"reshard-{ranks}-{layout}-{spelling}"
    restore(fsdp_saved, ranks, layout, spelling, tag)
    full = fsdp_saved.full_ref()
    expected_names(full)
    assert_bit_identical(load(fsdp_saved.out / f"{tag}.full.pt"), full, f"{tag} full tensors")
    want = fsdp_saved.rank_ref(0)["scalars"]
    for rank in range(max(1, ranks)):
        got = load(fsdp_saved.out / f"{tag}.rank{rank}.pt")
        assert_scalars(got["scalars"], want, f"{tag} rank {rank}")
        if layout == "fsdp-shard1":
            assert got["placements"]["model/up.weight"] == "(Shard(dim=1),)", got["placements"]


# ---- 3. SIGKILL a 4-rank FSDP2 run, resume on 2 ranks ----------------------------------------

def test_sigkill_resume_on_fewer_ranks(daemon: Any, tmp: Path) -> None:
    """4 FSDP2 ranks with a per-rank loader and RNG streams are SIGKILLed after a commit; 2 ranks
    resume with the per-rank opt-in (without it the restore fails, naming the error): the restored
    weights and optimizer state equal the saved ones and training goes on."""
    out = tmp / "out"
    out.mkdir()
    common = ("--job", "killed", "--out", str(out), "--socket", str(daemon.socket))
    procs = st.launch(4, "train", *common, "--steps", "40", "--every", "4", "--step-sleep", "0.15")
    seen = st.kill_after_commit(procs, 8)
    assert any(line.startswith("COMMITTED") for line in seen), "".join(seen) + procs[0].stdout.read()
    assert all(p.returncode == -signal.SIGKILL for p in procs), [p.returncode for p in procs]
    assert "DONE" not in "".join(seen)

    # Without the opt-in, a restore at another world size refuses the per-rank entries.
    refused = st.run_group(2, "train", *common, "--steps", "40", "--every", "4", expect_rc=st.RESTORE_ERROR_EXIT)
    for o in refused:
        err = st.lines(o, "RESTORE-ERROR")
        assert err, o
        text = " ".join(err[0])
        assert err[0][0] == PER_RANK_ERROR + ":", text
        assert "'data'" in text and "'rng'" in text and "per_rank=" in text and "saved by 4 ranks" in text, text
    assert not list(out.glob("restored-w2.*"))

    # With it, 2 ranks resume from the last committed step and train on.
    outs = st.run_group(2, "train", *common, "--steps", "40", "--every", "4",
                        "--restore-kwargs", json.dumps(PER_RANK_OPT_IN))
    restored = st.lines(outs[0], "RESTORED")
    assert restored, outs[0]
    step = int(restored[0][0])
    assert step >= 8 and step % 4 == 0
    assert (daemon.root / "killed" / f"step-{step:012d}" / "index.json").is_file()
    assert_bit_identical(load(out / "restored-w2.full.pt"), load(out / f"ref-step{step}.full.pt"),
                         f"restored step {step}")
    for rank in range(2):
        got, want = load(out / f"restored-w2.rank{rank}.pt"), load(out / f"ref-step{step}.rank{rank}.pt")
        assert got["scalars"]["lr"] == want["scalars"]["lr"]
        assert got["scalars"]["sched_last_epoch"] == want["scalars"]["sched_last_epoch"] == step
        assert got["scalars"]["meta"] == want["scalars"]["meta"]
        # rank r resumed the data stream and the RNG stream saved by rank r
        assert got["loader"]["from"] == rank
        assert got["loader"]["served"] == want["loader"]["served"] == step
        assert got["loader"]["epoch"] == want["loader"]["epoch"]
        assert torch.equal(got["torch_rng"], want["torch_rng"])
    for o in outs:
        losses = {int(s): float(v) for s, v in st.lines(o, "LOSS")}
        assert sorted(losses) == list(range(step + 1, 41)), o
        assert all(math.isfinite(v) for v in losses.values())
        assert "DONE" in o
    final = daemon.root / "killed" / f"step-{40:012d}" / "index.json"
    assert final.is_file()
    assert json.loads(final.read_text())["world_size"] == 2



SUBMESH_WORKER = '''
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
import ckptd_client
mode, sock = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=4)
rank = dist.get_rank()
mesh = DeviceMesh("cpu", torch.tensor([2, 3]))          # a sub-mesh: ranks 0 and 1 are outside it
full = torch.arange(15.).reshape(5, 3)
w = distribute_tensor(full if mode == "save" else torch.zeros(5, 3), mesh, [Shard(0)])
plain = torch.full((4,), float(rank))
ck = ckptd_client.Checkpointer("submesh", socket=sock)
if mode == "save":
    ck.save(1, {"w": w, "plain": plain}).wait(60)
else:
    out = {"w": w, "plain": torch.zeros(4)}
    assert ck.restore(out) == 1
    assert torch.equal(out["plain"], plain)
    if rank >= 2:
        assert torch.equal(w.to_local(), full[(rank - 2) * 3:(rank - 2) * 3 + 3])
    print("RESTORED", flush=True)
ck.close(30)
dist.barrier()
dist.destroy_process_group()
'''


def test_a_dtensor_on_a_sub_mesh_restores_on_the_ranks_outside_it(tmp: Path) -> None:
    """4 ranks, a DTensor on the mesh of ranks 2 and 3 (pipeline stages build such meshes on every rank).
    It saved and committed, but the ranks outside its mesh could not restore the step: torch gives them
    a one-dimensional empty region whatever the tensor's dimensions, and the read refused it."""
    from test_acceptance import free_port

    script = tmp / "submesh_worker.py"
    script.write_text(SUBMESH_WORKER)
    d = spawn_daemon(tmp / "root", tmp / "d.sock")
    try:
        for mode in ("save", "restore"):
            port = str(free_port())
            # Forked from the zygote (torch and DTensor imported once, not in each of 8 interpreters).
            procs = [zygote.popen([sys.executable, str(script), mode, str(d.socket)], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**os.environ, "RANK": str(r), "MASTER_PORT": port})
                     for r in range(4)]
            outs = [p.communicate(timeout=180)[0] for p in procs]
            assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-2000:] for o in outs)
        assert all("RESTORED" in o for o in outs)
    finally:
        d.close()
