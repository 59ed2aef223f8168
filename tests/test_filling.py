"""A save handed to the daemon before its slot is full (ckptd_client/handoff.py, ckptd/daemon/filling.py).

A save that copies its whole state in the ``save()`` call sends the SAVE first and then tells the
daemon how far the copy has filled the slot; the daemon writes what is filled while the rest is
copied (an overlapped save's copy thread likewise). Real daemons, real trainer processes: the write
is seen under way before the slot is full and the step restores bit-exact; a trainer SIGKILLed
mid-copy leaves no committed step and the previous one restores; malformed fills are refused by name."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import os
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
import zygote

import ckptd_client
from ckptd.core import protocol
from ckptd.core.names import step_dir
from ckptd_client import handoff
from ckptd_client.connection import DaemonConnection
from ckptd_client.errors import DaemonRefused

from test_memory_tier import status

MiB = 1 << 20


def big_state(seed: int) -> dict[str, Any]:
    """~100 MiB in tensors of several dtypes and sizes: several FILL_STEPs of copy."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(12 * MiB, generator=g), "b": torch.randn(8 * MiB, generator=g).bfloat16(),
            "c": torch.randint(-2**40, 2**40, (2 * MiB,), generator=g), "small": torch.arange(7),
            "d": torch.randn(5 * MiB + 3, generator=g), "meta": {"seed": seed}}


def written(sock: Any, job: str, step: int) -> int:
    return sum(w["written_bytes"] for w in status(sock)["saves"] if w["job"] == job and w["step"] == step)


def watch_first_mark(monkeypatch: Any, ck: Any, sock: Any, job: str) -> list[tuple[int, int]]:
    """At the save's first fill mark (long before its slot is full), wait until the daemon has written
    some of it; the list gets (bytes the slot was filled to, bytes the daemon had written)."""
    seen: list[tuple[int, int]] = []
    real = handoff.report

    def report(conn: Any, step: int, upto: int) -> None:
        real(conn, step, upto)
        if not seen and upto < ck.slots[0].size:
            end = time.monotonic() + 60
            while (w := written(sock, job, step)) == 0:
                assert time.monotonic() < end, "the daemon wrote nothing of a slot filled past its first mark"
                time.sleep(0.01)
            seen.append((upto, w))
    monkeypatch.setattr(handoff, "report", report)
    return seen


def test_the_write_runs_while_the_slot_is_filled_and_the_step_restores_exactly(daemon_factory, monkeypatch):
    d = daemon_factory()
    ck = ckptd_client.Checkpointer("fill", socket=str(d.socket), overlap=False)
    state = big_state(1)
    seen = watch_first_mark(monkeypatch, ck, d.socket, "fill")
    h = ck.save(1, state)
    assert seen and 0 < seen[0][1] <= seen[0][0], seen      # written: only bytes already filled
    h.wait(120)
    assert h.committed
    target: dict[str, Any] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {} for k, v in state.items()}
    fresh = ckptd_client.Checkpointer("fill", socket=str(d.socket), memory=False)
    assert fresh.restore(target) == 1 and fresh.last_restore.source == "storage"
    for k, v in state.items():
        assert (torch.equal(v, target[k]) and v.dtype == target[k].dtype) if isinstance(v, torch.Tensor) \
            else target[k] == v, k
    fresh.close()
    ck.close()


def test_a_trainer_killed_mid_copy_leaves_no_step_and_the_last_one_restores(daemon_factory):
    d = daemon_factory()
    script = textwrap.dedent(f"""
        import os, signal, sys, torch, ckptd_client
        from ckptd_client import handoff
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_filling import big_state
        ck = ckptd_client.Checkpointer("die", socket={str(d.socket)!r}, overlap=False)
        state = big_state(1)
        ck.save(1, state).wait(120)
        real = handoff.report
        def report(conn, step, upto):
            real(conn, step, upto)
            if step == 2:
                os.kill(os.getpid(), signal.SIGKILL)     # after the first mark: the slot half filled
        handoff.report = report
        ck.save(2, big_state(2))
    """)
    p = zygote.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr
    end = time.monotonic() + 60
    while [w for w in status(d.socket)["saves"] if w["job"] == "die"]:     # the write of step 2 stops
        assert time.monotonic() < end, "the dead trainer's write never stopped"
        time.sleep(0.05)
    assert not os.path.exists(os.path.join(step_dir(str(d.root), "die", 2), "index.json"))
    assert not os.path.exists(step_dir(str(d.root), "die", 2)) or not os.listdir(step_dir(str(d.root), "die", 2))
    ck = ckptd_client.Checkpointer("die", socket=str(d.socket))
    state, target = big_state(1), big_state(3)
    assert ck.restore(target) == 1
    assert all(torch.equal(v, target[k]) for k, v in state.items() if isinstance(v, torch.Tensor))
    ck.save(2, state).wait(120)                    # the step saves again, filling
    assert os.path.exists(os.path.join(step_dir(str(d.root), "die", 2), "index.json"))
    ck.close()


def test_malformed_fills_are_refused_by_name(daemon_factory):
    d = daemon_factory()
    with DaemonConnection(str(d.socket)) as conn:
        reply = conn.request(protocol.Hello(job="bad", rank=0, world_size=1, pid=os.getpid(), slot_bytes=MiB,
                                            num_slots=2))
        assert reply["fills"] is True
        for fd in reply["_fds"]:
            os.close(fd)
        layout = [["w", "float32", [1024], 0, 4096]]
        with pytest.raises(DaemonRefused, match="no filling save of step 1"):
            conn.request(protocol.SaveFilled(step=1, upto=4096))
        with pytest.raises(DaemonRefused, match="not a streamed or memory-level one"):
            conn.request(protocol.Save(step=1, slot=0, tensors=layout, tree=None, commit="local", filling=True,
                                       level="memory"))
        conn.request(protocol.Save(step=1, slot=0, tensors=layout, tree={"d": [["w", {"T": "w"}]]}, commit="local",
                                   filling=True))
        with pytest.raises(DaemonRefused, match="outside the"):
            conn.request(protocol.SaveFilled(step=1, upto=2 * MiB))
        conn.request(protocol.SaveFilled(step=1, upto=4096))
        end = time.monotonic() + 60          # (connected: a client that leaves abandons its saves)
        while not os.path.exists(os.path.join(step_dir(str(d.root), "bad", 1), "index.json")):
            assert time.monotonic() < end, "a save filled by hand did not commit"
            time.sleep(0.05)


def test_a_copy_that_fails_mid_fill_drops_the_step_and_the_next_save_works(daemon_factory, monkeypatch):
    d = daemon_factory()
    ck = ckptd_client.Checkpointer("broken", socket=str(d.socket), overlap=False)
    real = handoff.report

    def report(conn, step, upto):
        if step == 1:
            raise RuntimeError("device-to-host copy failed")     # as a CUDA error mid-copy would
        real(conn, step, upto)
    monkeypatch.setattr(handoff, "report", report)
    with pytest.raises(RuntimeError, match="device-to-host copy failed"):
        ck.save(1, big_state(1))
    end = time.monotonic() + 60
    while [w for w in status(d.socket)["saves"] if w["job"] == "broken"]:     # the daemon dropped it
        assert time.monotonic() < end, "the daemon went on waiting for a copy that failed"
        time.sleep(0.05)
    assert not os.path.exists(os.path.join(step_dir(str(d.root), "broken", 1), "index.json"))
    state = big_state(2)
    ck.save(2, state).wait(120)                   # its slot came back: the next save commits
    target = big_state(3)
    assert ck.restore(target) == 2
    assert all(torch.equal(v, target[k]) for k, v in state.items() if isinstance(v, torch.Tensor))
    ck.close()


def test_an_overlapped_save_is_written_while_its_copy_thread_fills_the_slot(daemon_factory, monkeypatch):
    """Parameters and AdamW state are copied on the copy thread after save() returns; it hands the
    slot over first and reports as it copies: the daemon has written bytes before the copy is done."""
    d = daemon_factory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    ck = ckptd_client.Checkpointer("overlap-fill", socket=str(d.socket))      # overlap=True, the default
    state = {"model": model, "optim": opt, "meta": {"step": 1}}
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seen = watch_first_mark(monkeypatch, ck, d.socket, "overlap-fill")
    h = ck.save(1, state)
    h.wait(120)
    assert seen and 0 < seen[0][1] <= seen[0][0], seen
    assert h.committed
    probe = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    probe_opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
    fresh = ckptd_client.Checkpointer("overlap-fill", socket=str(d.socket), memory=False)
    assert fresh.restore({"model": probe, "optim": probe_opt, "meta": {}}) == 1
    for k, v in probe.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for (p0, p1) in zip(opt.param_groups[0]["params"], probe_opt.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p0]["exp_avg_sq"], probe_opt.state[p1]["exp_avg_sq"])
    fresh.close()
    ck.close()
