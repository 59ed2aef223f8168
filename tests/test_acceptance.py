"""Acceptance: exact resume after SIGKILL, daemon crash, corruption, multi-daemon, clear errors."""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from ports import free_port
from safetensors.torch import load_file

import ckptd_client

from conftest import REPO

TRAINER = REPO / "tests" / "trainer.py"



def launch(world: int, sockets: list[Path], job: str, out: Path, *extra: str) -> list[zygote.Proc]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs.append(zygote.popen(
            [sys.executable, str(TRAINER), "--sockets", ",".join(map(str, sockets)), "--job", job,
             "--out", str(out), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs: list[zygote.Proc], timeout: float = 240) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
        assert p.returncode == 0, f"trainer rank exited {p.returncode}:\n{out}"
    return outs


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert sorted(ta) == sorted(tb)
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in ta)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{k} differs"


def kill_after_commit(procs: list[zygote.Proc], step: int) -> None:
    """SIGKILL every rank once rank 0 reports step ``step`` (or a later one) committed."""
    seen = []
    for line in procs[0].stdout:
        seen.append(line)
        if line.startswith("COMMITTED") and int(line.split()[1]) >= step:
            break
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
        assert p.returncode == -signal.SIGKILL
    assert any(line.startswith("COMMITTED") for line in seen), "".join(seen)


def test_exact_resume_after_sigkill(daemon, tmp):
    """Two DDP ranks are SIGKILLed after a commit; a fresh run resumes to bit-identical final state."""
    args = ("--steps", "24", "--every", "3", "--step-sleep", "0.05")
    finish(launch(2, [daemon.socket], "reference", tmp / "ref", *args))

    kill_after = random.Random().choice([3, 6, 9, 12])
    kill_after_commit(launch(2, [daemon.socket], "crashy", tmp / "crash", *args), kill_after)
    assert not (tmp / "crash.rank0.safetensors").exists()

    outs = finish(launch(2, [daemon.socket], "crashy", tmp / "crash", *args))
    restored = [line for line in outs[0].splitlines() if line.startswith("RESTORED")]
    assert restored and int(restored[0].split()[1]) >= kill_after, outs[0]
    for rank in range(2):
        assert_same_tensors(tmp / f"ref.rank{rank}.safetensors", tmp / f"crash.rank{rank}.safetensors")


def test_multi_daemon_commit(daemon_factory, tmp):
    """Four ranks on two daemons (one root) commit one index through the c10d store; it restores."""
    a, b = daemon_factory(name="a"), daemon_factory(name="b")
    assert a.root == b.root
    finish(launch(4, [a.socket, b.socket], "multi", tmp / "first", "--steps", "8", "--every", "4"))
    step_dir = a.root / "multi" / "step-000000000008"
    index = (step_dir / "index.json").read_text()
    assert '"world_size":4' in index
    assert sorted(p.name for p in step_dir.glob("rank-*.json")) == [f"rank-0000{r}.json" for r in range(4)]
    # Each daemon wrote its own ranks' shards.
    assert "rank=2" in b.log_text() and "rank=3" in b.log_text() and "rank=2" not in a.log_text()
    outs = finish(launch(4, [a.socket, b.socket], "multi", tmp / "again", "--steps", "8", "--every", "4"))
    assert all("RESTORED 8" in o for o in outs)
    for rank in range(4):
        assert_same_tensors(tmp / f"first.rank{rank}.safetensors", tmp / f"again.rank{rank}.safetensors")


def big_state(n_tensors: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(mib * 262144, generator=g) for i in range(n_tensors)}


def test_daemon_killed_mid_write(daemon_factory, tmp):
    """SIGKILL the daemon while it writes: that step never loads, the previous one does, a restart serves."""
    d = daemon_factory("--debug-write-delay", "0.4", "--chunk-mib", "1")
    ck = ckptd_client.Checkpointer("crash", socket=str(d.socket))
    small = {"w": torch.arange(10.0)}
    ck.save(1, small).wait(60)
    state = big_state(6, 1)
    handle = ck.save(2, state)
    data = d.root / "crash" / "step-000000000002" / "rank-00000.data"
    deadline = time.monotonic() + 30
    while not (data.exists() and data.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert data.exists()
    d.kill(signal.SIGKILL)
    with pytest.raises(ckptd_client.CheckpointError, match="lost"):
        handle.wait(30)
    assert not (data.parent / "index.json").exists()
    assert ck.latest_step() == 1
    target = {"w": torch.zeros(10)}
    assert ck.restore(target) == 1 and torch.equal(target["w"], small["w"])

    daemon_factory(name="d")  # same socket path and root, no delay
    ck.save(3, state).wait(60)      # reconnects on its own
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ck.restore(target) == 3
    assert all(torch.equal(target[k], state[k]) for k in state)
    with pytest.raises(ckptd_client.CheckpointError, match="not committed|does not exist"):
        ck.restore(target, step=2)
    ck.close()


def test_corruption_is_named(daemon, tmp):
    """One flipped byte: restore and `ckptd verify` both fail naming the tensor and the file."""
    ck = ckptd_client.Checkpointer("corrupt", socket=str(daemon.socket), root=str(daemon.root))
    state = {"a": torch.randn(1000), "b": torch.randn(50_000).bfloat16(), "c": torch.arange(100)}
    ck.save(5, state).wait(60)
    ck.close()
    step = daemon.root / "corrupt" / "step-000000000005"
    ok = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(step)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr

    from ckptd.core.reader import StepReader
    entry = StepReader(str(step)).manifest(0).by_name()["b"]
    data = step / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[entry.offset + entry.chunks[0].stored_len // 2] ^= 0x01
    data.write_bytes(bytes(raw))

    bad = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(step)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "'b'" in bad.stdout and "rank-00000.data" in bad.stdout and "'a'" not in bad.stdout

    fresh = ckptd_client.Checkpointer("corrupt", root=str(daemon.root), socket="/nonexistent/ckptd.sock")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ckptd_client.CheckpointError) as err:
        fresh.restore(target)          # no daemon needed when root is given
    assert "'b'" in str(err.value) and "rank-00000.data" in str(err.value)


def test_clear_errors(daemon, tmp):
    ck = ckptd_client.Checkpointer("errors", socket=str(daemon.socket))
    with pytest.raises(TypeError, match=r"'optim/extra/1'"):
        ck.save(1, {"optim": {"extra": [1, object()]}})
    with pytest.raises(TypeError, match="set"):
        ck.save(1, {"s": {1, 2}})
    for bad in ("../escape", "a/b", "", ".hidden", "x" * 200, "nul\x00"):
        with pytest.raises(ValueError, match="invalid job name"):
            ckptd_client.Checkpointer(bad, socket=str(daemon.socket))
    with pytest.raises(ValueError, match="invalid tensor name"):
        ck.save(1, {"..": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"'deep/x': it has 65 dimensions, over ckptd's limit of 64"):
        ck.save(1, {"deep": {"x": torch.zeros([1] * 65)}})     # (before the hand-off: no daemon refusal)
    # Nothing was written by the refused saves.
    assert not (daemon.root / "errors").exists() or not list((daemon.root / "errors").iterdir())
    ck.save(1, {"ok": torch.ones(2)}).wait(30)
    ck.close()

    missing = tmp / "no-daemon.sock"
    lone = ckptd_client.Checkpointer("errors", socket=str(missing))
    with pytest.raises(ckptd_client.CheckpointError) as err:
        lone.save(1, {"x": torch.ones(1)})
    assert str(missing) in str(err.value) and "ckptd serve" in str(err.value)
    with pytest.raises(ckptd_client.CheckpointError, match=str(missing)):
        lone.restore({"x": torch.ones(1)})


def test_many_ranks_one_daemon_local_commit(daemon, tmp):
    """Eight rank processes without torch.distributed: the daemon itself counts ranks and commits."""
    code = (
        "import sys, torch, ckptd_client\n"
        "r = int(sys.argv[1]); ck = ckptd_client.Checkpointer('eight', socket=sys.argv[2], rank=r, world_size=8)\n"
        "ck.save(1, {'w': torch.full((1000,), float(r)), 'r': r}).wait(120)\n"
        "t = {'w': torch.zeros(1000), 'r': -1}\n"
        "assert ck.restore(t) == 1 and t['r'] == r and torch.equal(t['w'], torch.full((1000,), float(r)))\n"
        "ck.close()\n")
    procs = [zygote.popen([sys.executable, "-c", code, str(r), str(daemon.socket)],
                          stderr=subprocess.PIPE, text=True) for r in range(8)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    assert (daemon.root / "eight" / "step-000000000001" / "index.json").is_file()


def test_restore_reads_only_its_own_shard(daemon):
    """Two ranks (two clients in one process, local commit); rank 0 restores with rank 1's files gone."""
    cks = [ckptd_client.Checkpointer("own", socket=str(daemon.socket), rank=r, world_size=2, memory=False)
           for r in range(2)]       # storage restores (the memory tier would serve rank 1 without its files)
    states: list[dict[str, Any]] = [{"w": torch.full((100,), float(r)), "r": r} for r in range(2)]
    handles = [ck.save(1, st) for ck, st in zip(cks, states, strict=False)]
    for h in handles:
        h.wait(60)
    step = daemon.root / "own" / "step-000000000001"
    for name in ("rank-00001.data", "rank-00001.json"):
        (step / name).unlink()
    target: dict[str, Any] = {"w": torch.zeros(100), "r": -1}
    assert cks[0].restore(target) == 1 and target["r"] == 0 and torch.equal(target["w"], states[0]["w"])
    with pytest.raises(ckptd_client.CheckpointError, match="rank-00001.json"):
        cks[1].restore({"w": torch.zeros(100), "r": -1})
    for ck in cks:
        ck.close()


def test_several_jobs_at_once(daemon):
    """Two jobs of two ranks each save concurrently through one daemon; each commits its own index."""
    code = (
        "import sys, torch, ckptd_client\n"
        "job, r = sys.argv[1], int(sys.argv[2])\n"
        "ck = ckptd_client.Checkpointer(job, socket=sys.argv[3], rank=r, world_size=2)\n"
        "hs = [ck.save(s, {'w': torch.randn(200_000), 'job': job}) for s in (1, 2, 3)]\n"
        "[h.wait(120) for h in hs]\n"
        "ck.close()\n")
    procs = [zygote.popen([sys.executable, "-c", code, job, str(r), str(daemon.socket)],
                          stderr=subprocess.PIPE, text=True) for job in ("job-a", "job-b") for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    for job in ("job-a", "job-b"):
        for s in (1, 2, 3):
            assert (daemon.root / job / f"step-{s:012d}" / "index.json").is_file()
