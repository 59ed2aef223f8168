"""The model's ``set_model_state_dict`` at the end of a restore is skipped when the restore wrote every
tensor of ``get_model_state_dict`` in place (ckptd_client/fqn_load.py), and still made when a module
loads in a way of its own; the optimizer's ``set_optimizer_state_dict`` likewise (its param groups'
settings set directly), and still made for an optimizer with a load hook or state torch would cast.
Two real gloo ranks, FSDP2 with uneven shards and a persistent buffer, a fresh model and fresh AdamW
restored from storage and from the daemon's memory: bit-exact either way; a load hook of the user's
still runs; a BatchNorm module or a value that is not the live tensor is never skipped. And FSDP2 on a
one-rank mesh with AdamW, SGD with momentum or Adam with amsgrad, a fresh model and optimizer restored
from memory and from storage: the optimizer's state is created as torch creates it (DTensors: plain
tensors beside DTensor parameters made the next step raise), and the next step's loss is the saving
run's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from test_sharded_sd import SNAP, run

WORKER = r'''
import os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as tsd
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptd_client
from ckptd_client.fqn_load import loaded_in_place, optimizer_loaded_in_place

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def counting(name):
    """torch's own ``tsd.<name>``, each call counted in the list returned."""
    real, seen = getattr(tsd, name), []

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)
    setattr(tsd, name, counted)
    return seen


calls = counting("set_model_state_dict")
opt_calls = counting("set_optimizer_state_dict")


# Successive Checkpointers of one job agree on a run id through the job's store (run_scope.py). With
# nothing collective between them, rank 0 could run a whole Checkpointer ahead and rank 1 join that next
# run, whose restores agree on other keys: a training job's collectives keep its ranks in step, and so
# do this worker's barriers.


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))     # 5 rows: uneven shards
    model[0].register_buffer("seen", torch.full((3,), float(seed)))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


''' + SNAP + r'''


model, opt = build(0)
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
with torch.no_grad():
    model[0].seen.add_(5)
want = snap(model, opt)
ck = ckptd_client.Checkpointer("ml", socket=sys.argv[1])
ck.save(1, {"model": model, "optim": opt}).wait(60)
ck.close()
dist.barrier()      # ranks in step between Checkpointers (see the note above build)

# The live model's own state dict, read in place: nothing to load. A copy of it, or a model with a
# module that loads in its own way (BatchNorm's _load_from_state_dict), is loaded.
sd = get_model_state_dict(model)
assert loaded_in_place(model, sd, sd)
assert not loaded_in_place(model, {k: v.clone() for k, v in sd.items()}, sd)
bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
bn_sd = bn.state_dict()
assert not loaded_in_place(bn, bn_sd, bn_sd)

# The optimizer's own state dict is loaded in place; a copy of its state is not, nor a moment of
# another dtype than its parameter's (torch's load casts it), nor state under a key the load drops.
osd = get_optimizer_state_dict(model, opt)
assert optimizer_loaded_in_place(model, opt, osd, osd)
copied = {"state": {k: {n: v.clone() for n, v in per.items()} for k, per in osd["state"].items()},
          "param_groups": osd["param_groups"]}
assert not optimizer_loaded_in_place(model, opt, copied, osd)
other, other_opt = build(3)
other_opt.zero_grad()
other(torch.randn(4, 8)).square().mean().backward()
other_opt.step()
first = other_opt.param_groups[0]["params"][0]
other_opt.state[first]["exp_avg"] = other_opt.state[first]["exp_avg"].to(torch.bfloat16)
other_sd = get_optimizer_state_dict(other, other_opt)
assert not optimizer_loaded_in_place(other, other_opt, other_sd, other_sd)
other_opt.state[first]["exp_avg"] = other_opt.state[first]["exp_avg"].float()
assert optimizer_loaded_in_place(other, other_opt, other_sd, other_sd)   # (its dicts are the optimizer's)
fewer = {"state": {k: {n: v for n, v in per.items() if n != "exp_avg_sq"} for k, per in other_sd["state"].items()},
         "param_groups": other_sd["param_groups"]}
assert not optimizer_loaded_in_place(other, other_opt, fewer, fewer)

for memory in (False, True):
    fresh, fresh_opt = build(1)
    fresh_opt.param_groups[0]["lr"] = 0.5          # the saved settings must come back
    del calls[:], opt_calls[:]
    ck = ckptd_client.Checkpointer("ml", socket=sys.argv[1], memory=memory)
    assert ck.restore({"model": fresh, "optim": fresh_opt}) == 1
    assert ck.last_restore.source == ("memory" if memory else "storage"), ck.last_restore
    assert calls == [], f"memory={memory}: set_model_state_dict ran {len(calls)} times after an in-place read"
    assert opt_calls == [], f"memory={memory}: set_optimizer_state_dict ran {len(opt_calls)} times"
    assert fresh_opt.param_groups[0]["lr"] == 0.1, fresh_opt.param_groups[0]["lr"]
    equal(snap(fresh, fresh_opt), want)
    ck.close()
    dist.barrier()      # ranks in step between Checkpointers (see the note above build)

# Load hooks of the user's: the model and optimizer are loaded through torch, so the hooks run, and it
# restores exactly.
hooked, hooked_opt = build(2)
ran, ran_opt = [], []
hooked[1].register_load_state_dict_post_hook(lambda module, keys: ran.append(len(keys.missing_keys)))
hooked_opt.register_load_state_dict_post_hook(lambda optimizer: ran_opt.append(len(optimizer.state)))
del calls[:], opt_calls[:]
ck = ckptd_client.Checkpointer("ml", socket=sys.argv[1], memory=False)
assert ck.restore({"model": hooked, "optim": hooked_opt}) == 1
assert calls == [1] and ran == [0], (calls, ran)
assert opt_calls == [1] and ran_opt == [4], (opt_calls, ran_opt)
equal(snap(hooked, hooked_opt), want)
ck.close()
print("WORKER OK", flush=True)
dist.barrier()      # rank 0 hosts the store: nobody leaves while a rank still reads it
dist.destroy_process_group()
os._exit(0)
'''


def test_model_load_skipped_after_in_place_read_and_made_for_hooks(tmp: Path, daemon: Any) -> None:
    script = tmp / "ml_worker.py"
    script.write_text(WORKER)
    run(script, 2, str(daemon.socket))
    assert (daemon.root / "ml" / "step-000000000001" / "index.json").is_file()


NEXT_STEP = r'''
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptd_client

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
OPTIMIZERS = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
              "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
              "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True)}


def build(seed, name):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = OPTIMIZERS[name](model.parameters())
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def step(model, opt, sched, i):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


for name in OPTIMIZERS:
    model, opt, sched = build(0, name)
    for i in range(3):
        step(model, opt, sched, i)
    ck = ckptd_client.Checkpointer(name, socket=sys.argv[1], commit="local")
    ck.save(3, {"model": model, "optim": opt, "sched": sched}).wait(60)
    ck.close()
    want = step(model, opt, sched, 3)
    for memory in (True, False):
        fresh, fresh_opt, fresh_sched = build(1, name)
        ck = ckptd_client.Checkpointer(name, socket=sys.argv[1], commit="local", memory=memory)
        assert ck.restore({"model": fresh, "optim": fresh_opt, "sched": fresh_sched}) == 3
        assert ck.last_restore.source == ("memory" if memory else "storage"), ck.last_restore
        got = step(fresh, fresh_opt, fresh_sched, 3)
        assert got == want, (name, memory, got, want)
        ck.close()
print("WORKER OK", flush=True)
dist.barrier()      # rank 0 hosts the store: nobody leaves while a rank still reads it
dist.destroy_process_group()
os._exit(0)
'''


def test_one_rank_fsdp2_fresh_optimizers_restore_and_train_on(tmp: Path, daemon: Any) -> None:
    script = tmp / "ns_worker.py"
    script.write_text(NEXT_STEP)
    run(script, 1, str(daemon.socket))
