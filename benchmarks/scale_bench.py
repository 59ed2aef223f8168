"""Commit and restore at scale: N simulated ranks over K real daemons, one real TCPStore.

What is real: the daemons (``ckptd serve``, one per simulated node, all on one root), the
TCPStore (its server in a process of its own, so its CPU time is measured alone), and every
rank: a real ``ckptd_client.Checkpointer`` with its own daemon connection, slots, relay thread
and store connection (benchmarks/scale_worker.py; one worker process per daemon holds that
node's ranks). States are tiny (a 16-byte and a 32-byte tensor), so the protocol is the cost.
Each run saves a warm-up step, then (all workers starting together) the measured step, then
every rank restores at once.

Each configuration runs the code under test (``--after``, default this checkout) and, with
``--before DIR`` (a checkout of the previous release), that code, alternating round by round.
Reported per run: last shard durable → index.json written (its mtime), → every handle
resolved, index.json bytes, the index bytes one restoring rank reads (index.json, or the lean
head plus one rank-table block), the all-ranks restore wall time, and the store server's CPU
time while the save was in flight (% of one core).

    flock /tmp/ckptd-bench.lock python benchmarks/scale_bench.py --ranks 1024 --before ../old
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "scale_worker.py"
STORE_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """(wall time, CPU seconds) of one process every 50 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop = pid, threading.Event()
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.time(), cpu_seconds(self.pid)))
            except OSError:
                return
            self.stop.wait(0.05)

    def share(self, t0: float, t1: float) -> float | None:
        """CPU seconds per second between ``t0`` and ``t1`` (nearest samples outside the window)."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after or after[0][0] <= before[-1][0]:
            return None
        return (after[0][1] - before[-1][1]) / (after[0][0] - before[-1][0])


def run_once(code: Path, ranks: int, daemons: int, timeout: float, share_store: bool = False,
             restore: bool = True, keep: Path | None = None) -> dict[str, Any]:
    area = Path(tempfile.mkdtemp(prefix="ckscale-", dir="/tmp"))
    # torch's store server resolves every connecting peer's name on its one thread; this VM's
    # resolver drops replies to bursts of lookups, and glibc retries a lost one after 5 s, which
    # stalls every connect queued behind it (thousands of ranks connecting at start took minutes).
    # A 1 s resolver timeout keeps start-up inside the commit timeout; the commit measured comes
    # after every connection is up, so it changes no figure reported.
    env = {**os.environ, "PYTHONPATH": str(code), "LOCAL_WORLD_SIZE": str(ranks // daemons),
           "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:3")}
    store = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env, text=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert store.stdout is not None
        port = int(store.stdout.readline())
        root = area / "root"
        for i in range(daemons):
            log = open(area / f"d{i}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--socket",
                                           str(area / f"d{i}.sock"), "--log-level", "warning"],
                                          stdout=log, stderr=subprocess.STDOUT, env=env, cwd=code))
        for i in range(daemons):
            while not (area / f"d{i}.sock").exists():
                if procs[i].poll() is not None:
                    raise RuntimeError(f"daemon {i} exited: {(area / f'd{i}.log').read_text()[-2000:]}")
                time.sleep(0.05)
        sampler = CpuSampler(store.pid)
        sampler.start()
        per = ranks // daemons
        workers = [subprocess.Popen([sys.executable, str(WORKER), "--store", f"127.0.0.1:{port}", "--world",
                                     str(ranks), "--ranks", f"{i * per}:{(i + 1) * per}", "--socket",
                                     str(area / f"d{i}.sock"), "--root", str(root), "--steps", "2", "--timeout",
                                     str(timeout), *(["--restore"] if restore else []), "--workers", str(daemons),
                                     *(["--share-store"] if share_store else [])],
                                    stdout=subprocess.PIPE, stderr=open(area / f"w{i}.err", "wb"), env=env, text=True,
                                    cwd=code)
                   for i in range(daemons)]
        lines: list[dict[str, Any]] = []
        for i, w in enumerate(workers):
            out, _ = w.communicate(timeout=timeout * 10)
            if w.returncode != 0:
                raise RuntimeError(f"worker {i} failed: {(area / f'w{i}.err').read_text()[-2000:]}")
            lines += [json.loads(x) for x in out.splitlines()]
        sampler.stop.set()
        steps = [x["steps"][-1] for x in lines]
        errors = [s["error"] for s in steps if s["error"]]
        step_dir = root / "scale" / "step-000000000002"
        index = step_dir / "index.json"
        last_durable = max(s["durable"] for s in steps if s["durable"])
        resolved = max(s["resolved"] for s in steps)
        head = step_dir / "index-head.json"
        fan_in = head.stat().st_size + min(256, ranks) * 48 if head.exists() else index.stat().st_size
        restores = [x["restore"] for x in lines if "restore" in x]
        cpu = sampler.share(min(s["started"] for s in steps), resolved)
        return {"ranks": ranks, "daemons": daemons, "failed_handles": len(errors),
                "first_error": errors[0] if errors else None,
                "durable_to_index_s": round(index.stat().st_mtime - last_durable, 4) if index.exists() else None,
                "durable_to_all_resolved_s": round(resolved - last_durable, 4),
                "index_bytes": index.stat().st_size if index.exists() else None,
                "restore_index_bytes_per_rank": fan_in,
                "restore_all_s": round(max(r.get("ended", 0) for r in restores)
                                       - min(r.get("started", 1e18) for r in restores), 3) if restores else None,
                "restores_ok": sum(1 for r in restores if r.get("ok")),
                "store_cpu_share": None if cpu is None else round(cpu, 3)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        if store.stdin:
            store.stdin.close()
        store.wait()
        if keep is not None:        # the daemons' logs and the workers' stderr, for a run that went wrong
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(area, keep, ignore=shutil.ignore_patterns("root", "*.sock"))
        shutil.rmtree(area, ignore_errors=True)


COLUMNS = [("durable_to_index_s", "last durable → index.json (s)"),
           ("durable_to_all_resolved_s", "→ every handle resolved (s)"),
           ("index_bytes", "index.json (bytes)"),
           ("restore_index_bytes_per_rank", "index bytes read per restoring rank"),
           ("restore_all_s", "all ranks restoring at once (s)"),
           ("store_cpu_share", "store server CPU during the save (cores)"),
           ("failed_handles", "failed handles")]


def markdown(machine: dict[str, Any], results: list[dict[str, Any]], thin: Any,
             issue_before: dict[str, Any] | None = None) -> str:
    """The results as a table per world size: each run's row, then after ÷ before (medians)."""
    lines = ["# Commit and restore at scale", "",
             f"Generated by `benchmarks/scale_bench.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             f"Machine: {machine['cpus']} CPUs, Python {machine['python']}, {machine['platform']}: a shared "
             "2-core VM with other jobs running, so absolute times are noisy; before and after ran in the same "
             "session, alternating. Real daemons (one per simulated node), one real TCPStore (its own process), "
             "every rank a real Checkpointer (benchmarks/scale_worker.py); tiny states. "
             f"{machine.get('note', '')}.", ""]
    for n in sorted({r["ranks"] for r in results}):
        rows = [r for r in results if r["ranks"] == n]
        lines += [f"## {n:,} ranks over {rows[0]['daemons']} daemons", "",
                  "| code | round | " + " | ".join(c for _, c in COLUMNS) + " |",
                  "|---|---|" + "---|" * len(COLUMNS)]
        for r in rows:
            lines.append(f"| {r['code']} | {r['round']} | " + " | ".join(str(r.get(k)) for k, _ in COLUMNS) + " |")
        med = {code: {k: statistics.median(x[k] for x in rows if x["code"] == code and x.get(k) is not None)
                      for k, _ in COLUMNS[:-1]
                      if any(x["code"] == code and x.get(k) is not None for x in rows)}
               for code in ("before", "after")}
        if med["before"] and med["after"]:
            ratios = [f"{med['after'][k] / med['before'][k]:.2f}" if med["before"].get(k) and k in med["after"]
                      else "–" for k, _ in COLUMNS[:-1]]
            lines.append("| **after ÷ before** | | " + " | ".join(ratios) + " | |")
        lines += [""] + [f"Note ({r['code']}): {r['notes']}" for r in rows if r.get("notes")]
        lines.append("")
    if issue_before:
        lines += ["The issue's own measurement of the old relay (its harness, a quieter machine): " + "; ".join(
            f"{int(n):,} ranks: last durable → index.json {b['durable_to_index_s']} s, index.json {b['index_bytes']:,} "
            f"bytes read whole by every restoring rank, all ranks restoring {b['restore_all_s']} s"
            for n, b in issue_before.items()) + ".", ""]
    if thin:
        runs = thin if isinstance(thin, list) else [{"code": "after", "round": 1, **thin}]
        cols = [("last_node_record_to_index_s", "last node record → index.json (s)"),
                ("last_node_record_to_rank0_resolved_s", "→ rank 0 resolved (s)")]
        lines += ["## Commit path only, up to 32,768 ranks (benchmarks/scale_thin.py)", "",
                  "Real: the TCPStore, rank 0's relay code, the daemon's commit code (record parsing, the "
                  "parallel digest check of every real manifest file, tensor map, lean index, fsyncs). "
                  "Simulated: the other ranks (manifests written directly, node leaders' store traffic "
                  "replayed by a thread pool); no socket hop for the COMMIT. "
                  + (runs[0].get("machine", "") + "." if runs[0].get("machine") else ""), "",
                  "| ranks | nodes | code | round | " + " | ".join(c for _, c in cols)
                  + " | index.json (bytes) | index bytes read per restoring rank |", "|---" * 8 + "|"]
        for r in sorted(runs, key=lambda r: (r["ranks"], r["round"], r["code"] != "before")):
            lines.append(f"| {r['ranks']:,} | {r['nodes']:,} | {r['code']} | {r['round']} | "
                         + " | ".join(str(r[k]) for k, _ in cols)
                         + f" | {r['index_bytes']:,} | {r['restore_index_bytes_per_rank']:,} |")
        for n in sorted({r["ranks"] for r in runs}):
            tmed = {code: [statistics.median(r[k] for r in runs if r["ranks"] == n and r["code"] == code)
                          for k, _ in cols] for code in ("before", "after")
                   if any(r["ranks"] == n and r["code"] == code for r in runs)}
            if len(tmed) == 2:
                lines.append(f"| {n:,} | | **after ÷ before** (medians) | | "
                             + " | ".join(f"{a / b:.2f}" for a, b in zip(tmed["after"], tmed["before"], strict=True))
                             + " | | |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1024", help="comma-separated world sizes")
    ap.add_argument("--daemons", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="the Checkpointers' commit_timeout")
    ap.add_argument("--before", type=Path, help="a checkout of the code to compare against")
    ap.add_argument("--after", type=Path, default=REPO,
                    help="the code under test (default this checkout; a snapshot keeps edits out of a long run)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "scale.json")
    ap.add_argument("--share-store", action="store_true",
                    help="the ranks of a worker share one store connection for their short requests (fewer "
                         "connects to set up; each relay still waits on its own clone)")
    ap.add_argument("--no-restore", dest="restore", action="store_false",
                    help="save only: leave out the all-ranks restore (at 4,096 ranks most of a run's time)")
    ap.add_argument("--keep", type=Path, help="copy each run's daemon logs and workers' stderr here (the last run's)")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json and exit")
    a = ap.parse_args()
    if a.markdown_only:
        saved = json.loads(a.out.read_text())
        thin_path = a.out.with_name("scale_thin.json")
        a.out.with_suffix(".md").write_text(
            markdown(saved["machine"], saved["results"], json.loads(thin_path.read_text()) if thin_path.exists()
                     else None, saved.get("issue_before")))
        return 0
    codes = [("after", a.after)] + ([("before", a.before)] if a.before else [])
    results: list[dict[str, Any]] = []
    for n in (int(x) for x in a.ranks.split(",")):
        for rnd in range(a.rounds):
            for name, code in (codes if rnd % 2 == 0 else codes[::-1]):
                t = time.monotonic()
                print(f"[{n} ranks, round {rnd + 1}, {name}] ...", file=sys.stderr, flush=True)
                once = run_once(code, n, a.daemons, a.timeout, a.share_store, a.restore, a.keep)
                res = {"code": name, "round": rnd + 1, **once, "run_s": round(time.monotonic() - t, 1)}
                print(json.dumps(res), file=sys.stderr, flush=True)
                results.append(res)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
               "note": "shared 2-core VM, other jobs running"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    thin_path = a.out.with_name("scale_thin.json")
    thin = json.loads(thin_path.read_text()) if thin_path.exists() else None
    a.out.with_suffix(".md").write_text(markdown(machine, results, thin))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

