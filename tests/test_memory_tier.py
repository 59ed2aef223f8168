"""The daemon's memory tier: restores served from its memory (no storage read), checksummed, budgeted."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from procfd import memfds_named

import ckptd_client
from ckptd.core import protocol
from ckptd_client.held_pieces import DaemonShards
from ckptd_client.memory_restore import MemoryUnavailable

from test_acceptance import assert_same_tensors, finish, kill_after_commit, launch

MiB = 1024 * 1024


def status(sock: Path) -> dict[str, Any]:
    return protocol.request_once(str(sock), {"op": "status"})


def remove_data_files(root: Path, job: str) -> int:
    """Delete every data file of the job's committed steps: a restore can then only come from memory."""
    gone = 0
    for data in root.glob(f"{job}/step-*/rank-*.data"):
        if (data.parent / "index.json").exists():
            data.unlink()
            gone += 1
    return gone


def state_of(seed: int, mib: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "b": torch.randn(100, generator=g).bfloat16(),
            "i": torch.arange(7), "meta": {"seed": seed, "name": "x"}}


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in state.items()}


def assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_sigkilled_trainer_restores_from_memory_reading_no_data(daemon, tmp):
    """Acceptance 1: two DDP ranks SIGKILLed after a commit; every data file of the job is deleted;
    the restarted run restores from the daemon's memory and ends bit-identical to an uninterrupted run."""
    args = ("--steps", "18", "--every", "3", "--step-sleep", "0.05")
    finish(launch(2, [daemon.socket], "reference", tmp / "ref", *args))
    kill_after = random.Random().choice([3, 6, 9])
    kill_after_commit(launch(2, [daemon.socket], "crashy", tmp / "crash", *args), kill_after)
    assert remove_data_files(daemon.root, "crashy") >= 2
    outs = finish(launch(2, [daemon.socket], "crashy", tmp / "crash", *args))
    for out in outs:
        restored = [line for line in out.splitlines() if line.startswith("RESTORED")]
        assert restored and int(restored[0].split()[1]) >= kill_after, out
        assert "RESTORE_SOURCE memory" in out, out
    for rank in range(2):
        assert_same_tensors(tmp / f"ref.rank{rank}.safetensors", tmp / f"crash.rank{rank}.safetensors")
    assert status(daemon.socket)["memory"]["totals"]["served"] >= 2


def _memfd_of(pid: int, name: str) -> Path:
    links = memfds_named(pid, name)
    assert links, f"no memfd {name} in daemon {pid}"
    return links[0]


@pytest.mark.parametrize("num_slots", [2, 1])
def test_corrupt_memory_is_detected_and_storage_used(daemon, num_slots):
    """Acceptance 3 (in memory): a byte flipped in the daemon's held copy fails its checksum; the
    restore reads storage instead and is exact, and says so. The held copy is the slot the step
    was saved from (2 slots) or the daemon's own copy (1 slot: the trainer cannot spare it)."""
    job = f"flip{num_slots}"
    ck = ckptd_client.Checkpointer(job, socket=str(daemon.socket), num_slots=num_slots)
    state = state_of(1)
    ck.save(4, state).wait(60)
    if num_slots == 1:
        held = [_memfd_of(daemon.proc.pid, f"ckptd-mem-{job}-4-r0")]
    else:       # the kept slot (the other one is free: flipping it changes nothing the restore reads)
        held = [_memfd_of(daemon.proc.pid, f"ckptd-{job}-r0-s{i}") for i in range(2)]
    for path in held:
        with open(path, "r+b") as f:          # the daemon's own memfd, through /proc
            f.seek(12345)
            byte = f.read(1)
            f.seek(12345)
            f.write(bytes([byte[0] ^ 0x10]))
    target = zeros_like(state)
    assert ck.restore(target) == 4
    assert ck.last_restore.source == "storage" and "checksum" in ck.last_restore.fallback
    assert_equal(state, target)
    ck.close()


def test_many_tensors_on_several_threads_exact_and_a_bad_one_named(daemon):
    """Restore threads take the reads from one shared list: 64 tensors on 3 threads come back exact,
    and a byte flipped in the 41st fails its checksum, named, whichever thread read it (storage serves).
    (Each tensor over 256 KiB: smaller reads run on one thread, memory_restore.SMALL_READS.)"""
    ck = ckptd_client.Checkpointer("many", socket=str(daemon.socket), num_slots=1, restore_threads=3)
    state = {f"t{i}": torch.full((65536 + i + 1,), float(i + 1)) for i in range(64)}
    ck.save(1, state).wait(60)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ck.restore(target) == 1 and ck.last_restore.source == "memory"
    assert_equal(state, target)
    with open(_memfd_of(daemon.proc.pid, "ckptd-mem-many-1-r0"), "r+b") as f:
        body = f.read()
        at = body.index(state["t40"].numpy().tobytes()) + 4 * 1000
        f.seek(at)
        f.write(bytes([body[at] ^ 0x01]))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ck.restore(target) == 1
    assert ck.last_restore.source == "storage" and "'t40'" in ck.last_restore.fallback \
        and "checksum" in ck.last_restore.fallback
    assert_equal(state, target)
    ck.close()


def test_restore_needs_the_committed_step_and_same_world(daemon):
    """Memory serves only what index.json commits, at the same world size; otherwise storage, with the reason."""
    ck = ckptd_client.Checkpointer("world", socket=str(daemon.socket))
    state = state_of(2)
    ck.save(1, state).wait(60)
    ck.close()
    with pytest.raises(RuntimeError, match="saved by 1 ranks"):
        protocol.request_once(str(daemon.socket), protocol.to_wire(protocol.MemoryFetch("world", 0, 2, 1), 1))
    with pytest.raises(RuntimeError, match="not committed"):
        protocol.request_once(str(daemon.socket), protocol.to_wire(protocol.MemoryFetch("world", 0, 1, 7), 1))
    with pytest.raises(RuntimeError, match="invalid job name"):
        protocol.request_once(str(daemon.socket), protocol.to_wire(protocol.MemoryFetch("../world", 0, 1), 1))
    fresh = ckptd_client.Checkpointer("world", socket=str(daemon.socket), memory=False)
    target = zeros_like(state)
    assert fresh.restore(target) == 1 and fresh.last_restore.source == "storage"
    assert_equal(state, target)


def _pin(sock: Path, job: str, step: int) -> socket.socket:
    """A memory_fetch left open: the daemon keeps that shard pinned until this connection closes."""
    conn = protocol.connect(str(sock))
    protocol.send_frame(conn, protocol.to_wire(protocol.MemoryFetch(job, 0, 1, step), 1))
    rx = protocol.FrameReceiver(conn)
    reply = rx.read()
    assert reply["op"] == "ok", reply
    for fd in rx.take_fds(1):
        os.close(fd)
    return conn


def test_budget_evicts_oldest_first_never_a_pinned_step(daemon_factory):
    """Acceptance 4: with room for two 2 MiB shards and 3 steps wanted, saving a third evicts the
    oldest; a step a restore holds open is never evicted (a shard that cannot fit is not held);
    `ckptd status` shows all of it."""
    d = daemon_factory("--memory-budget", "5MiB", "--memory-steps", "3", "--metrics-address", "127.0.0.1:0")
    ck = ckptd_client.Checkpointer("budget", socket=str(d.socket))
    states = {s: state_of(s, mib=2) for s in (1, 2, 3, 4, 5)}
    for s in (1, 2, 3):
        ck.save(s, states[s]).wait(60)
    mem = status(d.socket)["memory"]
    assert [h["step"] for h in mem["held"]] == [2, 3], mem
    assert mem["totals"]["evicted"] == 1 and mem["used_bytes"] <= mem["budget_bytes"] == 5 * MiB
    assert "evicted from memory job=budget step=1" in d.log_text()

    pin = _pin(d.socket, "budget", 2)          # a restore reads step 2: it must stay
    ck.save(4, states[4]).wait(60)             # evicts 3 (the only unpinned), not 2
    mem = status(d.socket)["memory"]
    assert [h["step"] for h in mem["held"]] == [2, 4], mem
    assert mem["held"][0]["ranks"]["0"]["pinned"] == 1
    ck.save(5, states[5]).wait(60)             # evicts 4; 2 still pinned
    assert [h["step"] for h in status(d.socket)["memory"]["held"]] == [2, 5]
    pin.close()

    cli = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(d.socket)],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "evicted=3" in cli.stdout and "job=budget step=5 committed" in cli.stdout, cli.stdout
    scrape = urllib.request.urlopen(f"http://{status(d.socket)['metrics']}/metrics", timeout=10).read().decode()
    assert "ckptd_memory_evicted_shards_total 3.0" in scrape and "ckptd_memory_budget_bytes 5.24288e+06" in scrape
    remove_data_files(d.root, "budget")
    target = zeros_like(states[5])
    assert ck.restore(target) == 5 and ck.last_restore.source == "memory" and ck.last_restore.step == 5
    assert_equal(states[5], target)
    ck.close()


def test_held_shards_prefetched_and_the_own_rank_required(daemon):
    """A sharded restore's fetches (held_pieces.DaemonShards) start at once and pin their shards until
    it closes, which waits for every fetch it started; a saved rank the daemon cannot serve is left to
    storage (None, the daemon's reason kept) unless it is one the restore must have from memory (its
    own): then asking for it raises MemoryUnavailable with that reason."""
    ck = ckptd_client.Checkpointer("pre", socket=str(daemon.socket), num_slots=1)
    state = state_of(3)
    ck.save(1, state).wait(60)
    ck.close()

    def pins() -> list[int]:
        return [r["pinned"] for h in status(daemon.socket)["memory"]["held"] if h["job"] == "pre"
                for r in h["ranks"].values()]
    with DaemonShards(str(daemon.socket), "pre", 1, 1, must=(0,)) as held:
        held.prefetch([0, 0])
        m = held.manifest(0)
        assert m is not None and pins() == [1]
        w = next(e for e in m.tensors if e.name == "w")
        got = bytearray(w.nbytes)
        at = 0
        for pos, _, meta in w.chunk_spans():
            held.read_chunk(0, pos, meta, memoryview(got)[at:at + meta.raw_len], None)
            at += meta.raw_len
        assert bytes(got) == state["w"].numpy().tobytes()
    assert pins() == [0]
    with DaemonShards(str(daemon.socket), "pre", 1, 1) as unasked:
        unasked.prefetch([0])         # closed at once: the fetch is waited for, then let go
    assert pins() == [0] and unasked.shards == {}
    with DaemonShards(str(daemon.socket), "pre", 7, 1) as held:       # step 7 was never committed
        held.prefetch([0])
        assert held.manifest(0) is None and "not committed" in held.refused[0]
    with DaemonShards(str(daemon.socket), "pre", 7, 1, must=(0,)) as held:
        held.prefetch([0])
        with pytest.raises(MemoryUnavailable, match="not committed"):
            held.manifest(0)


def test_storage_restore_reports_its_raw_bytes(daemon):
    """RestoreInfo.raw_bytes counts the raw bytes restored from storage too (it read 0 there), the same
    count a restore from memory reports for the same step."""
    ck = ckptd_client.Checkpointer("rawb", socket=str(daemon.socket))
    state = state_of(5)
    ck.save(1, state).wait(60)
    ck.close()
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    got: dict[str, Any] = {}
    for memory in (False, True):
        ck = ckptd_client.Checkpointer("rawb", socket=str(daemon.socket), memory=memory)
        target = zeros_like(state)
        assert ck.restore(target) == 1
        got[ck.last_restore.source] = ck.last_restore.raw_bytes
        assert_equal(state, target)
        ck.close()
    assert got == {"storage": tensor_bytes, "memory": tensor_bytes}, got
