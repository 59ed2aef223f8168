"""Strict restores, and restores that fail change nothing.

A restore is strict by default: an entry of the live state the step lacks (a top-level key, or a
tensor inside one) is an error naming every one and the fix (``strict=False``); with
``strict=False`` what the step has is restored and ``last_restore`` says what was not. A restore
that would fail — a layer of another shape, a layer the model lacks, an optimizer over other
parameters — raises naming every mismatch before anything is written: every byte of the live
state is what it was. Each case runs from the daemon's memory (the default) and from storage,
through a real daemon.
"""
from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch

import ckptd_client
from ckptd_client import CheckpointError, RNGState
from ckptd_client.sources import MEMORY, STORAGE

SOURCES = [pytest.param(True, id="memory"), pytest.param(False, id="storage")]


def net(widths: tuple[int, ...] = (16, 16, 16, 8), seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)])


def trained(widths: tuple[int, ...] = (16, 16, 16, 8)) -> tuple[torch.nn.Sequential, torch.optim.Adam]:
    m = net(widths, seed=1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, widths[0])).sum().backward()
    opt.step()
    return m, opt


def frozen(obj: Any) -> Any:
    """A comparable picture of ``obj``: every tensor as its dtype, shape and bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return ("T", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(obj, np.ndarray):
        return ("A", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, dict):
        return {k: frozen(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [frozen(v) for v in obj]
    return copy.deepcopy(obj)


def picture(state: dict[str, Any]) -> Any:
    """Every byte of a live state, RNG streams included (taken without drawing from them)."""
    out = {k: frozen(v.state_dict()) for k, v in state.items()}
    out["_rng"] = frozen((torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True)))
    return out


def checkpointer(daemon: Any, job: str, memory: bool) -> ckptd_client.Checkpointer:
    return ckptd_client.Checkpointer(job, socket=str(daemon.socket), memory=memory)


def full_state(widths: tuple[int, ...] = (16, 16, 16, 8)) -> dict[str, Any]:
    m = net(widths, seed=7)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, widths[0])).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return {"model": m, "optim": opt, "sched": sched, "rng": RNGState()}


# ---- entries the step does not have -----------------------------------------------------------------

@pytest.mark.parametrize("memory", SOURCES)
def test_strict_restore_names_every_missing_entry_and_changes_nothing(daemon: Any, memory: bool) -> None:
    saved, _ = trained()
    with checkpointer(daemon, "strict", True) as ck:
        ck.save(2, {"model": saved}).wait(60)
    state = full_state()
    before = picture(state)
    with checkpointer(daemon, "strict", memory) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(state)
    msg = str(e.value)
    assert "'optim', 'sched', 'rng'" in msg and "pass strict=False to restore only what the step has" in msg, msg
    assert "step 2" in msg and ("memory" in msg) == memory, msg
    assert picture(state) == before


@pytest.mark.parametrize("memory", SOURCES)
def test_lenient_restore_loads_what_the_step_has_and_says_what_it_lacked(daemon: Any, memory: bool) -> None:
    saved, _ = trained()
    with checkpointer(daemon, "lenient", True) as ck:
        ck.save(2, {"model": saved}).wait(60)
    state = full_state()
    before = picture(state)
    with checkpointer(daemon, "lenient", memory) as ck:
        assert ck.restore(state, strict=False) == 2
        info = ck.last_restore
    assert info is not None and info.source == (MEMORY if memory else STORAGE)
    assert info.restored == ("model",) and info.missing == ("optim", "sched", "rng") and info.missing_tensors == ()
    assert frozen(state["model"].state_dict()) == frozen(saved.state_dict())
    after = picture(state)
    assert {k: after[k] for k in ("optim", "sched", "_rng")} == {k: before[k] for k in ("optim", "sched", "_rng")}


@pytest.mark.parametrize("memory", SOURCES)
def test_missing_tensors_are_listed_bounded_and_lenient_leaves_them(daemon: Any, memory: bool) -> None:
    g = torch.Generator().manual_seed(3)
    saved = {f"t{i:02d}": torch.randn(64, generator=g) for i in range(3)}
    with checkpointer(daemon, "tensors", True) as ck:
        ck.save(4, {"w": saved, "meta": {"epoch": 1}}).wait(60)

    def live() -> dict[str, Any]:
        return {"w": {f"t{i:02d}": torch.zeros(64) for i in range(20)}, "meta": {}}

    state = live()
    with checkpointer(daemon, "tensors", memory) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(state)
        msg = str(e.value)
        assert "'w/t03', 'w/t04'" in msg and "'w/t10' and 9 more" in msg and "strict=False" in msg, msg
        assert "'w/t11'" not in msg and all(torch.count_nonzero(t) == 0 for t in state["w"].values())
        state = live()
        assert ck.restore(state, strict=False) == 4
        info = ck.last_restore
    assert info is not None and info.restored == ("w", "meta") and info.missing == ()
    assert info.missing_tensors == tuple(f"w/t{i:02d}" for i in range(3, 20))
    assert all(torch.equal(state["w"][k], v) for k, v in saved.items()) and state["meta"] == {"epoch": 1}
    assert all(torch.count_nonzero(state["w"][f"t{i:02d}"]) == 0 for i in range(3, 20))


# ---- a model or optimizer that does not match changes nothing ---------------------------------------

@pytest.mark.parametrize("memory", SOURCES)
@pytest.mark.parametrize("widths, named", [
    pytest.param((16, 16, 16, 4), ["'model/2.weight': the checkpoint's shape is [8, 16], the state's [4, 16]",
                                   "'model/2.bias': the checkpoint's shape is [8], the state's [4]"], id="reshaped"),
    pytest.param((16, 16, 16), ["'model/2.weight', 'model/2.bias'", "not in the state's module 'model'",
                                "param groups of [6] parameters, the state's [4]"], id="one-layer-fewer"),
])
def test_a_model_of_another_shape_raises_before_anything_is_written(daemon: Any, memory: bool,
                                                                   widths: tuple[int, ...], named: list[str]) -> None:
    saved, opt = trained()
    with checkpointer(daemon, "shapes", True) as ck:
        ck.save(2, {"model": saved, "optim": opt}).wait(60)
    m = net(widths, seed=5)
    state = {"model": m, "optim": torch.optim.Adam(m.parameters(), lr=1e-3)}
    before = picture(state)
    with checkpointer(daemon, "shapes", memory) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(state)
    msg = str(e.value)
    assert all(n in msg for n in named) and "nothing in the state was changed" in msg, msg
    assert ("memory" in msg) == memory, msg
    assert picture(state) == before


@pytest.mark.parametrize("memory", SOURCES)
def test_an_optimizer_over_other_parameters_raises_before_the_model_is_loaded(daemon: Any, memory: bool) -> None:
    saved, opt = trained()
    with checkpointer(daemon, "optim", True) as ck:
        ck.save(2, {"model": saved, "optim": opt}).wait(60)
    m = net(seed=5)
    state = {"model": m, "optim": torch.optim.Adam(list(m.parameters())[:4], lr=1e-3)}
    before = picture(state)
    with checkpointer(daemon, "optim", memory) as ck:
        with pytest.raises(CheckpointError, match=r"'optim': the checkpoint has param groups of \[6\] parameters, "
                                                  r"the state's \[4\]"):
            ck.restore(state)
    assert picture(state) == before
    state["optim"] = torch.optim.Adam(m.parameters(), lr=1e-3)
    with checkpointer(daemon, "optim", memory) as ck:       # the same step restores into a matching state
        assert ck.restore(state) == 2 and ck.last_restore is not None
        assert ck.last_restore.source == (MEMORY if memory else STORAGE)
    assert frozen(m.state_dict()) == frozen(saved.state_dict())


@pytest.mark.parametrize("memory", SOURCES)
def test_a_tensor_that_cannot_be_written_into_raises_before_anything_is_written(daemon: Any, memory: bool) -> None:
    """A model still on the meta device (built under torch.device("meta"), not yet to_empty()) has no
    memory: copies into it do nothing, and a restore would report it restored. A tensor from expand()
    has elements sharing memory: a copy into it raises, after the rest was written. Both are named
    before anything is read; the state is left as it was."""
    saved, _ = trained()
    w = torch.arange(12.0)
    with checkpointer(daemon, "unwritable", True) as ck:
        ck.save(2, {"model": saved, "w": w, "e": torch.arange(3.0)}).wait(60)
    with torch.device("meta"):
        meta_model = net(seed=5)
    other_w = torch.zeros(12)
    state: dict[str, Any] = {"model": meta_model, "w": other_w, "e": torch.full((1,), 5.0).expand(3)}
    with checkpointer(daemon, "unwritable", memory) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(state)
    msg = str(e.value)
    assert "tensor 'model/0.weight' is on the meta device: materialize the state first" in msg, msg
    assert "tensor 'e' has elements that share memory" in msg and "nothing in the state was changed" in msg, msg
    assert ("daemon's memory" in msg) == memory, msg
    assert torch.equal(other_w, torch.zeros(12)) and torch.equal(state["e"], torch.full((3,), 5.0))
    meta_model.to_empty(device="cpu")            # the fixes the error names: then the same step restores
    state["e"] = state["e"].clone()
    with checkpointer(daemon, "unwritable", memory) as ck:
        assert ck.restore(state) == 2
    assert frozen(meta_model.state_dict()) == frozen(saved.state_dict())
    assert torch.equal(other_w, w) and torch.equal(state["e"], torch.arange(3.0))


@pytest.mark.parametrize("memory", SOURCES)
def test_a_tensor_where_the_step_holds_a_value_raises_before_anything_is_written(daemon: Any,
                                                                                  memory: bool) -> None:
    """The step holds a plain value (or a container) where the live state has a tensor. strict=False
    took the tensor for one the step lacks, wrote the rest of the state, then raised on it: part old,
    part new. Now every such entry is named before anything is written, strict or not; a live value
    where the step has a value still just takes the step's."""
    saved: dict[str, Any] = {"a": torch.arange(4.0) + 1, "b": {"x": 5, "y": torch.ones(2), "z": {"deep": [1, 2]}},
             "c": [torch.ones(3), 7], "pos": 3}
    with checkpointer(daemon, "clash", True) as ck:
        ck.save(1, saved).wait(60)

    def live() -> dict[str, Any]:
        return {"a": torch.zeros(4), "b": {"x": torch.zeros(3), "y": torch.zeros(2), "z": torch.zeros(1)},
                "c": [torch.zeros(3), 0], "pos": torch.zeros(1), "extra": torch.zeros(2)}
    for strict in (True, False):
        state = live()
        before = frozen(state)
        with checkpointer(daemon, "clash", memory) as ck:
            with pytest.raises(CheckpointError) as e:
                ck.restore(state, strict=strict)
        msg = str(e.value)
        assert "nothing in the state was changed" in msg and frozen(state) == before, msg
        if not strict:
            assert "tensor 'b/x' of the state is an int in the checkpoint" in msg, msg
            assert "tensor 'b/z' of the state is a dict in the checkpoint" in msg, msg
            assert "tensor 'pos' of the state is an int in the checkpoint" in msg, msg
            assert "'extra'" not in msg and "'c/1'" not in msg, msg          # lacked, and a value: both fine
    state = live()
    del state["b"]["x"], state["b"]["z"], state["pos"]
    with checkpointer(daemon, "clash", memory) as ck:
        assert ck.restore(state, strict=False) == 1
        assert ck.last_restore is not None and ck.last_restore.missing == ("extra",)
    assert torch.equal(state["a"], saved["a"]) and torch.equal(state["b"]["y"], torch.ones(2))
    assert state["c"][1] == 7 and torch.equal(state["extra"], torch.zeros(2))


@pytest.mark.parametrize("memory", SOURCES)
def test_numpy_values_come_back_as_numpy_into_the_same_arrays(daemon: Any, memory: bool) -> None:
    """NumPy arrays are saved as tensors and NumPy scalars as their Python value: a restore puts them
    back as NumPy, each array into the live array itself (a strided one too), each scalar as its type."""
    saved = {"arr": np.arange(6, dtype=np.float32).reshape(2, 3), "wide": np.arange(12.0).reshape(3, 4)[:, ::2],
             "f32": np.float32(1.1), "i64": np.int64(-7), "flag": np.bool_(True), "ints": np.arange(5, dtype=np.int16)}
    with checkpointer(daemon, "numpy", True) as ck:
        ck.save(2, {"data": dict(saved)}).wait(60)
    live = {"arr": np.zeros((2, 3), np.float32), "wide": np.zeros((3, 4))[:, ::2], "f32": np.float32(0),
            "i64": np.int64(0), "flag": np.bool_(False), "ints": np.zeros(5, np.int16)}
    arrays = {k: v for k, v in live.items() if isinstance(v, np.ndarray)}
    state = {"data": live}
    with checkpointer(daemon, "numpy", memory) as ck:
        assert ck.restore(state) == 2
    for k, v in saved.items():
        got = state["data"][k]
        assert type(got) is type(v), (k, type(got))
        assert np.array_equal(got, v) and (not isinstance(v, np.ndarray) or got.dtype == v.dtype), k
        if k in arrays:
            assert got is arrays[k], k                    # the live array itself, written in place
    assert state["data"]["f32"] == np.float32(1.1)         # (not 1.1 as a float64)
