"""A restore's choice of step is rank 0's (``agreement.RestoreAgreements.step``): another rank waits for it within the
Checkpointer's join window, not the store's own timeout (30 min by torch's default), and then fails
saying why. Two real gloo ranks on one daemon: rank 0 makes its Checkpointer and never restores;
rank 1's restore fails within the window, and both ranks then leave cleanly.

And rank 0, whose process hosts the store (``init_method="tcp://..."``, no launcher), returns from a
restore only once every rank has read its agreements: a script whose restore is the last thing it does
before it exits (an evaluation, a conversion) would otherwise take the store from a slower rank."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sharded_trainer as st

# Every worker below: two gloo ranks whose group (and store) rank 0's process hosts, no launcher.
PREAMBLE = r'''
import os, sys, time
import torch
import torch.distributed as dist
import ckptd_client

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
'''

WORKER = PREAMBLE + r'''
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


LEAVER = PREAMBLE + r"""
rank, level = dist.get_rank(), sys.argv[2]
ck = ckptd_client.Checkpointer("leave", socket=sys.argv[1], join_timeout=20, memory=level == "memory")
saved = {"w": torch.arange(6, dtype=torch.float32) * (rank + 1), "b": torch.full((rank + 2,), 7, dtype=torch.int16)}
ck.save(1, saved, level=level).wait(60)
ck.close()
dist.barrier()
ck = ckptd_client.Checkpointer("leave", socket=sys.argv[1], join_timeout=20, memory=level == "memory")
ck.run_scope.wait()     # rank 1 has the run id: what is tested is the restore's agreement alone
dist.barrier()
if rank == 1:
    time.sleep(4)       # slower to reach its restore than rank 0 is to finish its own
live = {"w": torch.zeros(6), "b": torch.zeros(rank + 2, dtype=torch.int16)}
got = ck.restore(live)
assert got == 1 and all(torch.equal(live[k], saved[k]) for k in saved), (got, live)
print(f"RESTORED {got} at the {ck.last_restore.level} level", flush=True)
ck.close()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)             # no barrier, no destroy: rank 0's store goes with it
"""


@pytest.mark.parametrize("level", ["storage", "memory"])
def test_rank_0_outlasts_a_slower_ranks_reading_of_the_restore_agreement(tmp: Path, daemon: Any,
                                                                          level: str) -> None:
    """Rank 0 restores and exits at once, rank 1 reaches its restore 4 s later: rank 1 still restores
    (rank 0 waited for it to read the step chosen, and at the memory level the vote too), and rank 0
    never waited out the join window for a mark a reader failed to set."""
    script = tmp / "leaver.py"
    script.write_text(LEAVER)
    outs = st.finish(st.launch(2, str(daemon.socket), level, script=script), timeout=120)
    for out in outs:
        assert f"RESTORED 1 at the {level} level" in out, out
        assert "did not restore" not in out, out


DRIFTER = PREAMBLE + r"""
rank = dist.get_rank()
saved = {"w": torch.arange(5, dtype=torch.float64) + 10 * rank}
ck = ckptd_client.Checkpointer("drift", socket=sys.argv[1], join_timeout=20)
ck.save(3, saved).wait(60)
ck.close()
# Nothing collective from here on. Rank 1 comes late to each Checkpointer; rank 0's restores agree once
# (memory=False) or twice (memory=True), so a rank 1 that joined a later run of rank 0's would wait on
# another agreement's key.
for memory in (False, True, False, True):
    if rank == 1:
        time.sleep(1.5)
    ck = ckptd_client.Checkpointer("drift", socket=sys.argv[1], join_timeout=20, memory=memory)
    live = {"w": torch.zeros(5, dtype=torch.float64)}
    assert ck.restore(live) == 3 and torch.equal(live["w"], saved["w"]), live
    ck.close()
print("IN STEP", flush=True)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def test_successive_checkpointers_with_nothing_collective_between_them_stay_paired(tmp: Path, daemon: Any) -> None:
    """A script that makes one Checkpointer after another and restores in each, with no collective
    between them (an evaluation over steps): rank 0's restore waits for rank 1 to read its choice, so
    rank 0 cannot run a Checkpointer ahead and rank 1 join its later run (whose agreements are numbered
    otherwise). Before, rank 1 waited on a key rank 0 never set, then failed."""
    script = tmp / "drifter.py"
    script.write_text(DRIFTER)
    outs = st.finish(st.launch(2, str(daemon.socket), script=script), timeout=150)
    assert all("IN STEP" in out for out in outs), outs


ALONE = PREAMBLE + r"""
rank = dist.get_rank()
ck = ckptd_client.Checkpointer("alone", socket=sys.argv[1], join_timeout=30)
saved = {"w": torch.arange(4, dtype=torch.int32) * (rank + 1)}
ck.save(2, saved).wait(60)
ck.close()
dist.barrier()
fail = sys.argv[2] == "fail"
ck = ckptd_client.Checkpointer("alone", socket=sys.argv[1], join_timeout=600 if fail else 4)
if rank == 0 and not fail:      # rank 1 never restores: rank 0 waits for its read at most the join window
    live = {"w": torch.zeros(4, dtype=torch.int32)}
    t0 = time.monotonic()
    got = ck.restore(live)
    assert got == 2 and torch.equal(live["w"], saved["w"]), (got, live)
    print(f"RESTORED {got} in {time.monotonic() - t0:.1f}s", flush=True)
if rank == 0 and fail:          # a restore that fails (an entry the step lacks) raises without that wait
    try:
        ck.restore({"w": torch.zeros(4, dtype=torch.int32), "extra": torch.zeros(1)})
        raise AssertionError("restored an entry the step lacks")
    except ckptd_client.CheckpointError as e:
        assert "extra" in str(e), e
        print("REFUSED at once", flush=True)
dist.barrier()
ck.close()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def test_rank_0s_wait_for_readers_is_bounded_and_its_restore_stands(tmp: Path, daemon: Any) -> None:
    """Rank 1 never restores: rank 0's restore still returns its step, restored, after the join window,
    with a warning saying a rank did not read its choice."""
    script = tmp / "alone.py"
    script.write_text(ALONE)
    outs = st.finish(st.launch(2, str(daemon.socket), "ok", script=script), timeout=120)
    assert "RESTORED 2 in" in outs[0], outs[0]
    assert "not every rank read this restore's agreement within 4s (join_timeout)" in outs[0], outs[0]


def test_a_failed_restore_on_rank_0_raises_without_waiting_for_readers(tmp: Path, daemon: Any) -> None:
    """Rank 0's restore fails after it published its choice (an entry the step lacks) and rank 1 never
    reads it: the error comes at once, not after the join window (600 s here, past the test's bound)."""
    script = tmp / "alone.py"
    script.write_text(ALONE)
    outs = st.finish(st.launch(2, str(daemon.socket), "fail", script=script), timeout=120)
    assert "REFUSED at once" in outs[0], outs[0]
