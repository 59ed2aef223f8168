"""Memory-level steps under the memory budget and across peers: what a daemon holds, and for how long.

Real daemons (subprocesses), real ranks (threads of this process, each its own Checkpointer and
connection, a real TCPStore between them), real memfds.
"""
# mypy: disable-error-code="union-attr,index"
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from procfd import open_fds
from test_memory_level import committed_held_steps
from torch.distributed import TCPStore

import ckptd_client
from ckptd_client import CheckpointError

from conftest import wait_for_socket
from test_acceptance import free_port
from test_memory_tier import status
from test_peers import peer_args, secret_file, wait_for

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20


def state(mib: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g)}


def on_ranks(fn: Callable[[int], Any], world: int = 2) -> dict[int, Any]:
    """``fn(rank)`` on a thread per rank at once; each rank's result, or the exception it raised."""
    out: dict[int, Any] = {}

    def go(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as e:
            out[r] = e
    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == world, out
    return out


def checkpointers(job: str, socks: list[Path], commit_timeout: float = 60, **kw: Any
                  ) -> dict[int, ckptd_client.Checkpointer]:
    """Two ranks of ``job``, rank r on ``socks[r]`` (or the one socket), joined through a TCPStore."""
    master = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)

    def make(r: int) -> ckptd_client.Checkpointer:
        store = master if r == 0 else TCPStore("127.0.0.1", master.port, 2, False)
        return ckptd_client.Checkpointer(job, socket=str(socks[r % len(socks)]), rank=r, world_size=2, store=store,
                                         commit_timeout=commit_timeout, **kw)
    cks = on_ranks(make)
    assert all(isinstance(c, ckptd_client.Checkpointer) for c in cks.values()), cks
    return cks


def held_steps(sock: Path) -> list[tuple[str, int, str, list[str]]]:
    return [(h["job"], h["step"], h["level"], sorted(h["ranks"])) for h in status(sock)["memory"]["held"]]


def test_a_failed_memory_level_save_leaves_the_newest_committed_one_whole(daemon_factory: Any) -> None:
    """Memory-level step 2 committed (4 MiB a rank, 10 MiB budget); step 3 is 4 MiB on rank 0 and 12 MiB
    on rank 1, which never fits. Rank 0's reservation for step 3 evicted step 2's shards (memory.steps = 1:
    step 3's commit would trim it) before step 3 committed; step 3 failed, and committed step 2, its
    index.json still in place, no longer restored: a new run went back to storage step 1. Now step 3
    fails on both ranks saying the budget holds the newest committed memory-level step, and step 2
    restores from memory, bit-exact."""
    d = daemon_factory("--memory-budget", "10MiB")
    cks = checkpointers("j", [d.socket])
    assert on_ranks(lambda r: cks[r].save(1, state(4, 1 + r)).wait(60)) == {0: None, 1: None}
    assert on_ranks(lambda r: cks[r].save(2, state(4, 3 + r), level="memory").wait(60)) == {0: None, 1: None}
    failed = on_ranks(lambda r: cks[r].save(3, state(4 if r == 0 else 12, 5 + r), level="memory").wait(60))
    for r in (0, 1):
        assert isinstance(failed[r], CheckpointError), failed
        assert "does not fit the memory budget" in str(failed[r]), failed
    assert held_steps(d.socket) == [("j", 2, "memory", ["0", "1"])]
    assert committed_held_steps(d.root, "j") == [2]
    on_ranks(lambda r: cks[r].close())

    again = checkpointers("j", [d.socket])

    def restore(r: int) -> tuple[int | None, str, bool]:
        live = {"w": torch.zeros(4 * MiB // 4)}
        step = again[r].restore(live)
        return step, again[r].last_restore.level, torch.equal(live["w"], state(4, 3 + r)["w"])
    assert on_ranks(restore) == {0: (2, "memory", True), 1: (2, "memory", True)}
    on_ranks(lambda r: again[r].close())
    # Either rank's error fails the step; each says what holds the budget.
    assert "the job's newest committed memory-level step, kept whole until a newer one commits" in str(failed[0])


def memfd_bytes(pid: int) -> int:
    """The bytes of every memfd the process holds (each once, by inode)."""
    sizes: dict[int, int] = {}
    for link, target, ino in open_fds(pid):
        if target.startswith("/memfd:"):
            try:
                sizes[ino] = os.stat(link).st_size
            except OSError:
                continue
    return sum(sizes.values())


def memory_levels(sock: Path, job: str) -> list[int]:
    return [s for j, s, level, _ in held_steps(sock) if j == job and level == "memory"]


def two_peers(daemon_factory: Any, tmp: Path, *extra: str) -> tuple[Any, Any]:
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    a, b = (daemon_factory(*peer_args(addrs[i], addrs, secret), *extra, name=n) for i, n in enumerate("ab"))
    return a, b


def test_every_peer_drops_memory_level_steps_a_storage_commit_supersedes(daemon_factory: Any, tmp: Path) -> None:
    """Two daemons (K = 1, one rank each, relay commit): memory-level steps 2 and 3, then storage steps
    4 and 5. Only the daemon that committed storage step 4 dropped memory-level step 3 (MemoryTier.commit);
    the other learns commits from index.json (the settle loop), which never dropped memory-level steps
    below a storage step, so it held step 3 (its own shard, in a slot its trainer then lacked, and the
    peer's replica) for good: twice the other node's memory, never evictable by another job. Now both
    drop it, and hold the same."""
    a, b = two_peers(daemon_factory, tmp, "--memory-budget", "64MiB")
    cks = checkpointers("j", [a.socket, b.socket], commit="relay", local_world_size=1)
    for step, level in ((1, "storage"), (2, "memory"), (3, "memory"), (4, "storage"), (5, "storage")):
        done = on_ranks(functools.partial(save, cks, step, level))
        assert done == {0: None, 1: None}, (step, done)
        if level == "memory":
            continue
        for d in (a, b):       # (b learns a commit from index.json: within a settle round, 0.5 s)
            wait_for(functools.partial(none_at_or_below, d.socket, step),
                     f"no memory-level step at or below {step} held by {d.socket.name}", 10)
    on_ranks(lambda r: cks[r].close())
    for d in (a, b):           # storage step 5 (4 trimmed once 5 is known committed): own shard + peer's replica
        wait_for(functools.partial(uses, d.socket, 2 * 4 * MiB), f"{d.socket.name} holding storage step 5 alone", 10)
    assert held_steps(a.socket) == held_steps(b.socket) == [("j", 5, "storage", ["0", "1"])]
    wait_for(lambda: memfd_bytes(a.pid) == memfd_bytes(b.pid), "the same memfd bytes on both nodes", 10)


def save(cks: dict[int, ckptd_client.Checkpointer], step: int, level: str, r: int) -> None:
    cks[r].save(step, state(4, step * 10 + r), level=level).wait(60)


def none_at_or_below(sock: Path, step: int) -> bool:
    return not [s for s in memory_levels(sock, "j") if s <= step]


def committed_here(sock: Path, step: int) -> bool:
    return any(h["step"] == step and h.get("committed") for h in status(sock)["memory"]["held"])


def uses(sock: Path, nbytes: int) -> bool:
    return bool(status(sock)["memory"]["used_bytes"] == nbytes)


def test_a_memory_level_step_removed_by_another_daemons_commit_is_dropped(daemon_factory: Any, tmp: Path) -> None:
    """A daemon that holds no shard of the newer step that superseded a memory-level step (here a third
    daemon on the same root, no peer, committed storage step 3 of the job, removing memory-level step 2's
    directory) never learned of it, and held step 2 for good. Committed memory-level steps whose index.json
    is gone are now dropped (the settle loop's check)."""
    a, b = two_peers(daemon_factory, tmp)
    cks = checkpointers("j", [a.socket, b.socket], commit="relay", local_world_size=1)
    assert on_ranks(lambda r: cks[r].save(2, state(1, r), level="memory").wait(60)) == {0: None, 1: None}
    on_ranks(lambda r: cks[r].close())
    assert memory_levels(a.socket, "j") == memory_levels(b.socket, "j") == [2]
    for d in (a, b):        # (b learns the commit from index.json: its settle loop, within a second)
        wait_for(functools.partial(committed_here, d.socket, 2), f"step 2 known committed by {d.socket.name}", 15)
    c = daemon_factory(name="c")
    with ckptd_client.Checkpointer("j", socket=str(c.socket), rank=0, world_size=1) as ck:
        ck.save(3, state(1, 7)).wait(60)
    assert committed_held_steps(c.root, "j") == []
    for d in (a, b):
        wait_for(functools.partial(none_at_or_below, d.socket, 2), f"step 2 dropped by {d.socket.name}", 15)
        assert status(d.socket)["memory"]["used_bytes"] == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts a tmpfs in a mount namespace of its own (root, unshare)")
def test_a_replica_its_peer_cannot_allocate_is_refused_with_the_reason(daemon_factory: Any, tmp: Path) -> None:
    """Peer b's memory.shm_dir is an 8 MiB tmpfs; a 16 MiB replica cannot be allocated there. b's listener
    dropped the connection without a word (the OSError fell through to the connection's end), so a's log
    said only EPIPE, b's nothing, and the handle pointed at logs that did not say why. Now b reads the
    payload off, logs the refusal with the reason and answers it; a logs it; the connection goes on."""
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret), "--peer-io-timeout", "5", name="a")
    mnt, sock, log = tmp / "shm", tmp / "b.sock", tmp / "b.log"
    mnt.mkdir(mode=0o700)
    serve = [sys.executable, "-m", "ckptd", "serve", "--root", str(a.root), "--socket", str(sock), "--log-format",
             "plain", "--shm-dir", str(mnt), *peer_args(addrs[1], addrs, secret), "--peer-io-timeout", "5"]
    cmd = f"mount -t tmpfs -o size=8m,mode=0700 ckptd-test-shm {mnt} && exec {' '.join(serve)}"
    with open(log, "wb") as out:
        b = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], stdout=out,
                             stderr=subprocess.STDOUT)
    try:
        wait_for_socket(sock, b)
        with ckptd_client.Checkpointer("j", socket=str(a.socket), rank=0, world_size=1) as ck:
            with pytest.raises(CheckpointError, match="reached 0 of its 1 peer replicas"):
                ck.save(1, state(16, 0), level="memory").wait(60)
            ck.save(2, state(1, 0), level="memory").wait(60)     # one that fits: the peer still serves
    finally:
        b.terminate()
        b.wait(60)
    why = "could not be allocated in this daemon's shared memory (memory.shm_dir"
    a_log, b_log = a.log.read_text(), log.read_text()
    assert "did not keep the replica" in a_log and why in a_log and "ENOSPC" in a_log, a_log[-3000:]
    assert "replica refused" in b_log and why in b_log and "is full: mount its tmpfs with a larger size=" in b_log, \
        b_log[-3000:]


def restored(cks: dict[int, ckptd_client.Checkpointer], step: int | None, seed: Callable[[int], int]) \
        -> dict[int, Any]:
    """Each rank's restore of ``step`` (None: the newest): (step, level, bit-exact against ``seed(rank)``)."""
    def go(r: int) -> tuple[int | None, str | None, bool]:
        live = {"w": torch.zeros(4 * MiB // 4)}
        got = cks[r].restore(live, step=step)
        info = cks[r].last_restore
        return got, info.level if info else None, torch.equal(live["w"], state(4, seed(r))["w"])
    return on_ranks(go)


def save_at(cks: dict[int, ckptd_client.Checkpointer], step: int, r: int) -> None:
    cks[r].save(step, state(4, step * 10 + r)).wait(60)


def test_a_storage_shard_held_never_drops_a_memory_level_step_in_flight(daemon_factory: Any) -> None:
    """A run resumed from step 10 while the earlier run's storage step 20 was held. Holding the new run's
    storage step 16 (a shard of it, before its commit) dropped every memory-level shard below 21 — rank 0's
    memory-level step 17, still in flight, which then committed with a shard no daemon held: its handles
    said committed, its restore failed. Only a storage step's commit drops memory-level steps now, only
    those at or below it, and a step in flight stays."""
    d = daemon_factory("--memory-budget", "256MiB")
    cks = checkpointers("j", [d.socket])
    for s in (10, 20):
        assert on_ranks(functools.partial(save_at, cks, s)) == {0: None, 1: None}
    on_ranks(lambda r: cks[r].close())
    cks = checkpointers("j", [d.socket])
    assert restored(cks, 10, lambda r: 100 + r) == {0: (10, "storage", True), 1: (10, "storage", True)}
    h16 = cks[0].save(16, state(4, 160))
    h17 = cks[0].save(17, state(4, 170), level="memory")
    wait_for(lambda: ("j", 17, "memory", ["0"]) in held_steps(d.socket), "rank 0's step 17 held", 30)
    cks[1].save(16, state(4, 161)).wait(60)
    h16.wait(60)
    assert ("j", 17, "memory", ["0"]) in held_steps(d.socket)     # storage 16 committed: 17 stays
    cks[1].save(17, state(4, 171), level="memory").wait(60)
    h17.wait(60)
    assert restored(cks, 17, lambda r: 170 + r) == {0: (17, "memory", True), 1: (17, "memory", True)}
    on_ranks(lambda r: cks[r].close())


def test_a_trainer_short_of_slots_never_gets_the_newest_committed_memory_level_steps_back(
        daemon_factory: Any) -> None:
    """Rank 0 saved memory-level step 2 (rank 1 not yet) and then 3: both its slots held (step 1, the newest
    committed, and step 2), it asked for one back, and the daemon let step 1's shard go. Step 2 then failed:
    committed step 1 restored from nowhere, and restore() returned None. A memory-level step's slot is given
    back only once a newer one of its job committed: the save of step 3 waits for one or, here, skips."""
    d = daemon_factory()
    # Step 2 fails by rank 0's wait for rank 1 (0.7 x commit_timeout): 10 s, not the default 60 (42 s waited).
    cks = checkpointers("j", [d.socket], commit_timeout=10)
    assert on_ranks(lambda r: cks[r].save(1, state(4, 10 + r), level="memory").wait(60)) == {0: None, 1: None}
    h2 = cks[0].save(2, state(4, 20), level="memory")
    wait_for(lambda: ("j", 2, "memory", ["0"]) in held_steps(d.socket), "rank 0's step 2 held", 30)
    h3 = cks[0].save(3, state(4, 30), level="memory", when_busy="skip")
    assert h3.skipped
    assert ("j", 1, "memory", ["0", "1"]) in held_steps(d.socket)
    cks[1].close()                                # step 2 can never commit now
    with pytest.raises(CheckpointError):
        h2.wait(60)
    cks[0].close()
    cks = checkpointers("j", [d.socket])
    assert restored(cks, None, lambda r: 10 + r) == {0: (1, "memory", True), 1: (1, "memory", True)}
    on_ranks(lambda r: cks[r].close())
