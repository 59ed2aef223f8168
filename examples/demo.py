"""`make demo`: start a daemon on a temporary root, train, SIGKILL the trainer, resume, report.

Run as ``python examples/demo.py [--size-mib N]``. The trainer role (``--train``) is this
same file run as a subprocess, so the kill is a real SIGKILL of a real process.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile


def report(h) -> None:
    """One JSON line per committed save: what it cost the trainer (save() + fence) and took to commit."""
    h.wait()
    print(json.dumps({"event": "committed", "step": h.step, "stall_ms": round((h.stall_s + h.fence_s) * 1e3, 2),
                      "commit_ms": round(h.committed_s * 1e3, 1), "raw_bytes": h.raw_bytes,
                      "stored_bytes": h.stored_bytes}), flush=True)


def train(args: argparse.Namespace) -> int:
    import torch

    import ckptd_client

    torch.manual_seed(0)
    width = max(64, int((args.size_mib * 2**20 / 4 / 6) ** 0.5))   # 2 layers × 3 fp32 copies saved (w, m, v)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    state = {"model": model, "optim": opt, "sched": sched, "rng": ckptd_client.RNGState(), "step": 0}
    ckpt = ckptd_client.Checkpointer("demo", socket=args.socket)
    start = ckpt.restore(state) or 0
    info = ckpt.last_restore
    print(json.dumps({"event": "start", "restored": start, "params": sum(p.numel() for p in model.parameters()),
                      "source": info.source if info else None,
                      "restore_ms": round(info.seconds * 1e3, 1) if info else None}), flush=True)
    pending = []
    x = torch.randn(32, width)
    for step in range(start, args.steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step == start:
            ckpt.prepare(state)   # now that the optimizer has state: slots sized and pre-faulted here,
                                  # not on the first save
        state["step"] = step + 1
        if (step + 1) % args.every == 0:
            pending.append(ckpt.save(step + 1, state))
        for h in [h for h in pending if h.done()]:
            pending.remove(h)
            report(h)
    for h in pending:
        report(h)
    ckpt.close()
    print(json.dumps({"event": "done", "step": args.steps}), flush=True)
    return 0


def run_trainer(sock: str, size_mib: int, steps: int, every: int, kill_after_commits: int | None) -> list[dict]:
    cmd = [sys.executable, __file__, "--train", "--socket", sock, "--size-mib", str(size_mib),
           "--steps", str(steps), "--every", str(every)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    events = []
    assert proc.stdout is not None
    for line in proc.stdout:
        ev = json.loads(line)
        events.append(ev)
        if ev["event"] == "start":
            print(f"  trainer pid {proc.pid}: {ev['params'] / 1e6:.1f} M params, "
                  + (f"resumed from step {ev['restored']} (restored from {ev['source']}"
                     f" in {ev['restore_ms']} ms)" if ev['restored'] else "fresh start"))
        elif ev["event"] == "committed":
            print(f"  step {ev['step']:4d} committed: trainer stalled {ev['stall_ms']:7.2f} ms (save + fence), "
                  f"committed {ev['commit_ms']:7.1f} ms after save(), "
                  f"{ev['raw_bytes'] / 2**20:.1f} MiB -> {ev['stored_bytes'] / 2**20:.1f} MiB on disk")
        if kill_after_commits and sum(e["event"] == "committed" for e in events) >= kill_after_commits:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            print(f"  -- SIGKILLed the trainer (exit {proc.returncode}) after {kill_after_commits} commits --")
            return events
    if proc.wait() != 0:
        raise SystemExit(f"trainer failed with exit code {proc.returncode}")
    return events


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket")
    p.add_argument("--size-mib", type=int, default=256, help="approximate training state size")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    args = p.parse_args()
    if args.train:
        return train(args)

    from ckptd.launch import spawn_daemon

    with tempfile.TemporaryDirectory(prefix="ckptd-demo-") as tmp:
        daemon = spawn_daemon(os.path.join(tmp, "root"), os.path.join(tmp, "ckptd.sock"))
        root, sock = str(daemon.root), str(daemon.socket)
        try:
            print(f"ckptd demo: daemon pid {daemon.proc.pid} on {sock}, root {root}")
            print(f"1) training ~{args.size_mib} MiB of state, checkpoint every {args.every} steps, "
                  "killed after 3 commits")
            first = run_trainer(sock, args.size_mib, args.steps, args.every, kill_after_commits=3)
            last = max(e["step"] for e in first if e["event"] == "committed")
            print("2) a fresh trainer restores the latest committed step and trains to the end")
            second = run_trainer(sock, args.size_mib, args.steps, args.every, kill_after_commits=None)
            restored = second[0]["restored"]
            assert restored >= last, f"restored {restored}, expected at least {last}"
            stalls = sorted(e["stall_ms"] for e in first + second if e["event"] == "committed")
            commits = sorted(e["commit_ms"] for e in first + second if e["event"] == "committed")
            print(f"3) summary: resumed at step {restored}; stall per save median {stalls[len(stalls) // 2]:.2f} ms "
                  f"(max {stalls[-1]:.2f}); time to commit median {commits[len(commits) // 2]:.1f} ms")
            print("4) ckptd ls:")
            sys.stdout.flush()
            subprocess.run([sys.executable, "-m", "ckptd", "ls", root], check=True)
        finally:
            daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
