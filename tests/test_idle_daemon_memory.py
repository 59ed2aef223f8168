"""Between saves the daemon gives back what its codec threads used: after several saves and the
idle trim, its anonymous memory is back near what it was idle before the first save (measured
from smaps_rollup: a memory bound, not a time bound)."""
from __future__ import annotations

import time

import torch

import ckptd_client


def pss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss_Anon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Pss_Anon in smaps_rollup")


def test_the_codec_threads_memory_goes_back_after_the_saves(daemon_factory) -> None:
    # Four codec threads: with an arena per thread, each kept its freed chunk buffers resident
    # (malloc_trim leaves other arenas' tops alone): +53 MiB here before the daemon used one arena.
    d = daemon_factory("--threads", "4", "--memory-steps", "0")
    torch.manual_seed(0)
    state = {"w": [torch.randn(1024, 1024) * 0.02 for _ in range(16)]}     # 64 MiB of float32
    with ckptd_client.Checkpointer("mem", socket=str(d.socket), rank=0, world_size=1, num_slots=1) as ck:
        ck.prepare(state)
        idle = pss_anon(d.pid)
        for step in range(1, 4):
            ck.save(step, state).wait(120)
            for t in state["w"]:
                t.add_(1e-3)
        time.sleep(2.0)               # the daemon trims 0.5 s after its last shard became durable
        grown = pss_anon(d.pid) - idle
    assert grown < 12 * 2**20, f"daemon anonymous memory {grown / 2**20:.1f} MiB above idle after the saves"
