"""Rank 0 stopped (SIGSTOP: its process, and the job's TCPStore it hosts, alive but silent): the other
ranks' saves and restores still end within their documented bounds, saying the store did not answer.
A TCPStore call never returns while its server is stopped (store_guard.py), so every store call the
client makes is bounded: a relayed save's handle settles by the disk by 2 x commit_timeout (docs/
operations.md: + 5 s), a restore's wait for rank 0's choice of step ends with the join window.

Two real gloo ranks on one daemon, the group's store in rank 0's process (``init_method="tcp://..."``)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from procfd import sigstop

import sharded_trainer as st

COMMIT_TIMEOUT = 4.0
JOIN_TIMEOUT = 6.0

WORKER = r'''
import os, sys, time
import torch
import torch.distributed as dist
import ckptd_client

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
sock, go, op, commit_timeout, join_timeout = sys.argv[1], sys.argv[2], sys.argv[3], *map(float, sys.argv[4:6])
rank = dist.get_rank()
ck = ckptd_client.Checkpointer("stopped", socket=sock, commit_timeout=commit_timeout, join_timeout=join_timeout,
                               local_world_size=1)
state = {"w": torch.full((1000,), float(rank))}
ck.save(1, state).wait(60)
dist.barrier()
if rank == 0:
    print("READY", flush=True)
    while True:             # the test stops this process (and the store it hosts) now
        time.sleep(1)
while not os.path.exists(go):
    time.sleep(0.05)
t0 = time.monotonic()
if op == "close":           # a save not yet durable left to close(); then the interpreter's own exit
    import threading
    state["w"] += 1
    ck.save(2, state)
    report = ck.close(timeout=0.5)
    print(f"CLOSED in {time.monotonic() - t0:.1f}s: {report}", flush=True)
    print("THREADS", sorted(t.name for t in threading.enumerate() if t.name.startswith("ckptd-client-r")), flush=True)
    sys.exit(0)
try:
    if op == "save":
        state["w"] += 1
        ck.save(2, state).wait()        # no timeout: the relay's own bound ends it
    else:
        ck.restore(state)
    print(f"RETURNED in {time.monotonic() - t0:.1f}s", flush=True)
except ckptd_client.CheckpointError as e:
    print(f"RAISED in {time.monotonic() - t0:.1f}s: {e}", flush=True)
t1 = time.monotonic()
ck.close()
print(f"CLOSED in {time.monotonic() - t1:.1f}s", flush=True)
os._exit(0)
'''


def _rank_1_with_rank_0_stopped(tmp: Path, socket: str, op: str, commit_timeout: float, within: float,
                                ) -> tuple[str, int | None, float]:
    """Two ranks run WORKER's ``op``: once step 1 committed on both, rank 0 is stopped and rank 1 goes
    on. Rank 1's output, exit status and seconds from the stop to its exit (an AssertionError, with
    its output, if it had not exited ``within`` seconds)."""
    script, go = tmp / "stopped_worker.py", tmp / "go"
    script.write_text(WORKER)
    procs = st.launch(2, socket, str(go), op, str(commit_timeout), str(JOIN_TIMEOUT), script=script)
    try:
        assert procs[0].stdout is not None
        seen = []
        for line in procs[0].stdout:        # step 1 committed on both ranks
            seen.append(line)
            if line.startswith("READY"):
                break
        assert seen and seen[-1].startswith("READY"), "".join(seen)
        sigstop(procs[0].pid)
        go.touch()
        t0 = time.monotonic()
        try:
            out, _ = procs[1].communicate(timeout=within)
        except Exception:
            procs[1].kill()
            raise AssertionError(f"rank 1's {op} still blocked {within:.0f}s after rank 0 stopped: "
                                 f"{procs[1].communicate()[0][-4000:]}") from None
        return out, procs[1].returncode, time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)


@pytest.mark.parametrize("op, bound", [("save", 2 * COMMIT_TIMEOUT + 15), ("restore", JOIN_TIMEOUT + 15)])
def test_a_stopped_rank_0_does_not_hold_the_other_ranks(tmp: Path, daemon: Any, op: str, bound: float) -> None:
    out, _, took = _rank_1_with_rank_0_stopped(tmp, str(daemon.socket), op, COMMIT_TIMEOUT, bound + 30)
    raised = [line for line in out.splitlines() if line.startswith("RAISED in ")]
    assert raised, out[-4000:]
    assert float(raised[0].split()[2].rstrip("s:")) <= bound, (bound, raised[0])
    assert "did not answer a " in raised[0] and "rank 0 stopped" in raised[0], raised[0]
    assert "TCPStore at 127.0.0.1:" in raised[0], raised[0]
    if op == "restore":
        assert "join_timeout" in raised[0], raised[0]
    assert "CLOSED in " in out and took <= bound + 10, (took, out[-4000:])


def test_closing_while_rank_0_is_stopped_ends_its_threads_and_exits_cleanly(tmp: Path, daemon_factory: Any) -> None:
    """Rank 1 closes its Checkpointer with a save not yet durable (its daemon writes slowly) while rank 0 is
    stopped, then exits the normal way. The save's relay thread is inside a store call that ends only at
    2 x commit_timeout + 10 s from the save: ``close()`` waits 15 s for it, then cuts the call short, so no
    thread is left inside a C++ store call when the interpreter exits (before: the thread was left)."""
    commit_timeout = 20.0
    daemon = daemon_factory("--debug-write-delay", "3")
    bound = 0.5 + 15 + 5 + 10       # close's timeout, the relay's join, the abandoned call's end, slack
    out, rc, took = _rank_1_with_rank_0_stopped(tmp, str(daemon.socket), "close", commit_timeout, 3 * bound)
    assert "THREADS []" in out, out[-4000:]       # the relay's thread (and the run's) ended in close()
    assert rc == 0, (rc, out[-4000:])
    assert took <= bound, (took, out[-4000:])
