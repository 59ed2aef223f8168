"""A model's and optimizer's part of a plan-cache hit walked on the copy thread (plan_defer.py).

Each test saves through a real daemon, restores into a fresh copy and compares every byte. What
``save()`` saw must be what is saved: a buffer forward changes and a learning rate a scheduler
steps after ``save()`` returned (before the optimizer's step fences the copy) stay as they were
at ``save()``; a change the trainer's quick check cannot see fails that save, saying why, and
never saves other bytes.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from test_plan_cache import as_bytes, fresh_like

import ckptd_client


def snap(state: dict[str, Any]) -> Any:
    """Every byte and scalar of ``state``, its Stateful objects (the scheduler too) by their state dicts."""
    return as_bytes({k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for k, v in state.items()})


def job() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "loop": {"step": 0}}


def train(state: dict[str, Any], steps: int = 1) -> None:
    model, opt = state["model"], state["optim"]
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
        state["sched"].step()
        state["loop"]["step"] += 1


def checkpointer(daemon: Any) -> ckptd_client.Checkpointer:
    return ckptd_client.Checkpointer("pd", socket=str(daemon.socket), commit="local")


def restored(daemon: Any, state: dict[str, Any], step: int) -> Any:
    target = fresh_like(state)
    reader = checkpointer(daemon)
    assert reader.restore(target, step=step) == step
    reader.close()
    return snap(target)


def test_what_save_saw_is_saved_not_what_forward_and_the_scheduler_changed_after(daemon):
    state = job()
    train(state)
    ck = checkpointer(daemon)
    ck.save(1, state).wait(60)
    train(state)
    h = ck.save(2, state)
    assert ck.plans.spliced == 1            # the model and optimizer were not walked on this thread
    expected = snap(state)
    model = state["model"]
    model(torch.randn(16, 8))               # forward in train mode: BatchNorm's buffers change in place
    state["sched"].step()                   # a scheduler stepped before the optimizer: the lr changes
    assert snap(state) != expected
    state["optim"].step()                   # its pre-hook fences the copy first
    h.wait(60)
    ck.close()
    assert restored(daemon, state, 2) == expected


def test_a_buffer_registered_between_saves_is_saved(daemon):
    state = job()
    train(state)
    ck = checkpointer(daemon)
    ck.save(1, state).wait(60)
    state["model"][1].register_buffer("seen", torch.arange(4.0))     # torch's registration: seen
    ck.save(2, state).wait(60)
    assert (ck.plans.misses, ck.plans.spliced) == (2, 0)
    expected = snap(state)
    ck.close()
    got = restored(daemon, state, 2)
    assert got == expected and "1.seen" in got["model"]


def test_a_registration_that_leaves_the_state_as_it_was_splices_again_after_one_walk(daemon):
    state = job()
    ck = checkpointer(daemon)
    train(state)
    ck.save(1, state).wait(60)
    state["model"].add_module("head", torch.nn.Identity())     # a module, no state: the same plan
    for step in (2, 3):
        train(state)
        ck.save(step, state).wait(60)
    assert (ck.plans.misses, ck.plans.hits, ck.plans.spliced) == (1, 2, 1)
    expected = snap(state)
    ck.close()
    assert restored(daemon, state, 3) == expected


def test_a_parameter_moved_unseen_fails_that_save_and_stops_splicing(daemon, caplog):
    """``.data =`` re-points a parameter without any hook: the trainer's check cannot see it. The
    copy thread does; that save fails (no step on disk) rather than save other bytes, and the
    Checkpointer's later saves walk everything before save() returns."""
    state = job()
    train(state)
    ck = checkpointer(daemon)
    ck.save(1, state).wait(60)
    w = state["model"][0].weight
    w.data = w.data.clone() + 1
    h = ck.save(2, state)
    ck.fence()
    with pytest.raises(ckptd_client.CheckpointError, match=r"changed since the last save.*\.data"):
        h.wait(60)
    assert not (daemon.root / "pd" / "step-000000000002").exists()
    assert ck.plans.deferring is False
    assert "later saves walk the whole state" in caplog.text      # logged, not only on the handle
    train(state)
    ck.save(3, state).wait(60)
    train(state)
    ck.save(4, state).wait(60)
    assert (ck.plans.hits, ck.plans.spliced) == (2, 1)      # step 4: a hit, walked here
    expected = snap(state)
    ck.close()
    assert restored(daemon, state, 4) == expected


class Momentum(torch.optim.Optimizer):
    """SGD with momentum written the way many users write an optimizer: its state tensor rebound each step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                m = st.get("m")
                st["m"] = p.grad.clone() if m is None else 0.9 * m + p.grad
                p.add_(st["m"], alpha=-g["lr"])


def test_an_optimizer_that_rebinds_its_state_tensors_saves_every_step(daemon):
    """Every save of a model and a Momentum optimizer commits and restores to what save() saw (the
    overlapped copy reads the rebound tensors on the copy thread)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = Momentum(model.parameters())
    state: dict[str, Any] = {"model": model, "optim": opt}
    ck = checkpointer(daemon)
    snaps = {}
    for step in range(1, 5):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        ck.save(step, state).wait(60)
        snaps[step] = snap(state)
    assert ck.plans.spliced >= 2            # the later saves spliced the optimizer: the copy thread rechecked it
    ck.close()
    for step, want in snaps.items():
        assert restored(daemon, state, step) == want, step


def test_a_buffer_reassigned_under_its_name_is_read_anew(daemon):
    """A buffer set to a new tensor under its name (no registration counted): the trainer re-reads it
    by name, finds its key changed, and plans anew."""
    state = job()
    train(state)
    ck = checkpointer(daemon)
    ck.save(1, state).wait(60)
    bn = state["model"][1]
    bn.running_mean = torch.full((8,), 3.0)
    ck.save(2, state).wait(60)
    assert ck.plans.misses == 2
    expected = snap(state)
    ck.close()
    got = restored(daemon, state, 2)
    assert got == expected and got["model"]["1.running_mean"] == as_bytes(torch.full((8,), 3.0))


def test_an_optimizer_reloaded_between_saves_is_walked_and_its_save_commits(daemon):
    """``load_state_dict`` of a deep copy gives every parameter a new state dict and new tensors: the
    trainer's check sees the new dicts, so that save walks the optimizer (a miss) rather than splice it
    and fail on the copy thread; the save after it is spliced again."""
    import copy
    state = job()
    train(state)
    ck = checkpointer(daemon)
    ck.save(1, state).wait(60)
    opt = state["optim"]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(state)
    ck.save(2, state).wait(60)
    assert (ck.plans.misses, ck.plans.spliced, ck.plans.deferring) == (2, 0, True)
    expected = snap(state)
    train(state)
    ck.save(3, state).wait(60)
    assert ck.plans.spliced == 1
    ck.close()
    assert restored(daemon, state, 2) == expected
