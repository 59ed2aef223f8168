"""PreemptionHandler: a real training process gets a real signal, checkpoints at the next step
boundary, waits for the commit and exits 0."""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import zygote
from ports import free_port

import ckptd_client
from ckptd.core.reader import StepReader

TRAINER = r'''
import os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import ckptd_client

sock, job, signame = sys.argv[1], sys.argv[5], sys.argv[6]
rank, world, port = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if world > 1:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
if world > 1:
    model = torch.nn.parallel.DistributedDataParallel(model)      # its all-reduce keeps ranks in step
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = ckptd_client.Checkpointer(job, socket=sock)
state = {"model": model, "optim": opt, "step": 0}
stopped = None
with ckptd_client.PreemptionHandler(ckpt, signals=(getattr(signal, signame),)) as preempt:
    for step in range(1, 10**6):
        loss = model(torch.randn(8, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step
        if step % 50 == 0:
            ckpt.save(step, state)                 # ordinary periodic checkpoints go on as usual
        print(f"STEP {step}", flush=True)
        if preempt.should_stop(step, state):
            stopped = step
            print(f"STOPPED {step} saved={preempt.saved_step} error={preempt.error}", flush=True)
            break
        time.sleep(0.005)
ckpt.close()
if world > 1:
    dist.destroy_process_group()
sys.exit(0 if stopped is not None and preempt.error is None else 3)
'''


def start_trainer(tmp: Path, sock: Path, rank: int = 0, world: int = 1, port: int = 0, job: str = "pre",
                  signame: str = "SIGTERM") -> zygote.Proc:
    script = tmp / "preempt_trainer.py"
    script.write_text(TRAINER)
    return zygote.popen([sys.executable, str(script), str(sock), str(rank), str(world), str(port), job, signame],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: zygote.Proc, prefix: str, lines: list[str]) -> str:
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith(prefix):
            return line.rstrip()
    raise AssertionError(f"process ended (rc={proc.wait()}) before {prefix!r}:\n" + "\n".join(lines[-30:]))


def last_step(lines: list[str]) -> int:
    return max(int(ln.split()[1]) for ln in lines if ln.startswith("STEP "))


def test_sigterm_checkpoints_at_next_step_boundary_and_exits_0(daemon, tmp):
    proc = start_trainer(tmp, daemon.socket)
    lines: list[str] = []
    try:
        read_until(proc, "STEP 5", lines)
        proc.send_signal(signal.SIGTERM)
        signalled_after = last_step(lines)
        stopped = read_until(proc, "STOPPED", lines)
        rest = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, "\n".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    step = int(stopped.split()[1])
    assert stopped == f"STOPPED {step} saved={step} error=None"
    assert step >= signalled_after                       # the next boundary, not a step already past
    path = daemon.root / "pre" / f"step-{step:012d}"
    assert (path / "index.json").is_file() and StepReader(str(path)).world_size == 1
    # the checkpoint is the state at that boundary
    model = torch.nn.Linear(32, 32)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3), "step": 0}
    assert ckptd_client.Checkpointer("pre", root=str(daemon.root), socket=str(daemon.socket)).restore(state) == step
    assert state["step"] == step


def test_user_signal_in_process(daemon):
    """signals=(SIGUSR1,): nothing happens until it arrives; the old handler comes back on close."""
    previous = signal.getsignal(signal.SIGUSR1)
    ck = ckptd_client.Checkpointer("usr", socket=str(daemon.socket))
    state = {"w": torch.arange(8.0)}
    with ckptd_client.PreemptionHandler(ck, signals=(signal.SIGUSR1,)) as preempt:
        assert signal.getsignal(signal.SIGUSR1) != previous
        assert not preempt.should_stop(1, state) and not preempt.requested
        os.kill(os.getpid(), signal.SIGUSR1)              # a real signal, handled in the main thread
        assert preempt.requested and preempt.signal_received == signal.SIGUSR1
        assert preempt.should_stop(2, state)
        assert preempt.saved_step == 2 and preempt.error is None
        assert preempt.should_stop(3, state)              # stays stopped; no second checkpoint
    assert signal.getsignal(signal.SIGUSR1) == previous
    assert (daemon.root / "usr" / "step-000000000002" / "index.json").is_file()
    assert not (daemon.root / "usr" / "step-000000000003").exists()
    ck.close()


def test_step_already_saved_is_waited_for_not_saved_twice(daemon):
    ck = ckptd_client.Checkpointer("dup", socket=str(daemon.socket))
    state = {"w": torch.arange(8.0)}
    preempt = ckptd_client.PreemptionHandler(ck, signals=(signal.SIGUSR2,))
    try:
        h = ck.save(4, state)
        preempt.request()
        assert preempt.should_stop(4, state) and preempt.saved_step == 4 and preempt.error is None
        assert h.committed
    finally:
        preempt.close()
        ck.close()


def test_a_memory_level_save_of_the_step_is_saved_to_storage_as_well(daemon):
    """The loop saved the stop step at memory level: the handler took that save for the preemption
    checkpoint, said committed, and the step was gone with the daemon. It now lets it settle and
    saves the step to storage."""
    state = {"w": torch.arange(8.0)}
    with ckptd_client.Checkpointer("mlv", socket=str(daemon.socket)) as ck, \
            ckptd_client.PreemptionHandler(ck, signals=(signal.SIGUSR2,)) as preempt:
        ck.save(4, state).wait(60)
        state["w"] += 1
        h = ck.save(5, state, level="memory")
        preempt.request()
        assert preempt.should_stop(5, state) and preempt.saved_step == 5 and preempt.error is None
        assert h.committed
    assert ck.latest_step() == 5
    with ckptd_client.Checkpointer("mlv", root=str(daemon.root), memory=False) as fresh:
        live = {"w": torch.zeros(8)}
        assert fresh.restore(live) == 5 and torch.equal(live["w"], torch.arange(8.0) + 1)


def test_failed_checkpoint_still_stops_and_says_why(tmp):
    """No daemon: the checkpoint cannot be taken, the loop is still told to stop, with the reason."""
    ck = ckptd_client.Checkpointer("gone", socket=str(tmp / "no-daemon.sock"), root=str(tmp / "root"))
    with ckptd_client.PreemptionHandler(ck, signals=(signal.SIGUSR2,)) as preempt:
        preempt.request()
        assert preempt.should_stop(1, {"w": torch.zeros(2)})
        assert preempt.saved_step is None and "cannot reach the ckptd daemon" in preempt.error


def test_two_ranks_agree_on_the_step_when_one_is_signalled(daemon, tmp):
    """SIGTERM reaches rank 1 only; through the job's c10d store both ranks stop at the same step,
    which commits (relay commit across ranks) — and both exit 0."""
    port = free_port()
    procs = [start_trainer(tmp, daemon.socket, rank=r, world=2, port=port, job="pair") for r in (0, 1)]
    lines: list[list[str]] = [[], []]
    try:
        read_until(procs[1], "STEP 5", lines[1])
        procs[1].send_signal(signal.SIGTERM)
        stopped = [read_until(p, "STOPPED", ls) for p, ls in zip(procs, lines, strict=False)]
        for p in procs:
            p.communicate(timeout=120)
        assert [p.returncode for p in procs] == [0, 0], lines
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    steps = {int(s.split()[1]) for s in stopped}
    assert len(steps) == 1, stopped
    step = steps.pop()
    assert all(s == f"STOPPED {step} saved={step} error=None" for s in stopped)
    path = daemon.root / "pair" / f"step-{step:012d}"
    assert (path / "index.json").is_file() and StepReader(str(path)).world_size == 2
