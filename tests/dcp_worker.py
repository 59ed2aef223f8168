"""Rank processes of tests/test_dcp_backend.py: ``torch.distributed.checkpoint`` with ckptd's storage
writer and reader, on FSDP2 gloo ranks (the model and its layouts: tests/sharded_trainer.py).

Modes:

- ``save``: 2 FSDP2 ranks train ``--steps`` steps, write the reference (``saved.*.pt``, as
  sharded_trainer.snapshot does), then ``dcp.save`` the ``get_state_dict`` dicts, the LR scheduler
  (a Stateful) and ``extra`` (a ``Fraction``: a DCP byte item) with ``ckptd_client.dcp.StorageWriter``;
  rank 0 then compares the Metadata ``dcp.save`` returned with the one the reader rebuilds
  (``META-EQUAL True``).
- ``async``: as ``save``, but one ``dcp.save`` at step 1, then ``dcp.async_save`` at ``--steps``
  while training goes on. ``--kill after``: once the future resolves every rank prints
  ``RESOLVED n`` and SIGKILLs itself. ``--kill before``: rank 1's writer holds its items back
  (a gate in ``write_data``: the step cannot commit) and, once it is there, every rank prints
  ``GATED n`` and SIGKILLs itself while the save is in flight. ``--process``: ``async_save`` in
  process mode (the writer is pickled to DCP's background process, which saves through a
  ``Checkpointer`` of its own); ``--kill none``: once the future resolves every rank prints
  ``RESOLVED n`` and exits cleanly.
- ``fail``: 2 gloo ranks (no model), ``--commit-timeout`` seconds; rank 1's state holds a
  ``threading.Lock``. ``dcp.save`` at step 5 (DCP's planner cannot pickle it, inside ``write_data``),
  then ``Checkpointer.save`` at step 6 (a leaf ckptd cannot store): each rank prints
  ``RAISED n <message>`` for each, then ``INDEXES k`` (the job's committed steps).
- ``load``: ``--layout`` (fsdp on the group's ranks, or plain in one process) from another seed,
  ``dcp.load`` of ``--step`` with ``ckptd_client.dcp.StorageReader`` and ``set_state_dict``, then
  writes ``loaded<world>.*.pt`` and prints ``EXTRA <repr>``.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent.futures import Future
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from rank_exit import leave
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ckptd_client.dcp import StorageReader, StorageWriter

import sharded_trainer as st


class GatedWriter(StorageWriter):
    """A real writer whose ``write_data`` first waits at a gate that never opens: its rank's items
    never reach the daemon, so the step cannot commit (``--kill before``)."""

    reached = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        GatedWriter.reached.set()
        threading.Event().wait()
        return super().write_data(plan, planner)


def say(line: str) -> None:
    """``line`` in one write: DCP's background process shares this stdout and logs to it, and
    ``print`` writes the text and its newline apart, so another line could land in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def state_of(model: Any, opt: Any, sched: Any, frac: Any, note: str) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched, "extra": {"frac": frac, "note": note}}


def mode_save(a: argparse.Namespace) -> None:
    rank, _ = st.init_group()
    model, dp_rank, _ = st.build("fsdp", seed=1)
    opt, sched = st.make_optim(model, t_max=20)
    writer = StorageWriter(a.job, socket=a.socket)
    # The save's collectives run on a thread of their own: a group of their own (as torchtitan's
    # manager does), so they never interleave with training's on the default group.
    pg = torch.distributed.new_group(backend="gloo") if a.mode == "async" else None
    if a.process:      # DCP's background process group rendezvouses there (torchrun's environment has it)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    kind = AsyncCheckpointerType.PROCESS if a.process else AsyncCheckpointerType.THREAD
    for step in range(1, a.steps + 1):
        st.train_step(model, opt, sched, *st.batch(step, dp_rank))
        if a.mode == "async" and step == 1:
            dcp.save(state_of(model, opt, sched, Fraction(1, 3), "first"), checkpoint_id="step-1",
                     storage_writer=writer)
            print("SAVED 1", flush=True)
        if a.process and step == 2:     # the background process's first save (the next one reuses its Checkpointer)
            first = dcp.async_save(state_of(model, opt, sched, Fraction(2, 5), "second"), checkpoint_id="step-2",
                                   storage_writer=writer, process_group=pg, async_checkpointer_type=kind)
            assert isinstance(first, Future)
            first.result()
    st.snapshot(Path(a.out), "saved", model, opt, sched, {"step": a.steps})
    state = state_of(model, opt, sched, Fraction(3, 7), "hello")
    if a.mode == "save":
        md = dcp.save(state, checkpoint_id=f"step-{a.steps}", storage_writer=writer)
        print(f"SAVED {a.steps}", flush=True)
        if rank == 0:
            reader = StorageReader(a.job, socket=a.socket)
            reader.reset(f"step-{a.steps}")
            print(f"META-EQUAL {reader.read_metadata().state_dict_metadata == md.state_dict_metadata}", flush=True)
            reader.close()
        writer.close()
        torch.distributed.destroy_process_group()
        return
    if a.kill == "before" and rank == 1:
        writer = GatedWriter(a.job, socket=a.socket)
    fut = dcp.async_save(state, checkpoint_id=f"step-{a.steps}", storage_writer=writer, process_group=pg,
                         async_checkpointer_type=kind)
    for step in range(a.steps + 1, a.steps + 3):        # training goes on while the save is in flight
        st.train_step(model, opt, sched, *st.batch(step, dp_rank))
    if a.kill == "before":
        if rank == 1:
            GatedWriter.reached.wait()
        torch.distributed.barrier()
        print(f"GATED {a.steps}", flush=True)
    else:
        assert isinstance(fut, Future)
        fut.result()
        say(f"RESOLVED {a.steps}")
    if a.process:      # this process's writer saved step 1 only: 2 and 3 were saved by DCP's background process
        say(f"WRITER-LAST {writer.last.step if writer.last is not None else None}")
    if a.kill == "none":
        writer.close()
        torch.distributed.destroy_process_group()
        return
    os.kill(os.getpid(), signal.SIGKILL)


def mode_fail(a: argparse.Namespace) -> None:
    import ckptd_client
    from ckptd_client.config import CheckpointerConfig
    rank, _ = st.init_group()
    state = {"w": torch.full((4,), float(rank)), "obj": threading.Lock() if rank == 1 else "fine"}
    writer = StorageWriter(a.job, config=CheckpointerConfig(socket=a.socket, commit_timeout=a.commit_timeout))
    try:
        dcp.save(state, checkpoint_id="step-5", storage_writer=writer)
    except CheckpointException as e:     # (a BaseException) every rank's traceback
        say("RAISED 5 " + " | ".join(line for line in str(e).splitlines() if "Error" in line))
    writer.close()
    ckpt = ckptd_client.Checkpointer(a.job, socket=a.socket, commit_timeout=a.commit_timeout)
    try:
        ckpt.save(6, state).wait()
    except Exception as e:
        say(f"RAISED 6 {type(e).__name__}: {e}")
    torch.distributed.barrier()     # both steps settled on every rank
    say(f"INDEXES {len(list((Path(ckpt.resolve_root()) / a.job).glob('step-*/index.json')))}")
    ckpt.close()
    leave()


def mode_load(a: argparse.Namespace) -> None:
    rank, world = st.init_group()
    model, _, _ = st.build(a.layout, seed=2)
    opt, sched = st.make_optim(model, t_max=20)
    state = state_of(model, opt, sched, None, "")
    plain = a.layout == "plain"
    dcp.load(state, checkpoint_id=f"step-{a.step}", storage_reader=StorageReader(a.job, root=a.root),
             no_dist=plain)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    st.snapshot(Path(a.out), f"loaded{0 if plain else world}", model, opt, sched, {"step": a.step})
    print(f"EXTRA {state['extra']['frac']!r} {state['extra']['note']}", flush=True)
    if not plain:
        torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "async", "load", "fail"])
    p.add_argument("--socket")
    p.add_argument("--root")
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step", type=int, default=3)
    p.add_argument("--layout", default="fsdp")
    p.add_argument("--kill", choices=["after", "before", "none"], default="after")
    p.add_argument("--process", action="store_true")
    p.add_argument("--commit-timeout", type=float, default=600.0)
    a = p.parse_args()
    if a.mode == "fail":
        mode_fail(a)
    if a.mode != "load":
        mode_save(a)
        return
    mode_load(a)
    leave()         # everything the test reads is written: no interpreter teardown (rank_exit.py)


if __name__ == "__main__":
    main()
