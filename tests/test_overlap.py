"""Overlapped snapshots never capture a value the next optimizer step mutates; busy-slot policies."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import ckptd_client
from ckptd_client import CheckpointError

pytestmark = pytest.mark.usefixtures("ctrl_c_raises")    # (conftest.py: a real SIGINT raises)


def make_training(width: int = 256):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, width)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step()  # optimizer state exists
    return model, opt, step


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        out.update({f"o/{pid}/{k}": v.clone() for k, v in st.items()})
    return out


def restored(ck, model_like, opt_like) -> dict[str, torch.Tensor]:
    ck.restore({"model": model_like, "optim": opt_like})
    return snapshot(model_like, opt_like)


def test_overlapped_save_fenced_by_optimizer_hook(daemon):
    model, opt, step = make_training()
    ck = ckptd_client.Checkpointer("overlap", socket=str(daemon.socket))
    ck.prepare({"model": model, "optim": opt})
    # Hold the copy thread so the background copy is certainly still pending when step() runs;
    # only the optimizer pre-hook's fence can then keep step() from mutating what is copied.
    gate = threading.Event()
    ck._copies.pool().submit(gate.wait)
    before = snapshot(model, opt)
    handle = ck.save(1, {"model": model, "optim": opt}, overlap=True)
    assert not handle.done()
    threading.Timer(0.3, gate.set).start()
    step()                                    # fences, then mutates
    after = snapshot(model, opt)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    handle.wait(60)
    assert handle.fence_s > 0

    model2, opt2, _ = make_training()
    got = restored(ck, model2, opt2)
    for k in before:
        assert torch.equal(got[k], before[k]), f"{k} captured a value mutated after save()"
    ck.close()


def test_overlapped_loop_matches_blocking(daemon):
    """A plain loop with overlap=True saves exactly what a blocking save of the same states saves."""
    model, opt, step = make_training()
    ck = ckptd_client.Checkpointer("loop", socket=str(daemon.socket), overlap=True)
    expected = {}
    handles = []
    for i in range(1, 6):
        expected[i] = snapshot(model, opt)
        handles.append(ck.save(i, {"model": model, "optim": opt}))
        step()
    for h in handles:
        h.wait(60)
        assert h.committed
    for i in range(1, 6):
        model2, opt2, _ = make_training()
        ck.restore({"model": model2, "optim": opt2}, step=i)
        got = snapshot(model2, opt2)
        for k in expected[i]:
            assert torch.equal(got[k], expected[i][k]), f"step {i}: {k}"
    ck.close()


def test_busy_policies(daemon_factory):
    d = daemon_factory("--debug-write-delay", "0.5")
    state = {"w": torch.randn(1000)}
    ck = ckptd_client.Checkpointer("busy", socket=str(d.socket), num_slots=1, when_busy="skip")
    first = ck.save(1, state)
    skipped = ck.save(2, state)              # the only slot is still being written
    assert skipped.skipped and skipped.done() and not skipped.committed
    with pytest.raises(CheckpointError, match=r"step 2 was skipped: every slot was busy"):
        skipped.wait(1)                      # nothing was saved: wait() never says committed for it
    first.wait(60)
    blocked = ck.save(3, state, when_busy="block")   # waits for the slot instead
    assert not blocked.skipped
    blocked.wait(60)
    assert blocked.committed
    assert not (d.root / "busy" / "step-000000000002").exists()
    with pytest.raises(ValueError, match="when_busy"):
        ck.save(4, state, when_busy="drop")
    ck.close()


def test_overlap_without_optimizer_in_state_copies_at_once(daemon):
    """Parameters whose optimizer is not in the state cannot be fenced: they are copied in save()."""
    model, opt, step = make_training()
    ck = ckptd_client.Checkpointer("noopt", socket=str(daemon.socket))
    gate = threading.Event()
    ck._copies.pool().submit(gate.wait)                # a background copy would be stuck behind this
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ck.save(1, {"model": model}, overlap=True)
    step()                                        # the optimizer (not in state) mutates at once
    gate.set()
    handle.wait(60)
    probe, _, _ = make_training()
    ck.restore({"model": probe})
    for k, v in probe.state_dict().items():
        assert torch.equal(v, before[k]), k
    ck.close()


def test_the_copy_thread_is_batch_work(daemon):
    """The copy thread runs as SCHED_BATCH: woken by save(), it does not preempt the trainer's thread that
    woke it (on a 2-core VM with four ranks that preemption was most of a save's 2 ms stall)."""
    model, opt, step = make_training()
    before = set(threading.enumerate())          # (another test's Checkpointer may not be collected yet)
    ck = ckptd_client.Checkpointer("batch", socket=str(daemon.socket))
    handle = ck.save(1, {"model": model, "optim": opt}, overlap=True)
    step()
    handle.wait(60)
    copy = [t for t in set(threading.enumerate()) - before if t.name.startswith("ckptd-client-copy")]
    assert len(copy) == 1 and copy[0].native_id is not None
    assert os.sched_getscheduler(copy[0].native_id) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER            # the trainer's own thread is left as it was
    ck.close()


def test_a_new_optimizer_at_a_freed_ones_address_still_fences_the_copy(daemon):
    """A loop that builds a new optimizer per phase: CPython often gives the new one the freed one's
    address. Its step() must still wait for the save's copy (a hook per optimizer object, not per
    id): each step's restored weight is the value at save(), never one the step wrote mid-copy."""
    w = torch.nn.Parameter(torch.zeros(4 << 20))          # 16 MiB: a copy the step could overtake
    seen: set[int] = set()
    reused = []
    with ckptd_client.Checkpointer("phases", socket=str(daemon.socket), overlap=True) as ck:
        for phase in range(1, 31):
            opt = torch.optim.SGD([w], lr=1.0)
            with torch.no_grad():
                w.fill_(100.0 * phase)
            w.grad = torch.ones_like(w)
            h = ck.save(phase, {"w": w, "optim": opt})
            opt.step()                                  # its hook waits for the copy first
            h.wait(60)
            if id(opt) in seen:
                reused.append(phase)
                got = torch.empty_like(w)
                ck.restore({"w": got, "optim": torch.optim.SGD([torch.nn.Parameter(torch.empty(4 << 20))])}, phase)
                assert torch.equal(got, torch.full_like(w, 100.0 * phase)), phase
            seen.add(id(opt))
            del opt
    assert reused, "no optimizer got a freed one's address: the case is not exercised"


def test_a_fence_interrupted_by_ctrl_c_still_holds_the_next_step(daemon):
    """A SIGINT (Ctrl-C, a notebook's interrupt) lands while the optimizer's pre-hook waits for an
    overlapped copy; the KeyboardInterrupt is caught and the user runs the step again. The interrupted
    fence had forgotten the copy, so the second step changed parameters the copy had still to read: a
    committed step holding values from after save(). The copy stays unfenced until its wait returns."""
    import sys
    import time

    model, opt, step = make_training(width=4096)      # ~200 MiB of state: the copy outlasts the signal
    ck = ckptd_client.Checkpointer("intr", socket=str(daemon.socket))
    state = {"model": model, "optim": opt}
    ck.save(1, state).wait(60)                        # slots sized, the plan cached
    step()
    want = snapshot(model, opt)
    main = threading.main_thread().ident
    assert main is not None

    def in_fence() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "fence" and frame.f_code.co_filename.endswith("slots.py"):
                return True
            frame = frame.f_back
        return False

    seen: list[bool] = []

    def interrupt() -> None:
        deadline = time.monotonic() + 30
        while not in_fence() and time.monotonic() < deadline:
            time.sleep(0.0001)
        if in_fence():
            seen.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    h = ck.save(2, state)                             # overlapped: the copy runs on its thread ...
    killer = threading.Thread(target=interrupt)
    killer.start()
    with pytest.raises(KeyboardInterrupt):
        opt.step()                                    # ... and the step's pre-hook waits for it: SIGINT there
    killer.join(30)
    assert seen == [True]
    opt.step()                                        # run again: the hook must wait for the copy first
    h.wait(60)
    model2, opt2, _ = make_training(width=4096)
    reader = ckptd_client.Checkpointer("intr", root=str(daemon.root), memory=False, prepare=False)
    got = restored(reader, model2, opt2)
    reader.close()
    ck.close()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_an_ema_updated_when_the_scaler_skips_the_step_is_saved_as_it_was(daemon):
    """An AMP loop with an EMA model (AveragedModel) and overlapped saves: when the scaler skips the
    optimizer's step (inf grads, as an fp16 overflow gives), the step pre-hook, the only fence, never runs,
    and the EMA update after it wrote into parameters the copy thread was still copying: a committed step
    holding an EMA that never existed. Only what the fence guards (a fenced optimizer's parameters and
    state) is deferred now; an EMA's parameters are copied before save() returns."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    torch.manual_seed(0)
    width = 2048
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    state = {"model": model, "optim": opt, "scaler": scaler, "ema": ema}
    x = torch.randn(2, width)

    def train_step(overflow: bool) -> None:
        opt.zero_grad()
        loss = model(x).pow(2).mean() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)                  # skipped when the grads are not finite: no optimizer.step()
        scaler.update()
        ema.update_parameters(model)

    ck = ckptd_client.Checkpointer("ema", socket=str(daemon.socket))
    torn = []
    for rnd in range(1, 7):
        train_step(overflow=False)
        want = {k: v.clone() for k, v in ema.state_dict().items()}
        h = ck.save(rnd, state)
        train_step(overflow=True)
        h.wait(60)
        step_path = f"{ck.resolve_root()}/ema/step-{rnd:012d}"
        torn += [(rnd, k) for k, v in want.items()
                 if not torch.equal(ckptd_client.load_tensor(step_path, f"ema/{k}"), v)]
    ck.close()
    assert torn == []
