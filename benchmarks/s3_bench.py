"""The object-storage tier against a local SeaweedFS: upload throughput and commit-to-bucket time.

1. Upload throughput: the same file uploaded by the daemon's client (``Bucket.upload_file``:
   obstore multipart, ``part_size`` parts, ``concurrency`` in flight) and by boto3's
   ``upload_file`` with the same part size and concurrency; methods interleaved round by round;
   reported as the ratio ckptd / boto3 (≥ 1: ckptd's uploads are at least as fast).
2. Local commit → bucket commit: a daemon with the S3 tier saves a state of ``--commit-mib``; the
   daemon's own ``last_seconds`` (local index.json published → bucket index.json written) is
   taken, and the peer is boto3 ``upload_file`` of the same step's files one after the other
   (after a warm-up round that is not counted: SeaweedFS grows its first volumes).

Run: ``make bench-s3`` (under ``flock /tmp/ckptd-bench.lock``). Writes benchmarks/results/s3.md/.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
import torch
from boto3.s3.transfer import TransferConfig

import ckptd_client
from ckptd.core import protocol
from ckptd.daemon.settings.s3 import S3Settings
from ckptd.daemon.tiers.s3.bucket import Bucket
from ckptd.launch import spawn_daemon
from ckptd.s3_local import start_seaweed

from common import RESULTS, fmt, machine_info, median, table, write_results

MiB = 1 << 20


def boto_client(endpoint: str, env: dict[str, str]) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def throughput(bucket: Bucket, s3: Any, name: str, path: Path, rounds: int, part: int, conc: int
               ) -> dict[str, list[float]]:
    size = path.stat().st_size
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    out: dict[str, list[float]] = {"ckptd": [], "boto3": []}
    for r in range(-1, rounds):         # round -1: warm-up, not counted
        order = ["ckptd", "boto3"] if r % 2 == 0 else ["boto3", "ckptd"]
        for method in order:
            t0 = time.perf_counter()
            if method == "ckptd":
                bucket.upload_file(str(path), f"tp/ckptd-{r}")
            else:
                s3.upload_file(str(path), name, f"ckpt/tp/boto3-{r}", Config=cfg)
            rate = size / MiB / (time.perf_counter() - t0)
            print(f"  round {r} {method}: {rate:.0f} MiB/s" + (" (warm-up)" if r < 0 else ""), flush=True)
            if r >= 0:
                out[method].append(rate)
    return out


def commit_to_bucket(srv: Any, name: str, s3: Any, work: Path, mib: int, rounds: int, part: int, conc: int
                     ) -> dict[str, list[float]]:
    env = srv.env()
    d = spawn_daemon(work / "root", work / "d.sock", "--codec", "none", "--s3-url", f"s3://{name}/ckpt",
                     "--s3-endpoint", srv.endpoint, "--s3-part-size", f"{part // MiB}MiB",
                     "--s3-concurrency", str(conc), "--slot-memory-limit", f"{3 * mib}MiB", env=env)
    out: dict[str, list[float]] = {"ckptd": [], "boto3": []}
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)
    try:
        ck = ckptd_client.Checkpointer("bench", socket=str(d.socket))
        state = {"w": torch.randn(mib * MiB // 4)}
        for r in range(-1, rounds):       # round -1: warm-up (the server grows its first volumes), not counted
            step = r + 2
            ck.save(step, state).wait(600)
            while True:
                up = protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["jobs"].get("bench", {})
                if up.get("in_bucket") == step:
                    break
                time.sleep(0.05)
            step_path = work / "root" / "bench" / f"step-{step:012d}"
            t0 = time.perf_counter()
            for f in sorted(step_path.iterdir(), key=lambda p: p.name == "index.json"):
                s3.upload_file(str(f), name, f"peer/step-{step}/{f.name}", Config=cfg)
            if r < 0:
                continue
            out["ckptd"].append(up["last_seconds"])
            out["boto3"].append(time.perf_counter() - t0)
            print(f"  round {r}: ckptd commit→bucket {up['last_seconds']:.2f}s, boto3 upload "
                  f"{time.perf_counter() - t0:.2f}s", flush=True)
        ck.close()
    finally:
        d.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="file size of the throughput comparison")
    p.add_argument("--commit-mib", type=int, default=1024, help="state size of the commit-to-bucket timing")
    p.add_argument("--rounds", type=int, default=4,
                   help="measured rounds, each client first in half of them (after one warm-up round)")
    p.add_argument("--commit-rounds", type=int, default=3, help="after one warm-up round")
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS / "s3"))
    a = p.parse_args()
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="ckptd-s3-bench-"))
    part = a.part_mib * MiB
    srv = start_seaweed(work / "seaweed")
    try:
        env = srv.env()
        s3 = boto_client(srv.endpoint, env)
        name = "bench"
        s3.create_bucket(Bucket=name)
        bucket = Bucket(S3Settings(url=f"s3://{name}/ckpt", endpoint=srv.endpoint, part_size=part,
                                   concurrency=a.concurrency), env)
        blob = work / "blob"
        with open(blob, "wb") as f:
            for _ in range(a.mib):
                f.write(os.urandom(MiB))
        print(f"upload throughput, {a.mib} MiB file, {a.rounds} interleaved rounds", flush=True)
        tp = throughput(bucket, s3, name, blob, a.rounds, part, a.concurrency)
        blob.unlink()
        print(f"local commit -> bucket commit, {a.commit_mib} MiB state", flush=True)
        cb = commit_to_bucket(srv, name, s3, work, a.commit_mib, a.commit_rounds, part, a.concurrency)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    ratio = median(tp["ckptd"]) / median(tp["boto3"])
    res: dict[str, Any] = {"throughput_mib_s": tp, "commit_to_bucket_s": cb, "upload_ratio_ckptd_over_boto3": ratio,
           "args": vars(a), "machine": machine_info(tempfile.gettempdir()), "wall_s": time.perf_counter() - t_start}
    md = "\n\n".join([
        "# Object-storage tier: ckptd (obstore) vs boto3 against a local SeaweedFS",
        f"Shared 2-core VM (other jobs running; load at start {res['machine']['loadavg_at_start']}), SeaweedFS "
        f"on loopback on the same machine, part size {a.part_mib} MiB, concurrency {a.concurrency}; "
        "methods interleaved round by round; medians.",
        table(["measure", "ckptd", "boto3", "ratio"], [
            [f"upload throughput, {a.mib} MiB file (MiB/s)", fmt(median(tp["ckptd"]), 0), fmt(median(tp["boto3"]), 0),
             fmt(ratio, 2) + " (ckptd / boto3)"],
            [f"local commit → bucket commit, {a.commit_mib} MiB state (s)", fmt(median(cb["ckptd"]), 2),
             fmt(median(cb["boto3"]), 2) + " (upload_file of the step's files)",
             fmt(median(cb["boto3"]) / median(cb["ckptd"]), 2) + " (boto3 / ckptd)"],
        ])])
    write_results(Path(a.out), res, md)


if __name__ == "__main__":
    main()
