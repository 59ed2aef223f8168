"""`make demo-s3`: the object-storage tier end to end, on one machine.

Starts a local SeaweedFS (S3 API on loopback), creates a bucket, runs a daemon whose committed
steps are uploaded to it, trains a small model saving every few steps, shows ``ckptd ls`` with
each step's tiers, then deletes the node's local root (the spot node is gone), starts a fresh
daemon on an empty root and restores the newest step from the bucket.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import torch

import ckptd_client
from ckptd.core import protocol
from ckptd.launch import spawn_daemon
from ckptd.s3_local import start_seaweed


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ckptd-demo-s3-"))
    srv = start_seaweed(work / "seaweed")
    print(f"SeaweedFS S3 API on {srv.endpoint}", flush=True)
    daemons = []
    try:
        env = srv.env()
        boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1"
                     ).create_bucket(Bucket="demo")
        s3 = ("--s3-url", "s3://demo/ckpt", "--s3-endpoint", srv.endpoint)
        d = spawn_daemon(work / "node-a", work / "a.sock", *s3, env=env)
        daemons.append(d)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = {"model": model, "optim": opt, "step": 0}
        ckpt = ckptd_client.Checkpointer("demo", socket=str(d.socket))
        x = torch.randn(16, 512)
        for step in range(1, 13):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] = step
            if step % 4 == 0:
                ckpt.save(step, state).wait()
                print(json.dumps({"event": "committed locally", "step": step}), flush=True)
        ckpt.close()
        while True:
            up = protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["jobs"]["demo"]
            if up["in_bucket"] == 12:
                break
            time.sleep(0.1)
        print(json.dumps({"event": "committed in the bucket", "step": 12,
                          "local_commit_to_bucket_commit_s": round(up["last_seconds"], 3)}), flush=True)
        cli_env = {**os.environ, **env, "CKPTD_S3_URL": "s3://demo/ckpt", "CKPTD_S3_ENDPOINT": srv.endpoint,
                   "CKPTD_SOCKET": str(d.socket)}
        subprocess.run([sys.executable, "-m", "ckptd", "ls", str(work / "node-a")], env=cli_env, check=True)
        d.stop()
        shutil.rmtree(work / "node-a")
        print("node-a's local root deleted; a fresh daemon on node-b restores from the bucket", flush=True)
        subprocess.run([sys.executable, "-m", "ckptd", "ls", "s3://demo/ckpt"], env=cli_env, check=True)
        fresh = spawn_daemon(work / "node-b", work / "b.sock", *s3, env=env)
        daemons.append(fresh)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(1)
        model2 = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
        state2 = {"model": model2, "optim": torch.optim.AdamW(model2.parameters(), lr=1e-3), "step": 0}
        got = ckptd_client.Checkpointer("demo", socket=str(fresh.socket)).restore(state2)
        same = all(torch.equal(want[k], v) for k, v in model2.state_dict().items())
        print(json.dumps({"event": "restored from the bucket", "step": got, "bit_exact": same}), flush=True)
        return 0 if same and got == 12 else 1
    finally:
        for dd in daemons:
            dd.stop()
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
