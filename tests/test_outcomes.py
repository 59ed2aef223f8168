"""Truthful outcomes: close() waits for every save to its own outcome, and no handle says
"failed" for a committed step, even when rank 0 (and the c10d store it hosts) dies at once."""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zygote
from ports import free_port
from procfd import sigstop

import ckptd_client
from ckptd.core.names import step_dir


def test_close_waits_for_every_save_and_reports_each_failure(daemon_factory):
    """Step 1 fails (rank 1 never saves it: step timeout) while step 2 is still being written when
    close() starts: step 2 commits, and close() reports step 1's failure. Before, close() stopped
    at the first failed handle and disconnected, abandoning step 2."""
    d = daemon_factory("--step-timeout", "2", "--debug-write-delay", "0.3", "--chunk-mib", "1")
    cks = [ckptd_client.Checkpointer("cl", socket=str(d.socket), rank=r, world_size=2, commit="local")
           for r in range(2)]
    state = {"w": torch.randn(1 << 20)}                # 4 chunks: ~1.2 s of writing per rank
    h1 = cks[0].save(1, state)
    h2 = [ck.save(2, state) for ck in cks]
    report = cks[0].close(timeout=120)
    cks[1].close(timeout=120)
    assert h1.done() and not h1.committed and "timed out" in (h1.error or "")
    assert all(h.committed for h in h2), [h.error for h in h2]
    assert report.committed == (2,) and [s for s, _ in report.failed] == [1] and not report.ok
    assert Path(step_dir(str(d.root), "cl", 2), "index.json").exists()
    assert not Path(step_dir(str(d.root), "cl", 1), "index.json").exists()


def test_close_with_a_timeout_resolves_every_handle(daemon_factory):
    """A save that cannot finish (its other rank never comes) is settled by close(timeout): the
    handle resolves (failed: nothing on disk), and wait() without a timeout does not hang."""
    d = daemon_factory("--step-timeout", "600")
    ck = ckptd_client.Checkpointer("ct", socket=str(d.socket), rank=0, world_size=2, commit="local")
    h = ck.save(1, {"w": torch.ones(8)})
    report = ck.close(timeout=1)
    assert h.done() and not h.committed and "closed before step 1 committed" in (h.error or "")
    assert [s for s, _ in report.failed] == [1]


def test_a_save_close_gave_up_on_never_commits_later(daemon_factory):
    """close(timeout) on rank 0 before rank 1 saved: rank 0's handle said failed, and the step then
    committed when rank 1 saved it (local commit). close() now withdraws the save on the daemon:
    rank 1's save of the step fails too (its rank 0 is gone), and no index.json ever appears."""
    d = daemon_factory("--step-timeout", "3")
    ck0, ck1 = (ckptd_client.Checkpointer("cg", socket=str(d.socket), rank=r, world_size=2, commit="local")
                for r in range(2))
    h0 = ck0.save(1, {"w": torch.ones(8)})
    report = ck0.close(timeout=1)
    assert h0.done() and not h0.committed and "closed before step 1 committed" in (h0.error or ""), h0.error
    assert [s for s, _ in report.failed] == [1]
    h1 = ck1.save(1, {"w": torch.zeros(8)})
    with pytest.raises(ckptd_client.CheckpointError, match="timed out"):
        h1.wait(60)
    ck1.close(timeout=60)
    assert not Path(step_dir(str(d.root), "cg", 1), "index.json").exists()


def test_close_during_a_commit_reports_the_commit(daemon_factory):
    """close(timeout) while the daemon is committing the step (here slowed down past the timeout):
    the handle said failed and the step committed. Too late to withdraw it, close() waits for the
    commit's own outcome and reports it committed."""
    d = daemon_factory("--debug-commit-delay", "3")
    ck = ckptd_client.Checkpointer("cc", socket=str(d.socket))
    h = ck.save(1, {"w": torch.arange(8.0)})
    report = ck.close(timeout=1)
    assert h.done() and h.committed, h.error
    assert report.ok and report.committed == (1,)
    assert Path(step_dir(str(d.root), "cc", 1), "index.json").exists()


def test_close_report_says_it_counts_saves_in_flight(daemon_factory):
    """Two saves waited for, then close(): the report holds none of them (none was in flight), and
    its text says so. It printed "0 save(s) committed" after two committed saves."""
    daemon = daemon_factory("--debug-write-delay", "0.5")     # step 3 is still being written at close()
    ck = ckptd_client.Checkpointer("cr", socket=str(daemon.socket))
    for step in (1, 2):
        ck.save(step, {"w": torch.ones(8)}).wait(60)
    report = ck.close(timeout=60)
    assert report.ok and report.committed == ()
    assert str(report) == "no save was still in flight at close"
    ck = ckptd_client.Checkpointer("cr", socket=str(daemon.socket))
    ck.save(3, {"w": torch.ones(8)})                   # not waited for: close() waits for it
    report = ck.close(timeout=60)
    assert report.committed == (3,)
    assert str(report) == "1 save(s) still in flight at close: 1 committed (step 3)"


RANK = r'''
import os, signal, sys
from datetime import timedelta
import torch, torch.distributed as dist
import ckptd_client
sock, rank, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
ck = ckptd_client.Checkpointer("dies", socket=sock, rank=rank, world_size=2, store=store, commit_timeout=60)
for step in range(1, steps + 1):
    h = ck.save(step, {"w": torch.full((1024,), float(step * 10 + rank))})
    if rank == 0:
        h.wait(60)
        if step == steps:
            os.kill(os.getpid(), signal.SIGKILL)   # at once: the store (hosted here) goes with it
    else:
        try:
            h.wait(90)
            print(f"COMMITTED {step}", flush=True)
        except ckptd_client.CheckpointError as e:
            print(f"FAILED {step} {e}", flush=True)
'''



def test_rank0_killed_right_after_commit_leaves_no_false_failure(daemon, tmp):
    """Rank 0 is SIGKILLed as soon as its handle reports the commit; the c10d store it hosts dies
    with it. Rank 1's handles must all say committed, as index.json does."""
    script = tmp / "rank.py"
    script.write_text(RANK)
    for trial in range(3):
        port = free_port()
        procs = [zygote.popen([sys.executable, str(script), str(daemon.socket), str(r), str(port), str(trial + 2)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        assert procs[0].returncode == -9, outs[0]
        last = trial + 2
        assert Path(step_dir(str(daemon.root), "dies", last), "index.json").exists()
        lines = [line for line in outs[1].splitlines() if line.startswith(("COMMITTED", "FAILED"))]
        assert lines == [f"COMMITTED {s}" for s in range(1, last + 1)], outs[1]
        for s in range(1, last + 1):        # the job's next trial re-uses step numbers
            import shutil
            shutil.rmtree(step_dir(str(daemon.root), "dies", s))


def test_a_step_another_daemon_committed_is_not_taken_for_this_saves_commit(daemon_factory):
    """Two daemons on one root, two processes saving the same job's step 5 (two jobs of one name, or a
    zombie trainer): A's shard is durable and its commit slow; B saves and commits the step meanwhile.
    A's commit then fails ("already committed"), and A's client, finding an index.json, reported its save
    committed: a step holding B's bytes. It now checks the index's digest for its rank against the one
    its daemon reported durable: A's handle fails, B's commits, and the step restores B's bytes."""
    a = daemon_factory("--debug-commit-delay", "3", name="a")
    b = daemon_factory(name="b", root=a.root)
    ck_a = ckptd_client.Checkpointer("twin", socket=str(a.socket), commit="local")
    ck_b = ckptd_client.Checkpointer("twin", socket=str(b.socket), commit="local")
    h_a = ck_a.save(5, {"w": torch.full((1024,), 1.0)})
    deadline = time.monotonic() + 60
    while h_a.durable_s is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert h_a.durable_s is not None and not h_a.done()
    ck_b.save(5, {"w": torch.full((1024,), 2.0)}).wait(60)
    with pytest.raises(ckptd_client.CheckpointError, match="already committed"):
        h_a.wait(60)
    ck_a.close()
    ck_b.close()
    live = {"w": torch.zeros(1024)}
    reader = ckptd_client.Checkpointer("twin", root=str(a.root), memory=False, prepare=False)
    assert reader.restore(live, step=5) == 5 and torch.equal(live["w"], torch.full((1024,), 2.0))


CLOSER = r'''
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import ckptd_client
socks, rank, port, closer = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
# commit_timeout: rank 0 waits 0.7 x 15 s for rank 1's outcome (rank 1 saves 6 s late); the relay's bound,
# 2 x 15 + 5 s, is what close() waits at most.
ck = ckptd_client.Checkpointer("closer", socket=socks[rank], rank=rank, world_size=2, store=store,
                               commit_timeout=15)
if rank != closer:
    time.sleep(6)                       # the other rank saves, then closes with a timeout of 1 s
h = ck.save(1, {"w": torch.full((64,), float(rank))})
if rank == closer:
    t0 = time.monotonic()
    ck.close(timeout=1)
    print(f"CLOSED in {time.monotonic() - t0:.1f}s", flush=True)
try:
    h.wait(90)
    print("OUTCOME committed", flush=True)
except ckptd_client.CheckpointError as e:
    print(f"OUTCOME {e}", flush=True)
store.set(f"done{rank}", "1")
if rank == 0:
    store.wait(["done0", "done1"], timedelta(seconds=120))
'''


@pytest.mark.parametrize("closer", [0, 1])
def test_a_relayed_save_durable_here_is_waited_for_at_close(daemon_factory, tmp, closer: int):
    """close(timeout=1) on one rank whose relayed save is durable while the other rank saves 6 s later.
    Rank 1 closing said "this process closed before rank 0's commit of step 1 was known", and then rank 0
    committed the step: a handle that said failed for a committed step. Rank 0 closing named a rank that
    had not failed. A shard durable here is out of this rank's hands (rank 0 decides), so close() now waits
    for that decision (bounded by the relay's 2 x commit_timeout): both ranks' handles say committed."""
    a, b = daemon_factory(name="a"), daemon_factory(name="b", root=tmp / "root")
    script = tmp / "closer.py"
    script.write_text(CLOSER)
    port = free_port()
    procs = [zygote.popen([sys.executable, str(script), f"{a.socket},{b.socket}", str(r), str(port), str(closer)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    outcomes = [next(ln for ln in o.splitlines() if ln.startswith("OUTCOME ")) for o in outs]
    assert outcomes == ["OUTCOME committed", "OUTCOME committed"], outs
    assert Path(step_dir(str(a.root), "closer", 1), "index.json").exists()
    closed_s = float(next(ln for ln in outs[closer].splitlines() if ln.startswith("CLOSED in ")).split()[2][:-1])
    assert closed_s > 3, outs[closer]        # it waited for the other rank's save (6 s later), not 1 s


DIES_DURABLE = r'''
import os, signal, sys, time
import torch
import ckptd_client
ck = ckptd_client.Checkpointer("mix", socket=sys.argv[1], rank=1, world_size=2, commit="local", overlap=False)
h = ck.save(5, {"w": torch.full((1000,), 111.0)})
deadline = time.monotonic() + 60
while h.durable_s is None and time.monotonic() < deadline:
    time.sleep(0.02)
print("durable" if h.durable_s is not None else "never durable", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_local_step_a_killed_rank_left_is_saved_afresh_not_joined(daemon, tmp):
    """Local commit, world 2. Run A's rank 1 saves step 5 (durable) and is SIGKILLed before rank 0 saved
    it. The restarted job's ranks save step 5 again: rank 0's save joined run A's step, committed it with
    run A's rank 1 shard (111) beside its own, and run B's rank 1 was refused ("already committed"). The
    daemon now fails the step whose durable shard's process is gone and starts it afresh: step 5 holds
    run B's two shards."""
    script = tmp / "dies_durable.py"
    script.write_text(DIES_DURABLE)
    r = subprocess.run([sys.executable, str(script), str(daemon.socket)], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9 and r.stdout.strip() == "durable", (r.returncode, r.stdout, r.stderr[-2000:])
    cks = [ckptd_client.Checkpointer("mix", socket=str(daemon.socket), rank=rank, world_size=2, commit="local",
                                     overlap=False) for rank in (0, 1)]
    handles = [ck.save(5, {"w": torch.full((1000,), 200.0 + rank)}) for rank, ck in enumerate(cks)]
    for h in handles:
        h.wait(60)
    for ck in cks:
        ck.close()
    for rank in (0, 1):
        with ckptd_client.Checkpointer("mix", root=str(daemon.root), rank=rank, world_size=2, memory=False) as ck:
            live = {"w": torch.zeros(1000)}
            assert ck.restore(live) == 5 and torch.equal(live["w"], torch.full((1000,), 200.0 + rank)), rank
    assert "left (killed?) before step 5 committed and rank 0 saved it again" in daemon.log_text()


def test_close_of_a_relayed_save_not_yet_durable_leaves_no_relay_thread(daemon_factory):
    """Relay commit, close(timeout=1) while this rank's shard is still being written: its relay thread
    waited (0.7 × commit_timeout) for a DURABLE event no closed session could bring; close gave up on it
    after one store-wait slice and returned with the thread alive, which used the job's store a minute
    later. close now publishes the open save failed (the others hear at once), so the thread ends first."""
    import random
    import threading

    from torch.distributed import TCPStore
    d = daemon_factory("--debug-write-delay", "10", "--chunk-mib", "1")
    store = TCPStore("127.0.0.1", random.randint(20000, 30000), 2, True, wait_for_workers=False)
    ck = ckptd_client.Checkpointer("cr", socket=str(d.socket), rank=0, world_size=2, store=store, commit="relay",
                                   commit_timeout=100, join_timeout=5)
    h = ck.save(1, {"w": torch.ones(1 << 20)})          # 4 MiB in 1 MiB chunks, 10 s each: never durable here
    report = ck.close(timeout=1)
    assert [t.name for t in threading.enumerate() if "relay" in t.name] == []
    assert h.done() and not h.committed and report.failed and report.failed[0][0] == 1, report
    assert "rank 0's process closed before its shard of step 1 was durable" in report.failed[0][1], report


def test_a_save_waiting_for_a_slot_of_a_stopped_daemon_fails_within_commit_timeout(daemon_factory):
    """The daemon is SIGSTOPped (wedged) while the only slot is being written: the next save() waited for
    a free slot forever (the connection stays up). It now fails after commit_timeout with the reason, and
    once the daemon runs again the save in flight still commits."""
    import os
    import signal
    import threading

    d = daemon_factory("--debug-write-delay", "0.5")
    ck = ckptd_client.Checkpointer("stopped", socket=str(d.socket), num_slots=1, commit_timeout=3, overlap=False)
    first = ck.save(1, {"w": torch.ones(1 << 18)})
    sigstop(d.proc.pid)
    raised: list[BaseException] = []

    def second() -> None:
        try:
            ck.save(2, {"w": torch.ones(1 << 18)})
        except BaseException as e:
            raised.append(e)
    t = threading.Thread(target=second)
    t0 = time.monotonic()
    t.start()
    t.join(30)
    stuck = t.is_alive()
    os.kill(d.proc.pid, signal.SIGCONT)
    t.join(60)
    assert not stuck, "save() still waiting for a slot 30 s after the daemon stopped"
    assert time.monotonic() - t0 < 20 and len(raised) == 1, raised
    assert isinstance(raised[0], ckptd_client.CheckpointError) and "no slot came free within 3s" in str(raised[0])
    first.wait(60)
    assert first.committed
    ck.close()


HOLDS_STORE = r'''
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import ckptd_client
socks, rank, port = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
ck = ckptd_client.Checkpointer("holds", socket=socks[rank], rank=rank, world_size=2, store=store, commit_timeout=10)
h = ck.save(1, {"w": torch.full((64,), float(rank))})
t0 = time.monotonic()
try:
    h.wait(60)
    print(f"OUTCOME committed in {time.monotonic() - t0:.1f}s", flush=True)
except ckptd_client.CheckpointError as e:
    print(f"OUTCOME {e}", flush=True)
if rank == 0:       # the trainer's own blocking wait on the job's store, as soon as its save committed
    store.wait(["rank1-done"], timedelta(seconds=120))
else:
    store.set("rank1-done", "1")
ck.close(timeout=30)
'''


def test_a_trainer_waiting_on_the_store_does_not_hold_rank_0s_result(daemon_factory, tmp):
    """Rank 0's handle settles from its daemon's COMMIT answer, and its trainer then blocks in a
    ``store.wait`` of its own (until rank 1 is done) on the job's store. The relay published rank 0's
    result on that same connection, so it queued behind the trainer's wait: rank 1 never saw it, and
    with its daemon's root apart from rank 0's (no index.json to find) its handle said "timed out after
    20s waiting for rank 0's commit" for a committed step. The client's store calls now go on
    connections of its own (store_guard.py): rank 1's handle says committed within seconds."""
    a, b = daemon_factory(name="a"), daemon_factory(name="b", root=tmp / "root-b")
    script = tmp / "holds.py"
    script.write_text(HOLDS_STORE)
    port = free_port()
    procs = [zygote.popen([sys.executable, str(script), f"{a.socket},{b.socket}", str(r), str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert Path(step_dir(str(a.root), "holds", 1), "index.json").exists()
    assert not Path(step_dir(str(b.root), "holds", 1), "index.json").exists()     # rank 1 cannot read it
    outcomes = [next(ln for ln in o.splitlines() if ln.startswith("OUTCOME ")) for o in outs]
    assert all(o.startswith("OUTCOME committed in ") for o in outcomes), outs
    assert float(outcomes[1].split()[3][:-1]) < 20, outcomes[1]     # not settled by the relay's 2 T bound
