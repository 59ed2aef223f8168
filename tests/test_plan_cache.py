"""The plan cache: reused while the state's structure holds, never past a change of it.

Each change test saves twice through a real daemon with one change in between (a new
parameter, a reshaped, re-typed or re-strided tensor over the same bytes, optimizer state that
appears after the first step, a tensor replaced, scalars whose type or sign changed), restores
the second step into a fresh copy of the state and compares every byte and every scalar. A
cache keyed on less than the structure saves the second step with the first one's layout or
tree, and the comparison fails.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptd_client
from ckptd_client.plan_cache import PlanCache


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


def as_bytes(obj: Any) -> Any:
    """Every tensor of a state as (dtype, shape, its bytes); scalars with their type (and sign)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().resolve_conj().resolve_neg().contiguous()
        return (str(t.dtype), tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()))
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return as_bytes(obj.state_dict())
    if isinstance(obj, dict):
        return {k: as_bytes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_bytes(v) for v in obj)
    return (type(obj).__name__, repr(obj))


def fresh_like(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` to restore into, every tensor scrambled (and the optimizer rebuilt over
    the copied model: deepcopy keeps its parameter references consistent)."""
    out = copy.deepcopy(state)
    with torch.no_grad():
        for t in _tensors(out):
            if t.is_contiguous() and not t.is_conj():
                t.reshape(-1).view(torch.uint8).fill_(0x5A)
            else:
                t.fill_(7)
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return _tensors(obj.state_dict())
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def save_change_restore(daemon: Any, state: dict[str, Any], change: Callable[[dict[str, Any]], None],
                        overlap: bool | str = True) -> tuple[ckptd_client.Checkpointer, dict[str, Any]]:
    """Save ``state``, change it, save again; restore step 2 into a fresh copy and compare."""
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    ck.save(1, state, overlap=overlap).wait(60)
    change(state)
    ck.save(2, state, overlap=overlap).wait(60)
    expected = as_bytes(state)
    target = fresh_like(state)
    assert ck.restore(target, step=2) == 2
    assert as_bytes(target) == expected
    return ck, target


def test_same_structure_reuses_the_plan(daemon):
    model, opt = model_and_optimizer()
    train_step(model, opt)
    loop = {"step": 1, "lr": 0.5}
    state = {"model": model, "optim": opt, "loop": loop}
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    for step in range(1, 5):
        ck.save(step, state).wait(60)
        train_step(model, opt)
        loop["step"] += 1               # a scalar changes every save: the tree, not the plan
    assert (ck.plans.misses, ck.plans.hits) == (1, 3)
    expected = as_bytes(state)
    ck.save(5, state).wait(60)
    target = fresh_like(state)
    ck.restore(target, step=5)
    assert as_bytes(target) == expected
    ck.close()


def test_restore_plans_the_first_save_and_its_copy(daemon):
    """After restore() the first save neither plans nor works out its copy's split per tensor again
    (the state's structure and tensors are what restore left): restore did both."""
    model, opt = model_and_optimizer()
    train_step(model, opt)
    state = {"model": model, "optim": opt}
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    ck.save(1, state).wait(60)
    target = fresh_like(state)
    fresh = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    assert fresh.restore(target, step=1) == 1
    assert (fresh.plans.misses, fresh.plans.hits) == (1, 0)
    warmed = fresh.plans.plan(target)
    assert len(warmed.splits) == 1
    (deferred, split), = warmed.splits.items()
    assert deferred == warmed.flat.deferrable and deferred      # AdamW's tensors: fenced by its step
    fresh.save(2, target).wait(60)
    assert fresh.plans.misses == 1 and warmed.splits == {deferred: split}   # the same split object, reused
    assert as_bytes(target) == as_bytes(state)
    ck.close()
    fresh.close()


def test_new_parameter_invalidates(daemon):
    model, opt = model_and_optimizer()
    state: dict[str, Any] = {"model": model, "optim": opt}

    def add(s: dict[str, Any]) -> None:
        s["model"].register_parameter("extra", torch.nn.Parameter(torch.arange(5.0)))
    ck, _ = save_change_restore(daemon, state, add)
    assert ck.plans.hits == 0
    ck.close()


def test_optimizer_state_appearing_after_the_first_step_invalidates(daemon):
    model, opt = model_and_optimizer()
    state = {"model": model, "optim": opt}
    ck, target = save_change_restore(daemon, state, lambda s: train_step(s["model"], s["optim"]))
    assert len(target["optim"].state) == len(list(target["model"].parameters()))   # restored, every one
    ck.close()


@pytest.mark.parametrize("overlap", [True, False, "manual"])
def test_reshaped_tensor_over_the_same_bytes_invalidates(daemon, overlap):
    state: dict[str, Any] = {"w": torch.arange(12.0), "b": torch.arange(3, dtype=torch.int64)}

    def reshape(s: dict[str, Any]) -> None:
        s["w"].data = s["w"].data.view(3, 4)     # same address, same bytes, another shape
    ck, target = save_change_restore(daemon, state, reshape, overlap)
    assert target["w"].shape == (3, 4)
    ck.close()


def test_dtype_change_over_the_same_bytes_invalidates(daemon):
    state: dict[str, Any] = {"w": torch.arange(8.0)}

    def retype(s: dict[str, Any]) -> None:
        s["w"].data = s["w"].data.view(torch.int32)
    ck, target = save_change_restore(daemon, state, retype)
    assert target["w"].dtype == torch.int32
    ck.close()


def test_stride_change_over_the_same_bytes_invalidates(daemon):
    """A module's state_dict() hands out new tensor objects each save: the cache must not reuse
    the old ones' strides for a parameter transposed in place."""
    model = torch.nn.Linear(4, 4, bias=False)
    state: dict[str, Any] = {"model": model}

    def transpose(s: dict[str, Any]) -> None:
        w = s["model"].weight
        w.data = w.data.t()                      # same address, shape, dtype: other values per index
    ck, _ = save_change_restore(daemon, state, transpose)
    ck.close()


def test_lazy_conjugate_over_the_same_bytes_invalidates(daemon):
    """conj() of a complex tensor is a flag on a view of the same bytes: saved resolved."""
    model = torch.nn.Module()
    model.z = torch.nn.Parameter(torch.randn(6, dtype=torch.complex64))
    state: dict[str, Any] = {"model": model}

    def conjugate(s: dict[str, Any]) -> None:
        z = s["model"].z
        z.data = z.data.conj()
    ck, target = save_change_restore(daemon, state, conjugate)
    assert torch.equal(target["model"].z.detach(), model.z.detach().resolve_conj())
    ck.close()


def test_reshaped_parameter_invalidates(daemon):
    model = torch.nn.Linear(6, 2, bias=False)
    state: dict[str, Any] = {"model": model}

    def reshape(s: dict[str, Any]) -> None:
        w = s["model"].weight
        w.data = w.data.view(3, 4)
    ck, target = save_change_restore(daemon, state, reshape)
    assert target["model"].weight.shape == (3, 4)
    ck.close()


def test_replaced_tensor_and_changed_device_free_shape_invalidate(daemon):
    state: dict[str, Any] = {"a": torch.zeros(6), "nested": [{"x": torch.ones(2, 3)}]}

    def replace(s: dict[str, Any]) -> None:
        s["a"] = torch.full((6,), 3.0)
        s["nested"][0]["x"] = torch.arange(6.0).reshape(3, 2)
    ck, _ = save_change_restore(daemon, state, replace)
    ck.close()


def test_scalars_keep_type_and_sign(daemon):
    state: dict[str, Any] = {"w": torch.ones(3), "s": {"a": 1, "b": 0.0, "c": [1, 2]}}

    def change(s: dict[str, Any]) -> None:
        s["s"]["b"] = -0.0                           # == 0.0, yet saved as it is
    ck, target = save_change_restore(daemon, state, change)
    assert str(target["s"]["b"]) == "-0.0" and target["s"] == {"a": 1, "b": 0.0, "c": [1, 2]}
    ck.close()


@pytest.mark.parametrize(("old", "new"), [(1, True), (0.0, -0.0), (2.0, 2), (1, 1.0), (None, "x"), (3, 4)])
def test_a_scalar_equal_in_python_is_not_equal_in_the_tree(old, new):
    """One scalar changes and nothing else: the tree must hold the new one, type and sign."""
    cache = PlanCache()
    state: dict[str, Any] = {"w": torch.ones(3), "s": {"x": old, "y": [5, 6]}}
    cache.plan(state)
    state["s"]["x"] = new
    got = cache.plan(state).flat.tree["d"][1][1]["d"][0][1]
    assert type(got) is type(new) and repr(got) == repr(new)


@pytest.mark.parametrize(("old", "new"), [(1, True), (0.0, -0.0), (2.0, 2), (1, 1.0), (None, "x"), (3, 4)])
@pytest.mark.parametrize("container", [list, tuple])
def test_a_scalar_in_a_sequence_of_leaves_keeps_its_type_in_the_tree(old, new, container):
    """A list or tuple of leaves only (an optimizer's param group of FQNs) is walked in one step:
    one of its scalars changing to one equal in Python must still give the tree the new one."""
    cache = PlanCache()
    state: dict[str, Any] = {"w": torch.ones(3), "s": container([5, old, "z"]), "n": [[1, 2], (3, old)]}
    cache.plan(state)
    state["s"] = container([5, new, "z"])
    state["n"][1] = (3, new)
    got = cache.plan(state).flat.tree
    assert repr(got) == repr(PlanCache().plan(state).flat.tree)
    assert repr(new) in repr(got["d"][1][1]) and repr(new) in repr(got["d"][2][1])


def test_changed_key_type_and_container_type_invalidate():
    """Keys 1 and 1.0 (or True) are equal in Python, not in the tree; a list is not a tuple."""
    cache = PlanCache()
    w = torch.zeros(2)
    cache.plan({"d": {1: w}})
    with pytest.raises(TypeError, match="keys must be str or int"):
        cache.plan({"d": {True: w}})
    cache.plan({"l": [w, 1]})
    plan = cache.plan({"l": (w, 1)})
    assert plan.flat.tree == {"d": [["l", {"t": [{"T": "l/0"}, 1]}]]}
    assert (cache.hits, cache.misses) == (0, 4)


def test_fence_on_optimizer_parameters_are_part_of_the_structure():
    """Which tensors an overlapped save defers depends on the fence_on optimizers' parameters."""
    w, other = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)
    cache = PlanCache()
    state = {"w": w.detach(), "v": other.detach()}
    assert cache.plan(state, [opt]).flat.deferrable == {0}
    opt.param_groups[0]["params"] = [other]
    assert cache.plan(state, [opt]).flat.deferrable == {1}
    assert cache.hits == 0


def test_first_save_after_restore_reuses_the_plan_restore_made(daemon):
    """A resumed run: a fresh model and optimizer (no state yet), restored, then saved. Restore
    plans the state it loaded, so that first save does not pay the full walk."""
    model, opt = model_and_optimizer()
    train_step(model, opt)
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    ck.save(1, {"model": model, "optim": opt}).wait(60)
    ck.close()

    model2, opt2 = model_and_optimizer(seed=1)
    state = {"model": model2, "optim": opt2}
    ck2 = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    assert ck2.restore(state) == 1
    misses = ck2.plans.misses
    ck2.save(2, state).wait(60)
    assert ck2.plans.misses == misses and ck2.plans.hits == 1
    expected = as_bytes(state)
    assert expected == as_bytes({"model": model, "optim": opt})
    target = fresh_like(state)
    ck2.restore(target, step=2)
    assert as_bytes(target) == expected
    ck2.close()


def test_close_lets_go_of_the_planned_state(daemon):
    """The cache holds the last planned state's tensors; close() drops them."""
    import weakref
    state: dict[str, Any] = {"w": torch.arange(10.0)}
    ref = weakref.ref(state["w"])
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    ck.save(1, state).wait(60)
    ck.close()
    del state
    assert ref() is None


def _in_place(kind: str) -> Callable[[dict[str, Any]], None]:
    """A change of the model's weight over the same bytes: the address (all the trainer's thread
    compares for a deferred tensor) stays, the key does not."""
    def change(s: dict[str, Any]) -> None:
        w = s["model"].weight
        w.data = {"transpose": lambda d: d.t(), "reshape": lambda d: d.view(2, 8),
                  "retype": lambda d: d.view(torch.bfloat16), "negate": lambda d: d._neg_view()}[kind](w.data)
    return change


@pytest.mark.parametrize("overlap", [True, "manual"])
@pytest.mark.parametrize("kind", ["transpose", "reshape", "retype", "negate"])
def test_deferred_tensor_changed_over_its_bytes_is_laid_out_on_the_copy_thread(daemon, overlap, kind):
    """With an optimizer the weight is copied on the copy thread, and only its address is compared on
    the trainer's: the copy thread finds the changed key, lays the slot out anew (the buffer copied
    at save() moved with it) and the daemon gets that layout. A third save reuses the new plan."""
    model = torch.nn.Sequential()
    model.weight = torch.nn.Parameter(torch.arange(16.0).reshape(4, 4))
    count = torch.arange(3, dtype=torch.int64)
    model.register_buffer("count", count)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": model, "optim": opt, "loop": {"step": 1}}
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    ck.save(1, state, overlap=overlap).wait(60)
    _in_place(kind)(state)
    expected = {2: as_bytes(state)}
    ck.save(2, state, overlap=overlap).wait(60)
    assert (ck.plans.misses, ck.plans.hits) == (1, 1)            # a hit, its weight's key checked lazily
    count.add_(5)                        # a buffer: copied at save(), moved with the layout
    state["loop"]["step"] = 3
    expected[3] = as_bytes(state)
    ck.save(3, state, overlap=overlap).wait(60)
    assert (ck.plans.misses, ck.plans.hits) == (1, 2)            # the plan the copy thread made, reused
    ck.close()
    reader = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    for step in (2, 3):
        target = fresh_like(state)
        assert reader.restore(target, step=step) == step
        assert as_bytes(target) == expected[step]
    reader.close()


def test_deferred_tensor_grown_over_its_bytes_fails_that_save_only(daemon):
    """A parameter widened in place over a larger storage than the slot holds: the copy thread finds
    it, that save fails saying why (the trainer's fence does not raise), and the next save is whole."""
    base = torch.arange(float(1 << 22))
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(base[:8])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state: dict[str, Any] = {"model": model, "optim": opt}
    ck = ckptd_client.Checkpointer("pc", socket=str(daemon.socket), commit="local")
    ck.save(1, state).wait(60)
    slot = min(s.size for s in ck.slots)
    assert slot < base.numel()
    model.w.data = base[: slot // 4 + 16]         # the same address, more bytes than a slot holds
    h = ck.save(2, state)
    ck.fence()
    with pytest.raises(ckptd_client.CheckpointError, match="more than the slot"):
        h.wait(60)
    assert not (daemon.root / "pc" / "step-000000000002").exists()
    expected = as_bytes(state)
    ck.save(3, state).wait(60)
    target = fresh_like(state)
    assert ck.restore(target, step=3) == 3
    assert as_bytes(target) == expected
    ck.close()
