"""Exercise ckptd's CUDA path on a real GPU and record figures (run where a GPU is lent).

    python benchmarks/gpu_check.py [--size-mib 1024] [--out results.json]

Checks: slots are registered as pinned memory (cudaHostRegister); blocking saves (filling: the
daemon writes while the D2H copy runs, its marks CUDA events) and overlapped saves of GPU state
commit and restore bit-exact; an overlapped save fenced by the optimizer hook captures the
pre-step values; restore into GPU tensors is bit-exact; CUDA RNG state round-trips.
Records: stall per save (blocking, overlapped = save + fence), time to commit, D2H GB/s.
Exits 0 with a note when no GPU is present, non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    import ckptd_client

    dev = torch.device("cuda", 0)
    n_layers = 8
    per_layer = a.size_mib * 2**20 // n_layers // 10      # elements: bf16 w (2) + fp32 master, m, v (12) ≈ 14 B
    side = int(per_layer ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(n_layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(256, side, device=dev)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()

    train_step()
    state = {"model": model, "optim": opt, "rng": ckptd_client.RNGState()}
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    from ckptd.launch import spawn_daemon

    with tempfile.TemporaryDirectory() as tmp:
        daemon = spawn_daemon(os.path.join(tmp, "root"), os.path.join(tmp, "s.sock"))
        sock = str(daemon.socket)
        try:
            ck = ckptd_client.Checkpointer("gpu", socket=sock)
            t0 = time.perf_counter()
            ck.prepare(state)
            results["prepare_s"] = time.perf_counter() - t0
            results["slot_pinned"] = ck.slots[0].pinned
            nbytes = ck.slots[0].size
            results["state_bytes"] = nbytes
            blocking: list[float] = []
            overlapped: list[float] = []
            commits: list[float] = []
            for i in range(a.saves):
                saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
                h = ck.save(2 * i + 1, state, overlap=False)   # a filling save: handed over before its D2H copy
                blocking.append(h.stall_s)
                train_step()
                h.wait(600)
                assert h.committed_s is not None
                commits.append(h.committed_s)
                probe = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(n_layers)]).to(dev)
                ck.restore({"model": probe}, step=2 * i + 1)
                for k, v in probe.state_dict().items():
                    assert torch.equal(v, saved[k]), f"blocking (filling) save {2 * i + 1}: {k} differs"
                before = {k: v.detach().clone() for k, v in model.state_dict().items()}
                h = ck.save(2 * i + 2, state, overlap=True)
                train_step()                      # fenced by the optimizer pre-hook
                torch.cuda.synchronize()
                overlapped.append(h.stall_s + h.fence_s)
                h.wait(600)
                probe = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(n_layers)]).to(dev)
                ck.restore({"model": probe}, step=2 * i + 2)
                for k, v in probe.state_dict().items():
                    assert torch.equal(v, before[k]), f"overlapped save {2 * i + 2}: {k} differs"
            cuda_rng = torch.cuda.get_rng_state()
            h = ck.save(10_000, {"rng": ckptd_client.RNGState()})
            h.wait(60)
            torch.cuda.manual_seed(123)
            ck.restore({"rng": ckptd_client.RNGState()}, step=10_000)
            assert torch.equal(torch.cuda.get_rng_state(), cuda_rng), "CUDA RNG state did not round-trip"
            ck.close()
        finally:
            daemon.stop()
    results.update({
        "blocking_stall_p50_ms": 1e3 * statistics.median(blocking),
        "blocking_stall_max_ms": 1e3 * max(blocking),
        "overlapped_stall_p50_ms": 1e3 * statistics.median(overlapped),
        "overlapped_stall_max_ms": 1e3 * max(overlapped),
        "commit_p50_s": statistics.median(commits),
        "d2h_gbps_blocking": nbytes / statistics.median(blocking) / 1e9,
    })
    print(json.dumps(results, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
