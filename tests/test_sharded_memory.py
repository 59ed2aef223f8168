"""Sharded state restored from the daemons' memory: same layout, and after a node is lost (issue 20).

Two daemons on loopback stand for two nodes (2 ranks each, one shared root, peers of each other
with K = 1 copy). Real rank processes (tests/sharded_trainer.py, gloo) train FSDP2, FSDP x TP 2x2
or DDP with AdamW, a cosine schedule, a per-rank loader and per-rank RNG streams, and save every 4
steps. Every data file of the job is deleted before each restore, so a restore can only come from
the daemons' memory; what each rank restored is compared bit for bit with the reference it wrote
at save time.
"""
# mypy: disable-error-code="union-attr,index"
from __future__ import annotations

import json
import math
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import sharded_trainer as st
from test_acceptance import free_port
from test_memory_tier import remove_data_files
from test_peers import held_steps, peer_args, secret_file, wait_for
from test_sharded import SAVED_STEP, assert_bit_identical

pytestmark = pytest.mark.timeout(600)
STEPS, EVERY = 16, 4
PER_RANK = {"per_rank": {"data": "same-rank", "rng": "same-rank"}}


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in st.lines(out, "LOSS")}


def restore_info(out: str) -> tuple[str, int, int, int]:
    info = st.lines(out, "RESTORE-INFO")
    assert len(info) == 1, out
    source, mem, peer, storage = info[0]
    return source, int(mem), int(peer), int(storage)


def replicated(sock: Path, step: int) -> bool:
    return any(s["step"] == step and s["committed"] and s["replicated"] for s in held_steps(sock))


@pytest.mark.parametrize("layout", ["fsdp", "tp", "ddp"])
def test_restart_and_node_loss_restore_from_memory(daemon_factory: Any, tmp: Path, layout: str) -> None:
    """Acceptance 1-3. Every trainer SIGKILLed, the data files deleted: 4 ranks restart at the same
    layout and each restores its local shards from its daemon's memory (0 bytes from storage),
    bit-exact, and trains on exactly as an uninterrupted run does. Then node B's daemon is
    SIGKILLed and the data files deleted again: 2 ranks on node A restore the newest step from A's
    memory (its own shards and B's replicas), resharded 4 -> 2, bit-exact; storage bytes read 0."""
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret), name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret), name="b")
    sockets = f"{a.socket},{b.socket}"
    ref_out, out = tmp / "ref", tmp / "out"
    ref_out.mkdir()
    out.mkdir()
    steps = ("--steps", str(STEPS), "--every", str(EVERY), "--layout", layout)
    reference = st.run_group(4, "train", "--job", "ref", "--out", str(ref_out), "--socket", sockets, *steps)

    common = ("--job", "mem", "--out", str(out), "--socket", sockets, *steps)
    procs = st.launch(4, "train", *common, "--step-sleep", "0.3")
    seen = st.kill_after_commit(procs, 8)
    assert "DONE" not in "".join(seen), "".join(seen)
    wait_for(lambda: replicated(a.socket, 8) and replicated(b.socket, 8), "step 8 held and replicated")
    assert remove_data_files(a.root, "mem") >= 4

    # 1. Same layout: every rank from its own daemon's memory, nothing from storage.
    outs = st.run_group(4, "train", *common)
    restored = {int(st.lines(o, "RESTORED")[0][0]) for o in outs}
    assert len(restored) == 1, outs[0]
    step = restored.pop()
    assert step >= 8 and step % EVERY == 0
    for rank, o in enumerate(outs):
        source, mem, peer, storage = restore_info(o)
        assert (source, peer, storage) == ("memory", 0, 0) and mem > 0, o
        got, want = load(out / f"restored-w4.rank{rank}.pt"), load(out / f"ref-step{step}.rank{rank}.pt")
        assert_bit_identical(got["local"], want["local"], f"rank {rank}'s shards of step {step}")
        assert got["scalars"] == want["scalars"]
        assert got["loader"]["served"] == want["loader"]["served"] == step
        assert torch.equal(got["torch_rng"], want["torch_rng"])
        want_losses = {s: v for s, v in losses(reference[rank]).items() if s > step}
        assert losses(o) == want_losses and sorted(want_losses) == list(range(step + 1, STEPS + 1)), o
    assert_bit_identical(load(out / "restored-w4.full.pt"), load(out / f"ref-step{step}.full.pt"), "full tensors")

    # 2. Node B lost: its daemon SIGKILLed, the data files deleted; the job comes back on node A alone.
    wait_for(lambda: replicated(a.socket, STEPS) and replicated(b.socket, STEPS), f"step {STEPS} replicated")
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait()
    assert remove_data_files(a.root, "mem") >= 4
    two = "fsdp" if layout == "tp" else layout           # the 2x2 mesh needs 4 ranks: FSDP2 on 2
    outs = st.run_group(2, "train", "--job", "mem", "--out", str(out), "--socket", str(a.socket),
                        "--steps", str(STEPS + EVERY), "--every", str(EVERY), "--layout", two,
                        "--restore-kwargs", json.dumps(PER_RANK))
    for rank, o in enumerate(outs):
        assert st.lines(o, "RESTORED") == [[str(STEPS)]], o
        source, mem, peer, storage = restore_info(o)
        assert (source, peer, storage) == ("memory", 0, 0) and mem > 0, o
        got = load(out / f"restored-w2.rank{rank}.pt")
        want = load(out / f"ref-step{STEPS}.rank{rank}.pt")
        assert got["scalars"]["meta"] == want["scalars"]["meta"]
        saved_dp_rank = rank // 2 if layout == "tp" else rank    # (the loader saved by rank r: r's dp rank's)
        assert got["loader"]["from"] == saved_dp_rank and got["loader"]["served"] == STEPS
        assert all(math.isfinite(v) for v in losses(o).values()) and "DONE" in o
    assert_bit_identical(load(out / "restored-w2.full.pt"), load(out / f"ref-step{STEPS}.full.pt"),
                         f"step {STEPS} resharded 4 -> 2 from node A's memory")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_same_layout_held_shard_read_whole_into_dtensors(daemon_factory: Any, tmp: Path, layout: str) -> None:
    """DCP's spelling (``get_state_dict`` dicts: AdamW state allocated) at the saved layout: each rank's
    held shard is copied whole into its DTensors' local shards (``RestoreInfo.whole``, no region
    planning), 0 bytes from storage (every data file deleted), every local shard and AdamW tensor
    bit-identical; under TP the ranks that did not write the replicated biases (tp coordinate 1) read
    those from the writers' shards, as pieces. The objects spelling (a fresh model and AdamW) the same
    way: the restore reads into their FQN state dicts, AdamW's state created first as torch does."""
    daemon = daemon_factory(name="n0")
    out = tmp / "out"
    out.mkdir()
    saved = st.run_group(4, "save", "--layout", layout, "--job", layout, "--socket", str(daemon.socket),
                         "--out", str(out), "--steps", str(SAVED_STEP))
    assert f"COMMITTED {SAVED_STEP}" in saved[0], saved[0]
    writers = {0, 2} if layout == "tp" else {0, 1, 2, 3}
    for spelling in ("dicts", "objects"):
        job = f"{layout}-{spelling}"
        wait_for(lambda: any(s["step"] == SAVED_STEP and s["committed"] and s["job"] == job  # noqa: B023 (at once)
                             for s in held_steps(daemon.socket)), f"{job} step held")
        assert remove_data_files(daemon.root, job) == 4
        outs = st.run_group(4, "restore", "--layout", layout, "--spelling", spelling, "--job", job,
                            "--socket", str(daemon.socket), "--out", str(out), "--tag", spelling)
        for rank, o in enumerate(outs):
            assert restore_info(o)[0] == "memory" and restore_info(o)[3] == 0, o
            whole = rank in writers
            assert st.lines(o, "RESTORE-WHOLE") == [[str(whole)]], o
            want, got = load(out / f"saved.rank{rank}.pt"), load(out / f"{spelling}.rank{rank}.pt")
            assert got["placements"] == want["placements"], f"rank {rank}: the layout changed"
            assert_bit_identical(got["local"], want["local"], f"{spelling} rank {rank} local shard")


@pytest.mark.parametrize("spelling", ["dicts", "objects"])
def test_one_rank_mesh_held_shard_read_whole(daemon_factory: Any, tmp: Path, spelling: str) -> None:
    """FSDP2 on a 1-rank mesh (a single-GPU run of an FSDP2 script): every DTensor's local shard is
    the whole tensor, held as the whole tensor. It is read in place like any held piece
    (``RestoreInfo.whole``) from memory, data files deleted, bit-identical — not refused and then
    fetched and planned again as pieces — and the next training step's loss is the saving run's. In
    the objects spelling (a fresh model and AdamW) the optimizer's state is DTensors, as torch's
    ``set_optimizer_state_dict`` makes it (plain tensors beside DTensor parameters made that step fail)."""
    daemon = daemon_factory(name="n0")
    out = tmp / "out"
    out.mkdir()
    saved = st.run_group(1, "save", "--layout", "fsdp", "--job", "one", "--socket", str(daemon.socket),
                         "--out", str(out), "--steps", str(SAVED_STEP))
    assert f"COMMITTED {SAVED_STEP}" in saved[0], saved[0]
    job = f"one-{spelling}"
    wait_for(lambda: any(s["step"] == SAVED_STEP and s["committed"] and s["job"] == job
                         for s in held_steps(daemon.socket)), "step held")
    assert remove_data_files(daemon.root, job) == 1
    (o,) = st.run_group(1, "restore", "--layout", "fsdp", "--spelling", spelling, "--job", job, "--then-step",
                        "--socket", str(daemon.socket), "--out", str(out), "--tag", spelling)
    assert restore_info(o)[0] == "memory" and restore_info(o)[3] == 0, o
    assert st.lines(o, "RESTORE-WHOLE") == [["True"]], o
    want, got = load(out / "saved.rank0.pt"), load(out / f"{spelling}.rank0.pt")
    assert got["placements"] == want["placements"]
    assert_bit_identical(got["local"], want["local"], "1-rank FSDP2 parameters and AdamW state")
    next_step = str(SAVED_STEP + 1)
    assert [x for x in st.lines(o, "LOSS-AFTER") if x[0] == next_step] == \
        [x for x in st.lines(saved[0], "LOSS-AFTER") if x[0] == next_step] != [], (o, saved[0])
