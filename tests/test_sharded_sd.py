"""The sharded model's state dicts reused while unchanged (ckptd_client/sharded_sd.py): what a save
takes equals what ``get_model_state_dict`` / ``get_optimizer_state_dict`` return at that moment,
through training steps, an LR change, a new param group, an optimizer reloaded, a buffer added,
a buffer replaced or moved (``.data =``), a state-dict hook added and removed, a module added and
deleted, a shard re-pointed (``.data =``, ``_local_tensor =``) and a parameter set to None; reused
(not rebuilt) only when nothing of that changed, or only a shard moved (the dict holds the
parameter itself, which shows its shard where it now is). Two real gloo ranks on CPU, FSDP2 with a
persistent buffer beside the sharded parameters. And a DTensor whose local shard changes in place
over the same bytes (what only the copy thread's full key compare sees, plan_cache.Recheck): that
save fails saying why, the trainer's fence does not raise, and the next save plans anew and
restores bit-exact. And the FSDP2 optimizer's and model's walk spliced on the trainer's thread and
checked on the copy thread (plan_defer.py), and a shard moved between saves copied from where it
is."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import sharded_trainer as st

WORKER = r'''
import os
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptd_client.sharded_sd import StateDicts

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))
model[0].register_buffer("seen", torch.zeros(3))
for m in model:
    fully_shard(m, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW([*model[0].parameters(), *model[1].parameters()], lr=0.1)


def step():
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    with torch.no_grad():
        model[0].seen.add_(1)


def same(a, b, path=""):
    """Equal as a save sees them: keys and order, scalars, each tensor's bytes (a DTensor's local
    shard and placements) and where they live."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        if isinstance(a, DTensor):
            assert isinstance(b, DTensor) and a.placements == b.placements and a.shape == b.shape, path
            a, b = a.to_local(), b.to_local()
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), path
        assert a.data_ptr() == b.data_ptr() and torch.equal(a, b), path
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


memo = StateDicts()


def check(expect_model_reused, expect_optim_reused):
    before = memo.reused
    memo.begin(model)
    m = memo.model(model)
    o = memo.optimizer(model, opt, "optim")
    same(m, get_model_state_dict(model), "model")
    same(o, get_optimizer_state_dict(model, opt), "optim")
    assert memo.reused - before == expect_model_reused + expect_optim_reused, (memo.reused - before,
                                                                              expect_model_reused, expect_optim_reused)


step()
check(0, 0)                      # first: taken
step()
check(1, 1)                      # trained: the same objects, values changed in place
opt.param_groups[0]["lr"] = 0.025
check(1, 1)                      # the new LR is in the reused optimizer state dict
opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})
check(1, 0)                      # a new group: the optimizer's taken again
step()
check(1, 0)                      # the new group's parameters got state: taken again
check(1, 1)
opt.load_state_dict(opt.state_dict())
check(1, 0)                      # reloaded: new per-parameter state objects
model[1].register_buffer("extra", torch.ones(2))
check(0, 0)                      # a buffer added: the model (and the optimizer's FQNs) taken again
check(1, 1)
old = model[0].seen
model[0].seen = old.clone()      # a buffer replaced by another tensor
check(0, 0)
check(1, 1)
handle = model[1].register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)
check(0, 0)                      # a state-dict hook of the user's: taken every save
check(0, 0)
handle.remove()
check(0, 0)                      # the hook gone: taken once more, then reused
check(1, 1)
model.add_module("act", torch.nn.ReLU())
check(0, 0)                      # a module added (no state of its own): the tree changed, taken again
check(1, 1)
# What no registration hook reports, seen by the cheaper compare (sharded_sd._Frame):
assert memo.framed > 0
del model.act
check(0, 0)                      # a module deleted (delattr: no hook)
check(1, 1)
local = model[1].weight._local_tensor
local.data = local.data.clone()  # a shard's bytes moved to other memory (.data =: no hook)
check(1, 1)                      # reused: the dict holds the parameter itself, so it shows the new place
assert memo.model(model)["1.weight"] is model[1].weight
model[1].weight._local_tensor = model[1].weight._local_tensor.clone()    # re-pointed (as FSDP2's reset does)
check(1, 1)
model[0].seen.data = model[0].seen.data.clone()      # a buffer's bytes moved: its detached view would be stale
check(0, 0)
check(1, 1)
model[1].__dict__["_state_dict_hooks"][10**9] = lambda *a: None      # a hook, under a handle id never used
check(0, 0)
check(0, 0)
del model[1].__dict__["_state_dict_hooks"][10**9]
check(0, 0)
check(1, 1)
model.add_module("plain", torch.nn.Linear(2, 2))
check(0, 0)
check(1, 1)
model.plain.bias = None          # a parameter set to None (torch calls no registration hook for it)
check(0, 0)
check(1, 1)
print("WORKER OK", flush=True)
dist.destroy_process_group()
os._exit(0)
'''


DTENSOR_IN_PLACE = r'''
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptd_client

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
mesh = init_device_mesh("cpu", (1,))
w = torch.nn.Parameter(distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)]))
opt = torch.optim.SGD([w], lr=0.1)
state = {"w": w, "optim": opt}
ck = ckptd_client.Checkpointer("dt", socket=sys.argv[1], commit="local")
ck.save(1, state).wait(60)
local = w._local_tensor
local.data = local.data.t()                      # the same bytes, transposed: only the full key differs
h = ck.save(2, state)
ck.fence()                                       # the trainer's fence does not raise
try:
    h.wait(60)
    raise AssertionError("the save of a DTensor changed in place committed")
except ckptd_client.CheckpointError as e:
    assert "changed since the last save (its local shard" in str(e), e
want = w.to_local().clone()
ck.save(3, state).wait(60)
with torch.no_grad():
    w.to_local().zero_()
assert ck.restore(state, step=3) == 3
assert torch.equal(w.to_local(), want) and w.to_local().stride() == want.stride()
ck.close()
print("WORKER OK", flush=True)
dist.barrier()      # rank 0 hosts the store: nobody leaves while a rank still reads it
dist.destroy_process_group()
os._exit(0)
'''


# A worker's ``snap(model, opt)`` / ``equal``: every local shard's bytes and every scalar of a sharded
# model and its optimizer as saved, compared in order (its source needs torch, DTensor and the
# get_*_state_dict functions imported).
SNAP = r'''

def snap(model, opt):
    """Every local shard's bytes and every scalar of ``model`` and ``opt``, keyed as saved."""
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif isinstance(x, torch.Tensor):
            local = x.to_local() if isinstance(x, DTensor) else x
            out[path] = (local.dtype, tuple(local.shape), local.detach().clone())
        else:
            out[path] = x
    walk({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, "")
    return out


def equal(a, b):
    assert list(a) == list(b), (list(a), list(b))
    for k, x in a.items():
        y = b[k]
        if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], torch.Tensor):
            assert x[:2] == y[:2] and torch.equal(x[2], y[2]), k
        else:
            assert x == y, (k, x, y)
'''

# Two FSDP2 layers over the group's ranks (5 rows: uneven shards), AdamW, a training step, and ``snap`` /
# ``equal`` (SNAP).
FSDP2_TRAINER = r'''
import copy, os, sys
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptd_client

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))     # 5 rows: uneven shards
for m in model:
    fully_shard(m, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)


def train():
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()                      # its pre-hook fences an overlapped save's copy first


''' + SNAP


OPTIMIZER_SPLICED = FSDP2_TRAINER + r'''


def spliced_save(ck, step, state):
    """An overlapped save whose optimizer part is spliced; what it saw, restored bit-exact later."""
    h = ck.save(step, state)
    assert ck.plans.spliced == spliced_save.count + 1, (ck.plans.hits, ck.plans.misses, ck.plans.spliced)
    spliced_save.count += 1
    seen = snap(model, opt)
    train()                         # the optimizer's step changes every state tensor after the copy
    h.wait(60)
    return seen


def then_spliced(ck, h, state):
    """Save 2 (``h``, in flight) as save() saw it, then save 3 spliced; both restore bit-exact."""
    want2 = snap(model, opt)
    train()
    h.wait(60)
    train()
    want3 = spliced_save(ck, 3, state)
    for step, want in ((2, want2), (3, want3)):
        assert ck.restore(state, step=step) == step
        equal(snap(model, opt), want)
    ck.close()


spliced_save.count = 0
state = {"model": model, "optim": opt}
ck = ckptd_client.Checkpointer("fo", socket=sys.argv[1])
train()
ck.save(1, state).wait(60)
train()
want2 = spliced_save(ck, 2, state)

# An optimizer state tensor replaced, unseen by the trainer's quick check: the copy thread's
# compare finds it, that save fails (never other bytes), and later saves walk it here.
for s in opt.state.values():
    s["exp_avg"] = s["exp_avg"].clone()
h = ck.save(3, state)
ck.fence()
try:
    h.wait(60)
    raise AssertionError("a save whose optimizer state moved unseen committed")
except ckptd_client.CheckpointError as e:
    assert "changed since the last save" in str(e) and "moved to other memory" in str(e), e
assert ck.plans.deferring is False
train()
ck.save(4, state).wait(60)
want4 = snap(model, opt)
train()
ck.save(5, state).wait(60)
counts = (ck.plans.hits, ck.plans.misses, ck.plans.spliced)
assert counts == (3, 2, 2), counts       # 2 and 3 spliced (3 failed on the copy thread); 5 a hit walked here
assert ck.restore(state, step=2) == 2
equal(snap(model, opt), want2)
assert ck.restore(state, step=4) == 4
equal(snap(model, opt), want4)
ck.close()

# An optimizer reloaded between saves (load_state_dict of a deep copy: new per-parameter dicts and
# tensors): the trainer's check sees it, that save walks the optimizer here and commits (it is not
# spliced and then failed on the copy thread), and the next save is spliced again.
ck = ckptd_client.Checkpointer("fk", socket=sys.argv[1])
spliced_save.count = 0
train()
ck.save(1, state).wait(60)
opt.load_state_dict(copy.deepcopy(opt.state_dict()))
h = ck.save(2, state)
assert (ck.plans.spliced, ck.plans.deferring) == (0, True), (ck.plans.hits, ck.plans.misses, ck.plans.spliced)
then_spliced(ck, h, state)

# The model's state dict taken anew (a module added: its signature changed, its tensors did not):
# the optimizer's recorded FQNs are not spliced that save, whichever of the two the state holds
# first, and are again from the next.
for order in ("model-first", "optim-first"):
    state = {"model": model, "optim": opt} if order == "model-first" else {"optim": opt, "model": model}
    ck = ckptd_client.Checkpointer(f"fm-{order}", socket=sys.argv[1])
    spliced_save.count = 0
    train()
    ck.save(1, state).wait(60)
    model.add_module(f"act-{order}", torch.nn.ReLU())
    train()
    h = ck.save(2, state)
    assert (ck.plans.misses, ck.plans.hits, ck.plans.spliced) == (1, 1, 0), order
    then_spliced(ck, h, state)
print("WORKER OK", flush=True)
dist.destroy_process_group()
os._exit(0)
'''


SHARD_MOVED = FSDP2_TRAINER + r'''


state = {"model": model, "optim": opt}
ck = ckptd_client.Checkpointer("mv", socket=sys.argv[1])
train()
ck.save(1, state).wait(60)
train()
ck.save(2, state).wait(60)
assert ck.plans.spliced == 1, (ck.plans.hits, ck.plans.misses, ck.plans.spliced)
train()
# Two shards moved to other memory, as no registration hook reports: ``.data =`` on one local
# shard, the local shard itself replaced on another (what FSDP2's reset_sharded_param does); new
# values in the new memory only.
w, b = model[0].weight, model[1].bias
w._local_tensor.data = w._local_tensor.data.clone()
b._local_tensor = b._local_tensor.clone()
with torch.no_grad():
    w.to_local().add_(1.0)
    b.to_local().mul_(-3.0)
want3 = snap(model, opt)
misses = ck.plans.misses
h = ck.save(3, state)               # spliced: the copy thread finds the shards moved and copies them from there
assert (ck.plans.misses, ck.plans.spliced) == (misses, 2), (ck.plans.hits, ck.plans.misses, ck.plans.spliced)
train()                             # the optimizer's step changes every shard after the copy
h.wait(60)
want4 = snap(model, opt)
h = ck.save(4, state)               # and the next save's plan has them where they are now
assert (ck.plans.misses, ck.plans.spliced) == (misses, 3), (ck.plans.hits, ck.plans.misses, ck.plans.spliced)
train()
h.wait(60)
for step, want in ((3, want3), (4, want4)):
    assert ck.restore(state, step=step) == step
    equal(snap(model, opt), want)
ck.close()
print("WORKER OK", flush=True)
dist.barrier()      # rank 0 hosts the store: nobody leaves while a rank still reads it
dist.destroy_process_group()
os._exit(0)
'''


def run(script: Path, world: int, *args: str) -> None:
    """``world`` gloo ranks of ``script`` (sharded_trainer.run_group); each must print WORKER OK."""
    for r, out in enumerate(st.run_group(world, *args, script=script, timeout=180)):
        assert "WORKER OK" in out, f"rank {r}:\n{out[-4000:]}"


def test_reused_state_dicts_equal_fresh_ones(tmp: Path) -> None:
    script = tmp / "sd_worker.py"
    script.write_text(WORKER)
    run(script, 2)


def test_dtensor_changed_in_place_fails_that_save_only(tmp: Path, daemon: Any) -> None:
    script = tmp / "dt_worker.py"
    script.write_text(DTENSOR_IN_PLACE)
    run(script, 1, str(daemon.socket))
    assert not (daemon.root / "dt" / "step-000000000002").exists()


def test_fsdp2_optimizer_walk_spliced_and_checked_on_the_copy_thread(tmp: Path, daemon: Any) -> None:
    """Beside an FSDP2 model, the optimizer's part of a save is spliced from the last walk
    (plan_defer.py) and walked for real on the copy thread: what save() saw is what restores, on
    2 ranks with uneven shards; a state tensor replaced unseen fails that save only; an optimizer
    reloaded, or a model whose state dict is taken anew, is not spliced that save."""
    script = tmp / "fo_worker.py"
    script.write_text(OPTIMIZER_SPLICED)
    run(script, 2, str(daemon.socket))
    assert (daemon.root / "fo" / "step-000000000002").is_dir()
    assert not (daemon.root / "fo" / "step-000000000003").exists()
    assert (daemon.root / "fk" / "step-000000000002").is_dir()


def test_fsdp2_shard_moved_between_saves_is_copied_from_where_it_is(tmp: Path, daemon: Any) -> None:
    """A sharded model's local shard moved to other memory between saves (``.data =``, or the local
    tensor replaced, as FSDP2's reset_sharded_param does), unseen by the trainer's quick check: the
    save stays spliced, its copy takes the shard from its new memory (never the old bytes), it
    commits, and it and the next save restore bit-exact on 2 ranks with uneven shards."""
    script = tmp / "mv_worker.py"
    script.write_text(SHARD_MOVED)
    run(script, 2, str(daemon.socket))
    assert (daemon.root / "mv" / "step-000000000003").is_dir()
