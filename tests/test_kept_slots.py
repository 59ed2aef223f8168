"""The memory tier keeps the slot a step was saved from as that step's resident copy: no second
copy of the state in host memory. The slot goes back to the trainer when the tier lets the step
go (a newer step committed, a failed step), never while a restore could still need it."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from procfd import memfd_inodes

import ckptd_client
from ckptd.core.schema import TensorLayout
from ckptd.daemon.settings.write import WriteSettings
from ckptd.daemon.slot_pool import allocate_slots
from ckptd.daemon.tiers.base import ShardRef, SlotLoan
from ckptd.daemon.tiers.fs.tier import FsTier
from ckptd.daemon.tiers.fs.writer import WriteAbandoned
from ckptd.daemon.tiers.memory.store import MemoryStore
from ckptd.daemon.tiers.memory.tier import MemoryTier

from test_memory_tier import assert_equal, remove_data_files, state_of, status, zeros_like

JOB, N = "kept", 64 * 1024
MiB = 1024 * 1024


class FakeSlot:
    """A real memfd slot (made as the daemon makes them) and a record of what the tier did with it."""

    def __init__(self, name: str, step: int) -> None:
        [(self.fd, self.mm)] = allocate_slots(name, N * 4, 1)
        self.calls: list[str] = []
        body = hashlib.shake_128(f"{name}/{step}".encode()).digest(N * 4)
        with open(f"/proc/self/fd/{self.fd}", "r+b") as f:
            f.write(body)
        self.view = memoryview(self.mm)

    def loan(self, spare: bool = True) -> SlotLoan:
        return SlotLoan(self.fd, self.mm, can_lend=lambda steps: spare, lend=lambda: self.calls.append("lend"),
                        give_back=lambda: self.calls.append("give_back"))

    def released(self) -> None:
        self.calls.append("released")

    def close(self) -> None:
        self.view.release()
        self.mm.close()
        os.close(self.fd)


@pytest.fixture
def pool() -> Iterator[Executor]:
    with ThreadPoolExecutor(4) as p:
        yield p


def make_tier(root: Path, pool: Executor, steps: int = 1) -> MemoryTier:
    fs = FsTier(str(root), WriteSettings(codec="zstd", level=1, chunk_bytes=16 * 1024), 2, pool)
    return MemoryTier(fs, MemoryStore(64 * MiB, steps), str(root), 16 * 1024, pool)


async def write(tier: MemoryTier, slot: FakeSlot, step: int, spare: bool = True, abandoned: bool = False) -> Any:
    layout = [TensorLayout("w", "float32", (N,), 0, N * 4)]
    return await tier.write_shard(ShardRef(JOB, step, 0, 1), slot.view, layout, {"T": "w"},
                                  released=slot.released, abandoned=lambda: abandoned, loan=slot.loan(spare))


async def test_a_kept_slot_is_the_held_copy_and_goes_back_when_a_newer_step_commits(tmp_path: Path,
                                                                                    pool: Executor) -> None:
    tier = make_tier(tmp_path, pool)
    a, b = FakeSlot("a", 1), FakeSlot("b", 2)
    try:
        w1 = await write(tier, a, 1)
        assert a.calls == ["lend"]                       # kept: never released to the trainer
        held = tier.store.get(JOB, 1, 0)
        assert held is not None and held.in_slot and held.fd == a.fd
        assert bytes(held.mm[:N * 4]) == bytes(a.view)
        await tier.commit(JOB, 1, 1, {0: w1.digest})
        assert a.calls == ["lend"]                       # the newest committed step stays
        w2 = await write(tier, b, 2)
        assert b.calls == ["lend"] and a.calls == ["lend"]   # step 2 is not committed yet: step 1 stays
        await tier.commit(JOB, 2, 1, {0: w2.digest})
        assert a.calls == ["lend", "give_back"] and b.calls == ["lend"]
        assert tier.store.get(JOB, 1, 0) is None and tier.store.get(JOB, 2, 0).in_slot
    finally:
        tier.store.close()
        tier.close()
        a.close()
        b.close()
    assert b.calls == ["lend", "give_back"]              # shutdown hands it back too


async def test_a_failed_step_gives_its_kept_slot_back_and_a_failed_write_releases(tmp_path: Path,
                                                                                  pool: Executor) -> None:
    tier = make_tier(tmp_path, pool)
    a, b = FakeSlot("a", 1), FakeSlot("b", 2)
    try:
        await write(tier, a, 1)
        await tier.abort(JOB, 1, {0})
        assert a.calls == ["lend", "give_back"] and tier.store.get(JOB, 1, 0) is None
        with pytest.raises(WriteAbandoned):
            await write(tier, b, 2, abandoned=True)      # the write stops: nothing held, the slot released
        assert b.calls == ["released"] and tier.store.entries == {}
    finally:
        tier.store.close()
        tier.close()
        a.close()
        b.close()


async def test_a_slot_the_trainer_cannot_spare_is_copied_and_released(tmp_path: Path, pool: Executor) -> None:
    tier = make_tier(tmp_path, pool)
    a = FakeSlot("a", 1)
    try:
        await write(tier, a, 1, spare=False)
        assert a.calls == ["released"]
        held = tier.store.get(JOB, 1, 0)
        assert held is not None and not held.in_slot and held.fd != a.fd
        assert bytes(held.mm[:N * 4]) == bytes(a.view)
    finally:
        tier.store.close()
        tier.close()
        a.close()
    assert a.calls == ["released"]



def memfds(pid: int) -> list[str]:
    return sorted(memfd_inodes(pid).values())


def test_the_daemon_holds_no_second_copy_and_restores_from_the_kept_slot(daemon) -> None:
    """Two slots, memory tier on: after several saves the held step is one of the trainer's slots
    (the daemon has made no memfd of its own), status counts each byte once, and a fresh
    Checkpointer restores it from memory, bit-exact, with every data file gone."""
    ck = ckptd_client.Checkpointer("kept", socket=str(daemon.socket), num_slots=2)
    states = [state_of(s, mib=2) for s in range(5)]
    for step, state in enumerate(states, start=1):
        ck.save(step, state).wait(60)
    assert not [m for m in memfds(daemon.proc.pid) if m.startswith("ckptd-mem-")]
    st = status(daemon.socket)
    [held] = [s for s in st["memory"]["held"] if s["job"] == "kept"]
    assert held["step"] == 5 and held["committed"] and held["ranks"]["0"]["in_slot"] is True
    [sess] = [s for s in st["sessions"] if s["job"] == "kept"]
    assert sess["held_slots"] == 1 and sess["slots"] == 2
    host = st["host_bytes"]["kept"]
    assert host["slots"] == sess["slot_bytes"] // 2          # the free slot; the kept one counts as held
    assert host["held"] == held["bytes"] and host["replicas"] == 0
    assert remove_data_files(daemon.root, "kept") >= 1
    fresh = ckptd_client.Checkpointer("kept", socket=str(daemon.socket))
    target = zeros_like(states[-1])
    assert fresh.restore(target) == 5 and fresh.last_restore.source == "memory"
    assert_equal(states[-1], target)
    fresh.close()
    ck.close()


def test_a_state_that_grows_resizes_its_slots_past_a_kept_one(daemon) -> None:
    """The slots are resized (a larger state) while the memory tier keeps one: the resize does not
    wait for it, the kept step stays restorable, and the larger step is kept in a new slot."""
    ck = ckptd_client.Checkpointer("grow", socket=str(daemon.socket), num_slots=2)
    small, large = state_of(1, mib=1), state_of(2, mib=3)
    ck.save(1, small).wait(60)
    ck.save(2, large).wait(60)          # a resize: the old kept slot is the tier's until step 2 commits
    ck.save(3, large).wait(60)
    st = status(daemon.socket)
    [held] = [s for s in st["memory"]["held"] if s["job"] == "grow"]
    assert held["step"] == 3 and held["ranks"]["0"]["in_slot"] is True
    target = zeros_like(large)
    fresh = ckptd_client.Checkpointer("grow", socket=str(daemon.socket))
    assert fresh.restore(target) == 3 and fresh.last_restore.source == "memory"
    assert_equal(large, target)
    fresh.close()
    ck.close()


def test_a_closed_trainers_kept_slot_outlives_it_and_is_freed_by_the_next_run(daemon) -> None:
    """The trainer leaves (its session and slots go): the kept slot stays as the held step; the next
    run restores from it and, once its own newer step commits, the old slot is freed."""
    ck = ckptd_client.Checkpointer("leave", socket=str(daemon.socket))
    state = state_of(3, mib=2)
    ck.save(1, state).wait(60)
    ck.close()
    del ck
    wait_until(lambda: not [s for s in status(daemon.socket)["sessions"] if s["job"] == "leave"],
               "the closed trainer's session to end")
    st = status(daemon.socket)
    assert st["host_bytes"]["leave"]["held"] > 0 and st["host_bytes"]["leave"]["slots"] == 0
    [old] = [i for i, m in memfd_inodes(daemon.proc.pid).items() if m.startswith("ckptd-leave-")]   # the kept one
    again = ckptd_client.Checkpointer("leave", socket=str(daemon.socket))
    target = zeros_like(state)
    assert again.restore(target) == 1 and again.last_restore.source == "memory"
    assert_equal(state, target)
    again.save(2, target).wait(60)
    after = {i for i, m in memfd_inodes(daemon.proc.pid).items() if m.startswith("ckptd-leave-")}
    again.close()
    assert old not in after and len(after) == 2        # the old run's slot freed; the new run's two slots
    torch.testing.assert_close(target["w"], state["w"], rtol=0, atol=0)


@pytest.mark.parametrize("when_busy", ["block", "skip"])
def test_a_trainer_whose_slots_are_all_kept_gets_one_back(daemon, when_busy: str) -> None:
    """Rank 0 of a 2-rank job whose rank 1 never saves: its steps become durable here but never
    commit, and the memory tier keeps both slots. The next save asks for one back and goes on
    (block), or is skipped once and the one after goes on (skip); the oldest step is let go."""
    ck = ckptd_client.Checkpointer(f"stuck-{when_busy}", socket=str(daemon.socket), rank=0, world_size=2,
                                   commit="local", num_slots=2, when_busy=when_busy)
    state = state_of(4, mib=1)
    ck.save(1, state)
    ck.save(2, state)
    job = f"stuck-{when_busy}"

    def kept() -> list[int]:
        return sorted(s["step"] for s in status(daemon.socket)["memory"]["held"]
                      if s["job"] == job and s["ranks"]["0"]["in_slot"])
    wait_until(lambda: kept() == [1, 2], "both steps kept in the trainer's slots")
    h3 = ck.save(3, state)
    if when_busy == "skip":
        assert h3.skipped
        # the daemon's status shows step 1 let go before the slot's release reaches the trainer (an
        # event on its connection): the next save finds the slot free once the trainer has it back
        wait_until(lambda: kept() == [2] and ck._session.held() == 1, "step 1 let go, its slot back with the trainer")
        h3 = ck.save(3, state)
    assert not h3.skipped
    wait_until(lambda: kept() == [2, 3], "step 3 kept in the slot step 1 gave back")
    assert status(daemon.socket)["memory"]["totals"]["evicted"] >= 1
    ck.close(timeout=1)


def wait_until(cond: Any, what: str, timeout: float = 60.0) -> None:
    import time
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_failed_save_on_the_copy_path_leaves_no_memfd(daemon_factory) -> None:
    """One slot (nothing to keep: the memory tier copies the shard into a memfd of its own), world size 2,
    and rank 0's save aborted while it is written, five times: each cancelled copy's memfd is closed.
    Before, each stayed open and allocated (8 MiB a save) while the budget counted it freed."""
    import mmap
    import threading
    import time

    from ckptd.core import protocol
    from ckptd_client.connection import DaemonConnection

    d = daemon_factory("--chunk-mib", "1", "--debug-write-delay", "0.3", "--memory-budget", "1GiB")
    n = 8 << 20
    freed = threading.Event()

    def on_event(_op: Any, msg: dict[str, Any]) -> None:
        if msg.get("op") == "slot_free":
            freed.set()

    conn = DaemonConnection(str(d.socket), on_event=on_event)
    try:
        r = conn.request(protocol.Hello(job="leak", rank=0, world_size=2, pid=os.getpid(), slot_bytes=n, num_slots=1))
        [fd] = r["_fds"]
        with mmap.mmap(fd, n) as slot:
            os.close(fd)
            for step in range(1, 6):
                slot[:n] = bytes([step]) * n
                freed.clear()
                conn.request(protocol.Save(step=step, slot=0, tensors=[["w", "uint8", [n], 0, n]],
                                           tree={"d": [["w", {"T": "w"}]]}, commit="local"))
                time.sleep(0.5)                     # its write and the tier's copy under way
                conn.request(protocol.Abort(step=step, reason="rank 1 died"))
                assert freed.wait(60), f"step {step}: the slot never came back"
        deadline = time.monotonic() + 30
        while [m for m in memfds(d.proc.pid) if m.startswith("ckptd-mem-")] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [m for m in memfds(d.proc.pid) if m.startswith("ckptd-mem-")]
        assert status(d.socket)["memory"]["used_bytes"] == 0
    finally:
        conn.close()
