"""A Checkpointer in the life of a real training process: threads that save at once, children forked
by DataLoader workers and pools, and an interpreter that exits with saves open (api_guard.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

import ckptd_client
from ckptd.core import protocol

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def trained(seed: int, width: int = 512) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, width)).pow(2).mean().backward()
    opt.step()
    return model, opt


def flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*model.state_dict().values(), *(v for st in opt.state.values() for v in st.values())]


def first_saves_at_once(sock: str, root: str, job: str) -> None:
    """Two threads meet at a barrier and each makes the first save of one fresh Checkpointer."""
    ck = ckptd_client.Checkpointer(job, socket=sock)
    states = {step: trained(step) for step in (1, 2)}
    want = {step: [t.clone() for t in flat(*states[step])] for step in (1, 2)}
    barrier = threading.Barrier(2)
    out: dict[int, str] = {}

    def save(step: int) -> None:
        barrier.wait()
        try:
            model, opt = states[step]
            ck.save(step, {"model": model, "optim": opt}).wait(60)
            out[step] = "committed"
        except Exception as e:
            out[step] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=save, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    sessions = [s for s in protocol.request_once(sock, {"op": "status"})["sessions"] if s["job"] == job]
    assert out == {1: "committed", 2: "committed"}, out
    assert len(sessions) == 1, sessions
    for step in (1, 2):
        model, opt = trained(9)
        with ckptd_client.Checkpointer(job, root=root, memory=False, prepare=False) as reader:
            reader.restore({"model": model, "optim": opt}, step)
        got = flat(model, opt)
        assert len(got) == len(want[step]), step
        assert all(torch.equal(a, b) for a, b in zip(got, want[step], strict=True)), step
    ck.close()


def test_two_threads_making_the_first_save_at_once(daemon):
    """Both connected (two daemon sessions for one Checkpointer) and one unmapped the slots the other's
    copy was writing: a SIGSEGV, or a handle committed over the other save's bytes. Calls now take turns."""
    for rnd in range(4):
        first_saves_at_once(str(daemon.socket), str(daemon.root), f"race{rnd}")


CHILD_SAVES = r'''
import os, sys, time, torch, ckptd_client
ck = ckptd_client.Checkpointer("fork", socket=sys.argv[1], overlap=False)
ck.save(1, {"w": torch.full((4096,), 1.0)}).wait(60)
pid = os.fork()
if pid == 0:
    t0 = time.monotonic()
    try:
        ck.save(5, {"w": torch.full((4096,), 7.0)}).wait(5)
        print("CHILD committed", flush=True)
    except ckptd_client.CheckpointError as e:
        print(f"CHILD refused in {time.monotonic() - t0:.1f}s: {e}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
ck.save(2, {"w": torch.full((4096,), 2.0)}).wait(60)
print("PARENT committed 2", flush=True)
ck.close()
'''


def test_a_forked_child_cannot_save_through_its_parents_checkpointer(daemon, tmp):
    """A child forked after a save called save() on the inherited Checkpointer: it went through the
    parent's session (the child's state committed as the job's newest step, the parent's next save
    refused, its held copy corrupted). The child is now refused, naming the fix, and the parent goes on."""
    script = tmp / "child_saves.py"
    script.write_text(CHILD_SAVES)
    r = subprocess.run([sys.executable, str(script), str(daemon.socket)], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CHILD refused" in r.stdout and "make a new Checkpointer in this process" in r.stdout, r.stdout
    assert "PARENT committed 2" in r.stdout, r.stdout
    job = daemon.root / "fork"
    assert sorted(p.name for p in job.iterdir() if (p / "index.json").exists()) == \
        ["step-000000000001", "step-000000000002"]
    live = {"w": torch.zeros(4096)}
    with ckptd_client.Checkpointer("fork", root=str(daemon.root), memory=False, prepare=False) as reader:
        assert reader.restore(live) == 2 and torch.equal(live["w"], torch.full((4096,), 2.0))


CHILD_EXITS = r'''
import os, sys, torch, ckptd_client
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 256)).sum().backward()
opt.step()
ck = ckptd_client.Checkpointer("nb", root=sys.argv[1], spawn=True)
ck.save(1, {"model": model, "optim": opt}).wait(60)
pid = os.fork()
if pid == 0:
    sys.exit(0)            # atexit runs in the child: it must leave the parent's daemon alone
os.waitpid(pid, 0)
print("SOCKET", os.path.exists(ck.socket_path), flush=True)
ck.save(2, {"model": model, "optim": opt}).wait(60)
print("PARENT committed 2", flush=True)
ck.save(3, {"model": model, "optim": opt}).wait(60)     # overlapped; the script ends without close()
'''


def test_a_forked_childs_exit_leaves_a_spawned_daemon_alone(tmp):
    """spawn=True: a child forked from the trainer that exits through sys.exit ran the parent's atexit
    close, which shut down the shared socket and removed the private daemon's directory (its socket):
    every later save of the parent failed. A script that then ends without close() printed an atexit
    traceback ("cannot schedule new futures after shutdown"). Now: both quiet, every step committed."""
    script = tmp / "child_exits.py"
    script.write_text(CHILD_EXITS)
    r = subprocess.run([sys.executable, str(script), str(tmp / "root")], capture_output=True, text=True,
                       timeout=180, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SOCKET True" in r.stdout and "PARENT committed 2" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    job = tmp / "root" / "nb"
    assert sorted(p.name for p in job.iterdir() if (p / "index.json").exists())[-1] == "step-000000000003"
