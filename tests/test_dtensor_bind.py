"""ckptd_client does not import torch.distributed.tensor (0.7 s of every trainer's start-up): it
binds DTensor once the trainer has imported it (ckptd_client/dtensor.py). In a fresh interpreter:
importing ckptd_client leaves the module unimported; a DTensor made afterwards is seen as one by
``writes_bytes`` or ``local_region`` reached before any ``is_dtensor`` call, and by a save of a
DTensor state made in that order, which restores bit-exact."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from ports import free_port

SCRIPT = r'''
import os, sys
import torch
import ckptd_client
from ckptd_client import dtensor
assert "torch.distributed.tensor" not in sys.modules, "import ckptd_client imported torch.distributed.tensor"
assert dtensor.is_dtensor(torch.zeros(2)) is False
assert dtensor.local_tensor(torch.zeros(2)).shape == (2,)

import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
mesh = init_device_mesh("cpu", (1,))
w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])

# Entry points that take a DTensor, each first in a process of its own in the test's second run:
first = sys.argv[3]
if first == "writes":
    assert dtensor.writes_bytes(w) is True
elif first == "region":
    region, shape = dtensor.local_region(w)
    assert shape == (4, 3), shape
if first != "save":
    assert dtensor.DTensor is DTensor
    assert dtensor.is_dtensor(w) and dtensor.local_tensor(w).data_ptr() == w._local_tensor.data_ptr()
    print("BIND OK", flush=True)
    dist.destroy_process_group()
    sys.exit(0)

state = {"w": torch.nn.Parameter(w), "b": torch.ones(3)}
ck = ckptd_client.Checkpointer("bind-" + first, socket=sys.argv[1], commit="local")
ck.save(1, state).wait(60)
assert dtensor.DTensor is DTensor
assert dtensor.is_dtensor(w) and dtensor.storage_key(w) == w._local_tensor.data_ptr()
want = w.to_local().clone()
with torch.no_grad():
    state["w"].zero_()
    state["b"].zero_()
assert ck.restore(state, step=1) == 1
got = state["w"]
assert isinstance(got, DTensor) and torch.equal(got.to_local(), want), got
assert torch.equal(state["b"], torch.ones(3))
ck.close()
print("BIND OK", flush=True)
dist.barrier()      # rank 0 hosts the store: nobody leaves while a rank still reads it
dist.destroy_process_group()
'''


def test_dtensor_bound_after_import_in_any_order(tmp: Path, daemon: Any) -> None:
    script = tmp / "bind.py"
    script.write_text(SCRIPT)
    for first in ("writes", "region", "save"):
        r = subprocess.run([sys.executable, str(script), str(daemon.socket), str(free_port()), first],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "BIND OK" in r.stdout, (first, r.stdout[-2000:], r.stderr[-4000:])
