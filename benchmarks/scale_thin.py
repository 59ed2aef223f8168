"""The commit's critical path at 32,768 ranks, with cheap simulated ranks (one machine cannot run
32,768 Checkpointers).

Real: the TCPStore (its server in a process of its own), rank 0's ``StoreRelay`` (the shipped
relay code: its node-0 gather, its blocking wait for the node count, the chunked ``multi_get``,
the parse of every rank's outcome), the daemon's commit code (``parse_record`` of every record
as the server does, then ``commit.write_index``: the manifests of the check ranks the relay
names — one per node; every rank's with ``--check-all`` — checked on disk with its thread
pool, the tensor map built from the records, the lean side files and index.json written and
fsynced) and 32,768 real manifest files; the COMMIT frame's codec (rank 0's encoding of it, the
daemon's decoding and request parse, in this process: ``--no-frame`` leaves them out, as before
2026-12-05). Simulated: the other ranks — their
manifests are written straight to the step directory (no daemon, no fsync), their records come
from ``rank_record.summarize`` and their node leaders' store traffic (``set`` of the node
record, ``add``, ``set`` of ready) is issued by a thread pool, as relay.py's ``_publish_node``
did before 2026-12-05 (rank 0 now reads the node records as they come and no longer needs the
count and ready key: they are kept so that one script drives the trees before and after). The
COMMIT runs in-process (no socket: its frame is encoded and decoded
here, 10 MB at 32,768 ranks, but not sent). Reported: last node record
published → index.json written, → rank 0 resolved; index bytes; what one restoring rank reads.

    flock /tmp/ckptd-bench.lock python benchmarks/scale_thin.py --ranks 32768
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckptd.core import protocol
from ckptd.core.codec import ChunkMeta
from ckptd.core.gc_pause import gc_paused
from ckptd.core.names import HEAD_NAME, INDEX_NAME, rank_data_name, rank_manifest_name, step_dir
from ckptd.core.rank_record import parse_records, summarize
from ckptd.core.reader import StepReader
from ckptd.core.relay_record import NodeRecord, RankOutcome
from ckptd.core.schema import Manifest, TensorEntry, digest_bytes, encode_json
from ckptd.daemon.tiers.fs.commit import write_index
from ckptd_client import store_keys
from ckptd_client.relay import StoreRelay
from ckptd_client.run_scope import FixedRun

from scale_bench import STORE_SERVER


def tiny_manifest(job: str, step: int, rank: int, world: int) -> Manifest:
    """A rank's manifest as the daemon writes it for the scale worker's state (two small tensors)."""
    w = TensorEntry("w", "float32", [4], 0, [ChunkMeta("none", 16, 16, f"{rank:016x}", [[16, "r"]])])
    shared = TensorEntry("shared", "float32", [8], 16, [ChunkMeta("none", 32, 32, "00000000000000aa", [[32, "r"]])])
    tree = {"d": [["w", {"T": "w"}], ["shared", {"T": "shared"}], ["step", step]]}
    return Manifest(job, step, rank, world, [w, shared], tree, 48, 48)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=32768)
    ap.add_argument("--node-size", type=int, default=8)
    ap.add_argument("--check-all", action="store_true",
                    help="read back every manifest at commit (before: the relay named no check ranks)")
    ap.add_argument("--no-frame", dest="frame", action="store_false",
                    help="hand the relay's records to the commit as they are (no COMMIT frame encoded and decoded)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="cProfile the COMMIT (frame, record parse, write_index) into this text file")
    ap.add_argument("--machine", default="shared 2-core VM, other jobs running", help="a note on the machine")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "scale_thin.json")
    a = ap.parse_args()
    n, job, step = a.ranks, "scale", 1
    area = Path(tempfile.mkdtemp(prefix="ckthin-", dir="/tmp"))
    store_proc = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    try:
        assert store_proc.stdout is not None
        port = int(store_proc.stdout.readline())
        path = Path(step_dir(str(area / "root"), job, step))
        path.mkdir(parents=True)
        t = time.monotonic()
        outcomes = []
        for r in range(n):       # the shards the other daemons made durable (no fsync: set-up, not measured)
            data = encode_json(tiny_manifest(job, step, r, n).to_json())
            (path / rank_manifest_name(r)).write_bytes(data)
            (path / rank_data_name(r)).write_bytes(bytes(48))
            rec = summarize(tiny_manifest(job, step, r, n), digest_bytes(data))
            outcomes.append(RankOutcome.ok(rec.digest, rec.to_json()))
        setup_s = time.monotonic() - t

        def store() -> Any:
            return dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=timedelta(seconds=300),
                                 wait_for_workers=False)
        done = threading.Event()
        commit_called: list[float] = []
        resolved: list[Any] = []

        def commit(step_: int, digests: dict[int, str], records: list[Any] | None, timeout: float,
                   check: list[int]) -> None:
            assert records is not None
            commit_called.append(time.time())
            if a.profile is None:
                return commit_now(step_, digests, records, check)
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            try:
                return commit_now(step_, digests, records, check)
            finally:
                prof.disable()
                with open(a.profile, "w") as f:
                    stats = pstats.Stats(prof, stream=f)
                    stats.sort_stats("cumulative").print_stats(50)
                    stats.sort_stats("tottime").print_stats(30)

        def commit_now(step_: int, digests: dict[int, str], records: list[Any], check: list[int]) -> None:
            if a.frame:     # rank 0's session encodes the COMMIT; the daemon's session decodes and parses it
                wire = protocol.to_wire(protocol.Commit(step=step_, digests={str(r): d for r, d in digests.items()},
                                                        records=records, check=check), 1)
                frame = protocol.encode(wire)
                del wire, records
                _, req = protocol.parse_request(protocol.decode_body(frame[protocol.HEADER.size:]))
                assert isinstance(req, protocol.Commit)
                records = req.records
            with gc_paused():                    # as the daemon's server does (requests.py, commit)
                parsed = parse_records(records)
                write_index(str(path), job, step_, n, digests, None, parsed, None if a.check_all else check)
                del parsed

        run = FixedRun(uuid.uuid4().hex)
        scope = store_keys.scope(job, run.run)
        relay = StoreRelay(store(), job, 0, n, 300.0, commit, lambda s, r: None,
                           lambda s: (path / INDEX_NAME).exists(), node_size=a.node_size, run=run)
        def on_resolved(err: str | None) -> None:
            resolved.append((time.time(), err))
            done.set()
        relay.claim(step)
        relay.track(step, on_resolved)
        relay.publish(step, outcomes[0])
        nodes = -(-n // a.node_size)
        clients = [store() for _ in range(8)]
        for r in range(1, a.node_size):          # node 0's other ranks
            clients[0].set(store_keys.rank_outcome(scope, step, r), outcomes[r].encode())
        last = [0.0]
        lock = threading.Lock()

        def publish_node(node: int) -> None:
            c = clients[node % len(clients)]
            members = tuple(outcomes[node * a.node_size: (node + 1) * a.node_size])
            c.set(store_keys.node_record(scope, step, node), NodeRecord(node * a.node_size, members).encode())
            if c.add(f"{scope}/s{step}/nodes", 1) == nodes:     # (the keys trees before 2026-12-05 wait on)
                c.set(f"{scope}/s{step}/ready", "1")
            with lock:
                last[0] = max(last[0], time.time())
        time.sleep(2.0)          # rank 0's relay is waiting (its clone made) before nodes publish
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(publish_node, range(1, nodes)))
        done.wait(300)
        t_resolved, err = resolved[0]
        index = path / INDEX_NAME
        reader = StepReader(str(path))
        reader.rank_entry(n - 1)
        res = {"ranks": n, "nodes": nodes, "error": err, "setup_s": round(setup_s, 1),
               "last_node_record_to_index_s": round(index.stat().st_mtime - last[0], 3),
               "last_node_record_to_rank0_resolved_s": round(t_resolved - last[0], 3),
               # rank 0's gather: what of fetching and decoding the node records is left after the last one
               "last_node_record_to_commit_call_s": round(commit_called[0] - last[0], 3),
               "index_bytes": index.stat().st_size,
               "restore_index_bytes_per_rank": (path / HEAD_NAME).stat().st_size + 256 * 48,
               "frame": a.frame, "machine": a.machine}
        print(json.dumps(res))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
        relay.close()
    finally:
        if store_proc.stdin:
            store_proc.stdin.close()
        store_proc.wait()
        shutil.rmtree(area, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
