"""A restore's choice of step is rank 0's (``restore.agree_step``): another rank waits for it within the
Checkpointer's join window, not the store's own timeout (30 min by torch's default), and then fails
saying why. Two real gloo ranks on one daemon: rank 0 makes its Checkpointer and never restores;
rank 1's restore fails within the window, and both ranks then leave cleanly."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import sharded_trainer as st

WORKER = r'''
import os, sys, time
import torch
import torch.distributed as dist
import ckptd_client

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
ck = ckptd_client.Checkpointer("agree", socket=sys.argv[1], join_timeout=10)
if dist.get_rank() == 1:
    t0 = time.monotonic()
    try:
        ck.restore({"w": torch.zeros(3)})
        raise AssertionError("restored without rank 0's word")
    except ckptd_client.CheckpointError as e:
        took = time.monotonic() - t0
        assert str(e).startswith("restore: rank 1 had no word from rank 0"), e
        print(f"REFUSED in {took:.1f}s: {e}", flush=True)
dist.barrier()      # rank 0's Checkpointer (which answers rank 1's join) and store stay until rank 1 is done
ck.close()
print("WORKER OK", flush=True)
dist.destroy_process_group()
os._exit(0)
'''


def test_a_restore_waits_for_rank_0s_choice_within_the_join_window(tmp: Path, daemon: Any) -> None:
    script = tmp / "agree_worker.py"
    script.write_text(WORKER)
    # (Without the bound, rank 1 would wait the store's 30 minutes: the group would outlive finish's 120 s.)
    outs = st.finish(st.launch(2, str(daemon.socket), script=script), timeout=120)
    assert all("WORKER OK" in out for out in outs), outs
    assert "REFUSED in" in outs[1] and "join_timeout" in outs[1], outs[1]
