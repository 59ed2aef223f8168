"""Saving sharded training state (DTensors): local shards, no gathering, keyed by FQN.

Real processes: two gloo ranks on CPU (``WORKER`` below, one subprocess per rank) save through a
real daemon; the test then reads what was committed with ``StepReader`` and the index's global
tensor map. Also: unsupported tensors refused before any slot is used, and overlapped saves of
dict-style state (``get_state_dict``'s output) fenced with ``fence_on``.
"""
# mypy: disable-error-code="union-attr"
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from ports import free_port

import ckptd_client
from ckptd.core.global_index import LOCAL, SHARDED, parse_tensor_map
from ckptd.core.map_check import geometry_faults
from ckptd.core.names import step_dir
from ckptd.core.reader import StepReader, verify_step
from ckptd.core.regions import Region, coverage_faults
from ckptd_client.state import flatten_state

pytestmark = [pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")]

WORKER = r'''
import json, os, sys, threading
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
import ckptd_client

scenario, sock, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))


def fsdp_training():
    torch.manual_seed(0)
    # 10, 3 and 1 rows over 2 ranks: even shards, uneven ones (2 + 1) and an empty one (1 + 0)
    model = nn.Sequential(nn.Linear(16, 10), nn.ReLU(), nn.Linear(10, 3), nn.ReLU(), nn.Linear(3, 1))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 16)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()                                  # Adam's moments exist
    return model, opt, step


def tp_extra():
    torch.manual_seed(1)
    return {"rep": distribute_tensor(torch.randn(2, 3), mesh, [Replicate()]),     # written once
            "col": distribute_tensor(torch.randn(3, 5), mesh, [Shard(1)]),        # 3 + 2 columns
            "plain": torch.arange(4.0) + rank}


def local(v):
    return (v.to_local() if isinstance(v, DTensor) else v).detach().clone()


def locals_of(model, opt, extra=None):
    """What each saved name should hold on this rank: its local shard (or the plain tensor)."""
    msd, osd = get_state_dict(model, opt)
    got = {f"model/{k}": local(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        got.update({f"optim/state/{fqn}/{k}": local(v) for k, v in st.items()})
    for k, v in (extra or {}).items():
        got[f"extra/{k}"] = local(v)
    return got


def dump(obj, tag):
    torch.save(obj, os.path.join(out, f"rank{rank}-{tag}.pt"))


def report(obj):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(obj, f)


if scenario == "fsdp":
    model, opt, step = fsdp_training()
    extra = tp_extra()
    ck = ckptd_client.Checkpointer("fsdp", socket=sock)
    msd, osd = get_state_dict(model, opt)                        # the torch spelling: dicts
    dump(locals_of(model, opt, extra), "s1")
    ck.save(1, {"model": msd, "optim": osd, "extra": extra, "n": 1}).wait(60)
    step()
    dump(locals_of(model, opt, extra), "s2")
    h = ck.save(2, {"model": model, "optim": opt, "extra": extra, "n": 2})   # the object spelling
    assert ck._copies.inflight is not None       # parameters and Adam state copied in the background
    step()                                                       # fenced by the step pre-hook
    h.wait(60)
    assert h.committed
    ck.close()

elif scenario == "refuse":
    torch.manual_seed(0)
    bad = {
        "partial": DTensor.from_local(torch.ones(4), mesh, [Partial()]),
        "nested": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "jagged": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
        "sparse": torch.eye(3).to_sparse(),
        "csr": torch.eye(3).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
        "meta": torch.empty(3, device="meta"),
        "dtype": torch.zeros(4, dtype=torch.bits8),
        "dt_meta": DTensor.from_local(torch.empty(2, device="meta"), mesh, [Shard(0)]),
    }
    good = {"w": distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]), "b": torch.ones(3)}
    ck = ckptd_client.Checkpointer("refuse", socket=sock)
    results = {}
    for i, (key, t) in enumerate(bad.items()):
        msg = "no error"
        try:
            ck.save(10 + i, {"good": good, "bad": {"deep": [t]}})
        except TypeError as e:
            msg = "TypeError: " + str(e)
        except Exception as e:                 # reported, not swallowed: the test names it
            msg = f"{type(e).__name__}: {e}"
        results[key] = {"msg": msg, "slots": len(ck.slots), "connected": ck._session.conn is not None,
                        "pending": ck.pending(10 + i) is not None, "inflight": ck._copies.inflight is not None}
    ck.prepare({"good": good})               # slots exist now: a refused save must take none
    try:
        ck.save(31, {"good": good, "bad": bad["nested"]})
    except TypeError:
        pass
    results["after_prepare"] = {"slots": len(ck.slots), "free": len(ck._session._free),
                                "pending": ck.pending(31) is not None}
    h = ck.save(32, {"good": good})
    h.wait(60)
    results["good_committed"] = h.committed
    ck.close()
    report(results)

elif scenario == "overlap":
    model, opt, step = fsdp_training()

    def gated_save(ck, step_no, **kw):
        """Save with the copy thread held, so the background copy is certainly pending."""
        gate = threading.Event()
        ck._copies.pool().submit(gate.wait)
        msd, osd = get_state_dict(model, opt)
        h = ck.save(step_no, {"model": msd, "optim": osd}, **kw)
        return h, gate

    info = {}
    # 1. fence_on: the optimizer's step pre-hook fences before it mutates.
    ck = ckptd_client.Checkpointer("ovl", socket=sock)
    dump(locals_of(model, opt), "before1")
    h, gate = gated_save(ck, 1, fence_on=opt)
    info["deferred1"] = ck._copies.inflight is not None and not h.done()
    threading.Timer(0.3, gate.set).start()
    step()
    dump(locals_of(model, opt), "after1")
    h.wait(60)
    info["committed1"], info["fence_s1"] = h.committed, h.fence_s
    # 2. neither fence_on nor an optimizer object: today's behaviour, all copied in save().
    dump(locals_of(model, opt), "before2")
    h, gate = gated_save(ck, 2)
    info["deferred2"] = ck._copies.inflight is not None
    step()
    gate.set()
    h.wait(60)
    info["committed2"] = h.committed
    ck.close()
    # 3. overlap="manual" without fencing: the copy really is deferred, and a mutation the
    # caller does not fence lands in the checkpoint (what the fence in 1 prevents). Another job:
    # a second Checkpointer of one job would reuse the first one's relay keys in the store.
    ck = ckptd_client.Checkpointer("ovl2", socket=sock)
    dump(locals_of(model, opt), "before3")
    h, gate = gated_save(ck, 3, overlap="manual")
    info["deferred3"] = ck._copies.inflight is not None and not h.done()
    step()                                   # nothing fences: no hook on this checkpointer
    dump(locals_of(model, opt), "after3")
    gate.set()
    h.wait(60)
    info["committed3"] = h.committed
    # 4. overlap="manual" with an explicit fence() before the mutation.
    dump(locals_of(model, opt), "before4")
    h, gate = gated_save(ck, 4, overlap="manual")
    threading.Timer(0.3, gate.set).start()
    ck.fence()
    step()
    h.wait(60)
    info["committed4"] = h.committed
    ck.close()
    report(info)

dist.barrier()
dist.destroy_process_group()
print("WORKER OK", flush=True)
'''



def run_ranks(tmp: Path, sock: Path, scenario: str, world: int = 2, timeout: float = 120) -> Path:
    """Run WORKER's ``scenario`` as ``world`` gloo ranks; returns the folder they wrote to."""
    script = tmp / "sharded_worker.py"
    script.write_text(WORKER)
    out = tmp / f"out-{scenario}"
    out.mkdir()
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(zygote.popen([sys.executable, str(script), scenario, str(sock), str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0 and "WORKER OK" in text, f"rank {rank} failed (rc={p.returncode}):\n{text[-4000:]}"
    return out


def read_entry(reader: StepReader, rank: int, name: str) -> torch.Tensor:
    """Rank ``rank``'s saved bytes of entry ``name``, decoded, as a tensor."""
    entry = reader.manifest(rank).by_name()[name]
    dtype = getattr(torch, entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    buf = bytearray(entry.nbytes)
    fd = reader.open_data(rank)
    try:
        reader.read_tensor_into(fd, entry, memoryview(buf))
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=dtype).reshape(entry.shape)


def tree_names(node: Any) -> set[str]:
    """Every tensor name a state tree references."""
    if isinstance(node, dict) and len(node) == 1:
        (tag, value), = node.items()
        if tag == "T":
            return {value}
        if tag == "d":
            return set().union(*(tree_names(v) for _, v in value))
        if tag in ("l", "t"):
            return set().union(*(tree_names(v) for v in value))
    return set()


def tree_get(node: Any, *keys: Any) -> Any:
    for k in keys:
        node = dict((kk, vv) for kk, vv in node["d"])[k]
    return node


def open_step(root: Path, job: str, step: int) -> tuple[StepReader, dict[str, Any]]:
    reader = StepReader(step_dir(str(root), job, step))
    tmap = parse_tensor_map(reader.index["tensors"], reader.world_size)
    assert geometry_faults(tmap, reader.world_size) == []
    return reader, tmap


FQNS = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
SHAPES = {"0.weight": (10, 16), "0.bias": (10,), "2.weight": (3, 10), "2.bias": (3,), "4.weight": (1, 3),
          "4.bias": (1,)}


def test_fsdp2_saves_local_shards_keyed_by_fqn(daemon, tmp):
    """FSDP2 on 2 ranks, saved as get_state_dict dicts (step 1) and as the model/optimizer objects
    (step 2): every parameter and Adam moment is a sharded tensor keyed by FQN whose pieces tile
    it exactly and hold each rank's to_local(); a replicated DTensor is written by rank 0 only."""
    out = run_ranks(tmp, daemon.socket, "fsdp")
    trees = {}
    for step in (1, 2):
        reader, tmap = open_step(daemon.root, "fsdp", step)
        assert reader.world_size == 2
        assert verify_step(reader.path) == []
        expected = {r: torch.load(out / f"rank{r}-s{step}.pt") for r in (0, 1)}
        for fqn in FQNS:
            for name in (f"model/{fqn}", f"optim/state/{fqn}/exp_avg", f"optim/state/{fqn}/exp_avg_sq"):
                t = tmap[name]
                assert t.kind == SHARDED, name
                assert t.shape == SHAPES[fqn] and t.dtype == "float32", name
                assert sorted(p.rank for p in t.pieces) == [0, 1], name
                rows = SHAPES[fqn][0]
                for p in t.pieces:
                    assert p.name == name
                    assert p.region.offsets[0] == (0 if p.rank == 0 else math.ceil(rows / 2)), (name, p)
                    got = read_entry(reader, p.rank, name)
                    assert tuple(got.shape) == p.region.sizes
                    assert torch.equal(got, expected[p.rank][name]), f"step {step} rank {p.rank} {name}"
            # Adam's step counter is a plain tensor: each rank's own copy, all the same
            step_t = tmap[f"optim/state/{fqn}/step"]
            assert step_t.kind == LOCAL and step_t.same and sorted(p.rank for p in step_t.pieces) == [0, 1]
        # no index-keyed optimizer state, nothing gathered
        assert not any(n.startswith("optim/state/0/") for n in tmap)
        for r in (0, 1):
            entries = reader.manifest(r).by_name()
            assert entries["model/0.weight"].shape == [5, 16]
        # a replicated DTensor: one piece, from rank 0, covering it; rank 1 only names it
        rep = tmap["extra/rep"]
        assert rep.kind == SHARDED and [p.rank for p in rep.pieces] == [0] and rep.shape == (2, 3)
        assert rep.pieces[0].region.sizes == (2, 3)
        assert "extra/rep" not in reader.manifest(1).by_name()
        assert "extra/rep" in tree_names(reader.manifest(1).tree)
        # FORMAT.md (tree): every {"T": name} is a key of the tensor map; a local one is the rank's own entry
        for r in (0, 1):
            entries = reader.manifest(r).by_name()
            for name in tree_names(reader.manifest(r).tree):
                assert name in tmap, (r, name)
                assert tmap[name].kind == SHARDED or name in entries, (r, name)
        assert torch.equal(read_entry(reader, 0, "extra/rep"), expected[1]["extra/rep"])
        # a column-sharded DTensor (3 + 2 columns) and a per-rank plain tensor
        col = tmap["extra/col"]
        assert col.kind == SHARDED and {p.rank: p.region.offsets for p in col.pieces} == {0: (0, 0), 1: (0, 3)}
        for r in (0, 1):
            assert torch.equal(read_entry(reader, r, "extra/col"), expected[r]["extra/col"])
            assert torch.equal(read_entry(reader, r, "extra/plain"), expected[r]["extra/plain"])
        assert tmap["extra/plain"].kind == LOCAL and not tmap["extra/plain"].same
        trees[step] = [reader.manifest(r).tree for r in (0, 1)]
    # both spellings save the same structure: optimizer param groups name parameters by FQN
    for r in (0, 1):
        for step in (1, 2):
            groups = tree_get(trees[step][r], "optim", "param_groups")["l"]
            assert tree_get(groups[0], "params") == {"l": FQNS}
        strip = [tree_get(trees[s][r], k) for s in (1, 2) for k in ("model", "optim", "extra")]
        assert strip[:3] == strip[3:]


MESH_2X2 = r'''
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from ckptd_client.slots import plan_layout
from ckptd_client.state import flatten_state


def tp_state(rank, mesh):      # FSDP2 + TP on ("dp", "tp")
    return {"fsdp_tp": DTensor.from_local(torch.full((3, 2), float(rank)), mesh, [Shard(0), Shard(1)]),
            "dp_rows": DTensor.from_local(torch.full((3, 4), float(rank)), mesh, [Shard(0), Replicate()]),
            "tp_bias": DTensor.from_local(torch.full((2,), float(rank)), mesh, [Replicate(), Shard(0)]),
            "replicated": DTensor.from_local(torch.ones(5), mesh, [Replicate(), Replicate()]),
            # outside the TP plan: FSDP2 puts it on the "dp" slice; the "tp" ranks hold copies
            "norm": DTensor.from_local(torch.full((4,), float(rank)), mesh["dp"], [Shard(0)])}


def pp_state(rank, mesh):      # ("pp", "dp"): each stage its own parameters, on its "dp" slice
    stage = mesh.get_coordinate()[0]
    return {f"layers.{stage}.w": DTensor.from_local(torch.full((2, 3), float(rank)), mesh["dp"], [Shard(0)])}


out = {}
for kind, names, make in (("tp", ("dp", "tp"), tp_state), ("pp", ("pp", "dp"), pp_state)):
    out[kind] = {}
    for rank in range(4):           # each rank of a 2x2 mesh in turn, on torch's fake process group
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        flat = flatten_state(make(rank, mesh))
        layout, _ = plan_layout(flat.tensors, flat.placements)
        out[kind][rank] = {"names": sorted(flat.sharded), "pieces": {
            e.name: [list(e.placement.global_shape), list(e.placement.offsets), list(e.shape)] for e in layout}}
        dist.destroy_process_group()
print(json.dumps(out))
'''


def test_replicated_ownership_on_2x2_mesh(tmp):
    """On a 2x2 mesh the replica at coordinate 0 of every replicated dimension writes, the others
    write nothing for that tensor (but still name it), and the written pieces tile each tensor.
    A parameter FSDP2 + TP leaves on the "dp" slice is written by the tp=0 ranks only; pipeline
    stages (a "pp" dimension no DTensor spans) each write their own parameters."""
    script = tmp / "mesh2x2.py"
    script.write_text(MESH_2X2)
    res = zygote.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    if "fake_pg" in res.stderr and "ModuleNotFoundError" in res.stderr:
        pytest.skip("torch has no fake process group")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    expected = {"tp": {"fsdp_tp": [0, 1, 2, 3], "dp_rows": [0, 2], "tp_bias": [0, 1], "replicated": [0],
                       "norm": [0, 2]},
                "pp": {"layers.0.w": [0, 1], "layers.1.w": [2, 3]}}
    for kind, want in expected.items():
        got = {int(r): v for r, v in result[kind].items()}
        every = sorted({n for r in got for n in got[r]["names"]})
        writers = {name: sorted(r for r in got if name in got[r]["pieces"]) for name in every}
        assert writers == want, kind
        if kind == "tp":
            for r in got:
                assert got[r]["names"] == sorted(want), r        # every rank names them all
        for name, ranks in writers.items():
            gshape = got[ranks[0]]["pieces"][name][0]
            regions = [(f"rank {r}", Region(tuple(got[r]["pieces"][name][1]), tuple(got[r]["pieces"][name][2])))
                       for r in ranks]
            assert coverage_faults(gshape, regions) == [], (kind, name)


def test_unsupported_tensors_refused_before_any_slot(daemon, tmp):
    """Partial DTensors, nested (strided and jagged), sparse, quantized, meta tensors and unknown
    dtypes: TypeError naming the key path, with no slot taken and nothing sent to the daemon."""
    out = run_ranks(tmp, daemon.socket, "refuse")
    for r in (0, 1):
        res = json.loads((out / f"rank{r}.json").read_text())
        for key in ("partial", "nested", "jagged", "sparse", "csr", "quantized", "meta", "dtype", "dt_meta"):
            got = res[key]
            assert got["msg"].startswith("TypeError: ") and "'bad/deep/0'" in got["msg"], (key, got["msg"])
            # the refusal came before connecting: no slot, no connection, no save in flight
            assert got == {**got, "slots": 0, "connected": False, "pending": False, "inflight": False}, key
        assert "Partial" in res["partial"]["msg"] and "nested" in res["nested"]["msg"]
        assert res["after_prepare"]["slots"] == res["after_prepare"]["free"] > 0
        assert not res["after_prepare"]["pending"]
        assert res["good_committed"]
    job = daemon.root / "refuse"
    assert sorted(p.name for p in job.iterdir() if p.name.startswith("step-")) == ["step-000000000032"]


@pytest.mark.parametrize("bad", ["nested", "strided_nested", "sparse", "quantized", "meta", "dtype"])
def test_unsupported_plain_tensor_refused_in_process(daemon, bad):
    makers = {
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged),
        "strided_nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "sparse": lambda: torch.eye(3).to_sparse(),
        "quantized": lambda: torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
        "meta": lambda: torch.empty(3, device="meta"),
        "dtype": lambda: torch.zeros(2, dtype=torch.bits8),
    }
    ck = ckptd_client.Checkpointer("bad", socket=str(daemon.socket))
    ck.prepare({"w": torch.zeros(8)})
    with pytest.raises(TypeError, match="'state/x/1'"):
        ck.save(1, {"state": {"x": [torch.ones(2), makers[bad]()]}})
    assert len(ck._session._free) == len(ck.slots) > 0 and ck.pending(1) is None and ck._copies.inflight is None
    h = ck.save(2, {"w": torch.ones(8)})
    h.wait(60)
    assert h.committed
    ck.close()


def _load(out: Path, rank: int, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"rank{rank}-{tag}.pt")


def _saved(root: Path, job: str, step: int, names: list[str], rank: int) -> dict[str, torch.Tensor]:
    reader = StepReader(step_dir(str(root), job, step))
    return {n: read_entry(reader, rank, n) for n in names}


def test_dict_style_overlap_fsdp2(daemon, tmp):
    """get_state_dict dicts saved with fence_on=optimizer: the copy is deferred, the optimizer's
    step waits for it, and the checkpoint holds the pre-step values. Without any fence (overlap=
    "manual", not fenced) the same mutation lands in the checkpoint; with neither fence_on nor
    an optimizer object nothing is deferred, as before."""
    out = run_ranks(tmp, daemon.socket, "overlap")
    for r in (0, 1):
        info = json.loads((out / f"rank{r}.json").read_text())
        assert info["deferred1"] and info["committed1"]
        assert not info["deferred2"] and info["committed2"]
        assert info["deferred3"] and info["committed3"] and info["committed4"]
        for step in (1, 2, 3, 4):
            before = _load(out, r, f"before{step}")
            names = [n for n in before if n.startswith(("model/", "optim/"))]
            saved = _saved(daemon.root, "ovl" if step < 3 else "ovl2", step, names, r)
            if step == 3:               # unfenced: the step's mutation was captured
                after = _load(out, r, "after3")
                changed = [n for n in names if not torch.equal(before[n], after[n])]
                assert changed
                for n in changed:
                    assert torch.equal(saved[n], after[n]), f"rank {r}: {n} should show the unfenced mutation"
                continue
            if step == 1:               # fenced: the step did change them, after the copy
                after = _load(out, r, "after1")
                assert any(not torch.equal(before[n], after[n]) for n in names)
            for n in names:
                assert torch.equal(saved[n], before[n]), f"step {step} rank {r}: {n} captured a mutated value"
        assert info["fence_s1"] > 0


def _plain_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 64)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    return model, opt, step


def _dict_state(model, opt) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _values(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state["model"].items()}
    for pid, st in state["optim"]["state"].items():
        out.update({f"optim/state/{pid}/{k}": v.clone() for k, v in st.items()})
    return out


def test_dict_style_overlap_plain_model(daemon):
    """The same with a plain model's state dicts in one process: parameters and optimizer state
    are deferred (matched by storage), buffers are not; the fence keeps every captured value."""
    model, opt, step = _plain_training()
    ck = ckptd_client.Checkpointer("dict", socket=str(daemon.socket))
    flat = flatten_state(_dict_state(model, opt), [opt])
    deferred = {flat.tensors[i][0] for i in flat.deferrable}
    assert "model/0.weight" in deferred and "optim/state/0/exp_avg" in deferred
    assert "model/1.running_mean" not in deferred
    assert not flatten_state(_dict_state(model, opt)).deferrable
    gate = threading.Event()
    ck._copies.pool().submit(gate.wait)
    state = _dict_state(model, opt)
    before = _values(state)
    handle = ck.save(1, state, fence_on=opt)
    assert not handle.done() and ck._copies.inflight is not None
    threading.Timer(0.3, gate.set).start()
    step()                                            # fences, then mutates
    assert any(not torch.equal(before[k], v) for k, v in _values(_dict_state(model, opt)).items())
    handle.wait(60)
    assert handle.committed
    saved = _saved(daemon.root, "dict", 1, list(before), 0)
    for k in before:
        assert torch.equal(saved[k], before[k]), f"{k} captured a value mutated after save()"
    assert handle.fence_s > 0
    with pytest.raises(TypeError, match="fence_on"):
        ck.save(2, state, fence_on=[model])
    with pytest.raises(ValueError, match="overlap"):
        ck.save(2, state, overlap="always")
    ck.close()
