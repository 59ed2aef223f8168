"""One rank of a 2-rank gloo job for tests/test_runs.py: runs of a job one after the other on a
store that outlives them. Prints what the tests check, one line each:

``RESTORED <step or None>``; ``COMMITTED <step> index=<True|False>`` (whether the step's
index.json existed the moment its handle said committed); ``FAILED <step> <reason>``;
``SAVED <step>``; ``STOPPED <step> saved=<step> index=<True|False>`` (a preemption stop).

``launcher`` mode (argv: launcher <spec JSON>): the store is a launcher's (another process
hosts it) and goes to the Checkpointer as ``store=``; each run's process group gets a prefix of
its own. ``phase`` 1 saves 2 and 4, then rank 0 saves 6 and dies at once (SIGKILL) and rank 1
waits to be killed: a crashed run. ``phase`` 2 (rank 0 slowed: it sleeps before restoring and
before each save) restores and saves 6 and 8.

``pg`` mode: the process group's own store (rank 0 hosts it), no ``store=``; two
Checkpointers one after the other in the same processes, each with a PreemptionHandler: rank 1
asks for preemption 5 steps in, so each stops 7 steps after where it started (rank 0 slowed in
the second).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ckptd_client
from ckptd.core.names import INDEX_NAME, step_dir

_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        print(line, flush=True)


class Watcher:
    """Waits for each handle on a thread of its own and says, the moment it is committed, whether
    the step's index.json exists."""

    def __init__(self, root: str, job: str) -> None:
        self.root, self.job = root, job
        self.threads: list[threading.Thread] = []

    def index_exists(self, step: int) -> bool:
        return os.path.isfile(os.path.join(step_dir(self.root, self.job, step), INDEX_NAME))

    def watch(self, h: ckptd_client.SaveHandle) -> None:
        def wait() -> None:
            try:
                h.wait(120)
            except ckptd_client.CheckpointError as e:
                say(f"FAILED {h.step} {e}")
                return
            say(f"COMMITTED {h.step} index={self.index_exists(h.step)}")
        t = threading.Thread(target=wait)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(150)


def state_of(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step * 10 + rank)), "step": step}


def launcher(spec: dict[str, Any]) -> None:
    rank, phase, job, root = spec["rank"], spec["phase"], spec["job"], spec["root"]
    store = dist.TCPStore("127.0.0.1", spec["port"], 2, is_master=False, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pg-{phase}", store), rank=rank, world_size=2)
    slow = rank == 0 and phase == 2
    ck = ckptd_client.Checkpointer(job, socket=spec["socket"], root=root, store=store, commit_timeout=30,
                                   local_world_size=1, overlap=False)
    w = Watcher(root, job)
    if slow:
        time.sleep(2.0)
    live = state_of(rank, 0)
    say(f"RESTORED {ck.restore(live)}")
    for step in ((2, 4, 6) if phase == 1 else (6, 8)):
        if slow:
            time.sleep(2.0)
        h = ck.save(step, state_of(rank, step))
        say(f"SAVED {step}")
        if phase == 1 and step == 6:
            if rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)      # mid-save: its keys stay in the store
            time.sleep(120)                               # (the test kills this rank)
        w.watch(h)
        if phase == 1:
            h.wait(120)     # steps 2 and 4 commit before the crash,
            dist.barrier()  # on both ranks (rank 0 must not die before its relay told rank 1)
    w.join()
    ck.close()
    dist.destroy_process_group()


def pg(spec: dict[str, Any]) -> None:
    rank, job, root = spec["rank"], spec["job"], spec["root"]
    store = dist.TCPStore("127.0.0.1", spec["port"], 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    for run in (1, 2):
        slow = rank == 0 and run == 2
        ck = ckptd_client.Checkpointer(job, socket=spec["socket"], root=root, commit_timeout=30,
                                       local_world_size=1, overlap=False)
        w = Watcher(root, job)
        if slow:
            time.sleep(2.0)
        start = ck.restore(state_of(rank, 0)) or 0
        say(f"RESTORED {start if start else None}")
        with ckptd_client.PreemptionHandler(ck, signals=(signal.SIGUSR1,)) as preempt:
            for step in range(start + 1, start + 40):
                dist.barrier()                  # the ranks move in step, as a training job's collectives keep them
                if step % 2 == 0:
                    if slow:
                        time.sleep(1.0)
                    w.watch(ck.save(step, state_of(rank, step)))
                if rank == 1 and step == start + 5:
                    preempt.request()
                if preempt.should_stop(step, state_of(rank, step)):
                    saved = preempt.saved_step
                    say(f"STOPPED {step} saved={saved} index={saved is not None and w.index_exists(saved)}")
                    break
        w.join()
        ck.close()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"launcher": launcher, "pg": pg}[sys.argv[1]](json.loads(sys.argv[2]))
