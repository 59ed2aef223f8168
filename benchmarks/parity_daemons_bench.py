"""Erasure-coded peer redundancy on real daemons (issue 24, acceptance 4): memory, bytes sent, rebuild.

For each scheme — K = 1 full copy, parity G = 4 / 8 with P = 1 / 2 — ``--nodes`` daemons on loopback
(one shared root, peers of each other) and one rank per node (real processes, relay commit through a
TCPStore) save one step of a ``--mib`` MiB shard each. Once every node's step is replicated (copies)
or protected (parity), each node's status gives:

- extra memory per node: what its memory tier holds beyond its own shard (replicas, parity buffers);
- bytes sent per node for that checkpoint (copies, or data pieces to parity holders).

Then node 1's daemon is SIGKILLed and a fresh daemon takes its place (same peer address, empty
memory); rank 1 restores through it: from a peer's full copy (copies) or rebuilt from the group's
pieces and parity (parity: each stripe decoded at its parity holder, ``reduce_piece``) — the
rebuild time, and every node's bytes in and out over it (status counters) — and once more with
``memory=False`` from storage (page cache warm). Every restore is checked bit-exact. Next to the
measurements, the design's formulas (docs/erasure-coding.md).

On loopback every byte of every node crosses the same two cores, so a rebuild, which moves
(g − P) shards' worth in total, is bound by that sum; on a cluster each node has its own NIC and the
bound is the busiest node's bytes. With ``--nic-mbit N`` (root and ``tc`` needed) the fetch and the
rebuild run once more with every daemon's serving traffic (what leaves its listening port: copies
fetched, pieces, parity, decoded pieces) shaped by HTB on ``lo`` to N Mbit/s per node, emulating
one NIC per node (egress only: ingress is not shaped). Writes benchmarks/results/parity_daemons.md and .json.

    .venv/bin/python benchmarks/parity_daemons_bench.py [--nodes 8] [--mib 64] [--nic-mbit 400]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptd_client  # noqa: E402
from ckptd.core import protocol  # noqa: E402
from ckptd.launch import DaemonProcess, spawn_daemon  # noqa: E402

from common import RESULTS, fmt, free_port, machine_info, table, write_results  # noqa: E402

JOB, STEP = "par", 1
SCHEMES: list[tuple[str, tuple[str, ...], int, int]] = [     # name, daemon flags, G, P (G = 0: copies)
    ("copies K = 1", ("--peer-replicas", "1"), 0, 0),
    ("parity G = 4, P = 1", ("--peer-redundancy", "parity", "--peer-group", "4", "--peer-parity", "1"), 4, 1),
    ("parity G = 8, P = 1", ("--peer-redundancy", "parity", "--peer-group", "8", "--peer-parity", "1"), 8, 1),
    ("parity G = 4, P = 2", ("--peer-redundancy", "parity", "--peer-group", "4", "--peer-parity", "2"), 4, 2),
    ("parity G = 8, P = 2", ("--peer-redundancy", "parity", "--peer-group", "8", "--peer-parity", "2"), 8, 2),
]
RANK = textwrap.dedent("""
    import sys, torch, ckptd_client
    from datetime import timedelta
    sock, rank, world, port, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=300))
    ck = ckptd_client.Checkpointer("par", socket=sock, rank=rank, world_size=world, store=store, commit="relay",
                                   commit_timeout=300)
    g = torch.Generator().manual_seed(rank)
    ck.save(1, {"w": torch.randn(mib * 2**18, generator=g)}).wait(300)
    ck.close()
    store.set(f"done{rank}", "1")
    if rank == 0:
        store.wait([f"done{r}" for r in range(world)], timedelta(seconds=300))
""")


def status(d: DaemonProcess) -> dict[str, Any]:
    return protocol.request_once(str(d.socket), {"op": "status"})["memory"]


def ready(d: DaemonProcess, parity: bool) -> bool:
    return any(s["step"] == STEP and s["committed"] and (s.get("protected") if parity else s["replicated"])
               for s in status(d)["held"])


def wait(cond: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


COUNTERS = ("rebuild_received_bytes", "reduce_fetched_bytes", "pieces_served_bytes", "replicated_bytes")


def counters(nodes: list[DaemonProcess]) -> list[dict[str, int]]:
    out = []
    for d in nodes:
        st = status(d)
        out.append({c: int(st.get(c, 0)) for c in COUNTERS})
    return out


def tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True)


@contextlib.contextmanager
def shaped(ports: list[int], mbit: int) -> Iterator[None]:
    """Each port's outgoing traffic on ``lo`` (what its daemon serves) capped at ``mbit`` Mbit/s, one HTB
    class per port, like one NIC per node."""
    tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "999")
    try:
        tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:999", "htb", "rate", "100gbit")
        for i, port in enumerate(ports, 1):
            tc("class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{i}", "htb", "rate", f"{mbit}mbit",
               "burst", "256k", "cburst", "256k")
            tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "u32", "match", "ip", "sport",
               str(port), "0xffff", "flowid", f"1:{i}")
        yield
    finally:
        tc("qdisc", "del", "dev", "lo", "root")


def can_shape() -> bool:
    return os.geteuid() == 0 and shutil.which("tc") is not None


def restore_time(d: DaemonProcess, mib: int, memory: bool) -> tuple[float, str]:
    want = {"w": torch.randn(mib * 2**18, generator=torch.Generator().manual_seed(1))}
    target = {"w": torch.zeros_like(want["w"])}
    ck = ckptd_client.Checkpointer(JOB, socket=str(d.socket), rank=1, world_size=NODES, memory=memory)
    t0 = time.perf_counter()
    assert ck.restore(target, step=STEP) == STEP
    took = time.perf_counter() - t0
    assert torch.equal(target["w"], want["w"]), "restored bytes differ"
    source = ck.last_restore.source if ck.last_restore else "?"
    ck.close()
    return took, source


def run_scheme(name: str, flags: tuple[str, ...], g: int, p: int, mib: int, base: Path,
               nic: int | None) -> dict[str, Any]:
    area = Path(tempfile.mkdtemp(prefix="ckpar-", dir=base))
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(NODES)]
    secret = area / "secret"
    secret.write_text("s3cret-shared-by-every-node-0123456789")
    secret.chmod(0o600)
    peer = ["--peer-secret-file", str(secret), *[x for a in addrs for x in ("--peer", a)], "--memory-budget", "8GiB"]
    nodes = [spawn_daemon(area / "root", area / f"n{i}.sock", "--peer-listen", a, *peer, *flags)
             for i, a in enumerate(addrs)]
    fresh: DaemonProcess | None = None
    try:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(nodes[r].socket), str(r), str(NODES), str(port),
                                   str(mib)], env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(NODES)]
        for pr in procs:
            if pr.wait(600) != 0:
                raise RuntimeError(f"{name}: a rank failed")
        t0 = time.perf_counter()        # every rank's handle committed (and its process gone)
        for d in nodes:
            wait(lambda: ready(d, g > 0), f"{name}: {d.socket} step protected/replicated")  # noqa: B023
        protect_s = time.perf_counter() - t0
        shard = mib * 2**20
        per_node = []
        for d in nodes:
            st = status(d)
            own = sum(r["bytes"] for s in st["held"] for r in s["ranks"].values() if r["origin"] == "local")
            sent = st["parity_sent_bytes"] if g else st["replicated_bytes"]
            per_node.append({"extra": st["used_bytes"] - own, "sent": sent})
        extra = sum(n["extra"] for n in per_node) / NODES
        sent = sum(n["sent"] for n in per_node) / NODES
        nodes[1].kill()
        survivors = [d for i, d in enumerate(nodes) if i != 1]
        fresh = spawn_daemon(area / "root", area / "fresh.sock", "--peer-listen", addrs[1], *peer, *flags)
        before = counters(survivors)
        rebuild_s, source = restore_time(fresh, mib, memory=True)
        moved = [{c: a[c] - b[c] for c in COUNTERS} for a, b in zip(counters(survivors), before, strict=True)]
        # the replacement's ingress: decoded pieces (parity) or the one copy it fetched (copies)
        ingress = counters([fresh])[0]["rebuild_received_bytes"] if g else shard
        egress = max(m["pieces_served_bytes"] for m in moved) if g else shard
        fetched = max(m["reduce_fetched_bytes"] for m in moved) if g else 0
        storage_s, storage_source = restore_time(fresh, mib, memory=False)
        nic_s = None
        if nic:
            fresh.stop(30)
            fresh = spawn_daemon(area / "root", area / "fresh2.sock", "--peer-listen", addrs[1], *peer, *flags)
            with shaped([int(a.rsplit(":", 1)[1]) for a in addrs], nic):
                nic_s, _ = restore_time(fresh, mib, memory=True)
        formula = 1.0 if g == 0 else p / (g - p)
        return {"scheme": name, "g": g, "p": p, "shard_bytes": shard, "extra_per_node": extra,
                "extra_per_shard": extra / shard, "formula_extra_per_shard": formula, "sent_per_node": sent,
                "sent_per_shard": sent / shard, "formula_sent_per_shard": 1.0 if g == 0 else float(p),
                "protect_s": protect_s, "rebuild_s": rebuild_s, "rebuild_source": source, "storage_s": storage_s,
                "storage_source": storage_source, "ingress_per_shard": ingress / shard,
                "max_egress_per_shard": egress / shard, "max_holder_fetch_per_shard": fetched / shard,
                "total_moved_per_shard": (ingress + sum(m["reduce_fetched_bytes"] for m in moved)) / shard
                if g else 1.0, "nic_mbit": nic, "nic_s": nic_s}
    finally:
        for d in [*nodes, *([fresh] if fresh else [])]:
            if d.proc.poll() is None:
                d.stop(30)


def to_markdown(res: dict[str, Any]) -> str:
    rows = res["schemes"]
    copy = next(r for r in rows if r["g"] == 0)
    m = res["machine"]
    out = [
        "# Erasure-coded peer redundancy on real daemons: memory, bytes sent, rebuild",
        "",
        f"Generated by `benchmarks/parity_daemons_bench.py` on {res['when']} in {res['wall_s']:.0f} s. Machine: "
        f"{m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB RAM, Linux {m['kernel']}; every "
        f"daemon and rank on this one machine, peers over loopback.",
        "",
        f"{res['nodes']} daemons (one shared root), one rank per node, a {res['mib']} MiB shard each (fp32), one "
        "relayed commit; then node 1's daemon SIGKILLed and a fresh one started in its place, through which rank 1 "
        "restores (from a peer's full copy, or rebuilt from its group's pieces and parity), then from storage "
        "(`memory=False`, page cache warm). Every restore bit-exact. Formulas: docs/erasure-coding.md.",
        "",
        table(["scheme", "extra memory per node ÷ shard (measured)", "(formula)", "÷ K = 1 copy",
               "sent per node ÷ shard (measured)", "(formula)", "then until protected / replicated on every node",
               "rebuild / fetch of rank 1", "÷ full-copy fetch", "storage restore"],
              [[r["scheme"], fmt(r["extra_per_shard"], 3), fmt(r["formula_extra_per_shard"], 3),
                fmt(r["extra_per_shard"] / copy["extra_per_shard"], 3), fmt(r["sent_per_shard"], 3),
                fmt(r["formula_sent_per_shard"], 1), fmt(r["protect_s"], 2, " s"),
                f"{fmt(r['rebuild_s'], 3, ' s')} ({r['rebuild_source']})", fmt(r["rebuild_s"] / copy["rebuild_s"], 2),
                fmt(r["storage_s"], 3, " s")] for r in rows]),
        "",
    ]
    nic = res.get("nic_mbit")
    out += [
        "Rebuild traffic (parity: each stripe's lost piece decoded at one of its parity holders and sent to the "
        "replacement; measured from every node's status counters over the restore), and the same fetch and "
        "rebuild " + (f"with every node's serving egress shaped to {nic} Mbit/s (HTB on `lo`, one class per "
                      "daemon's listening port: an emulated NIC per node; ingress not shaped)." if nic else
                      "(no emulated-NIC run: it needs root and tc)."),
        "",
        table(["scheme", "replacement's ingress ÷ shard", "busiest survivor's egress ÷ shard",
               "busiest holder's fetches ÷ shard", "all bytes moved ÷ shard", "loopback ÷ full-copy fetch",
               "emulated NIC", "÷ full-copy fetch (NIC)"],
              [[r["scheme"], fmt(r["ingress_per_shard"], 3), fmt(r["max_egress_per_shard"], 3),
                fmt(r["max_holder_fetch_per_shard"], 3), fmt(r["total_moved_per_shard"], 3),
                fmt(r["rebuild_s"] / copy["rebuild_s"], 2),
                fmt(r["nic_s"], 3, " s") if r.get("nic_s") else "—",
                fmt(r["nic_s"] / copy["nic_s"], 2) if r.get("nic_s") and copy.get("nic_s") else "—"] for r in rows]),
        "",
        "On loopback all daemons share two cores, so a rebuild is bound by all bytes moved ((g − P) shards' worth, "
        "the code's floor); with a NIC per node it is bound by the busiest node's, about one shard.",
        "",
    ]
    g8 = next((r for r in rows if r["g"] == 8 and r["p"] == 1), None)
    if g8:
        mem = g8["extra_per_shard"] / copy["extra_per_shard"]
        loop = max(r["rebuild_s"] / copy["rebuild_s"] for r in rows if r["g"])
        line = (f"Targets: parity G = 8, P = 1 holds {mem:.3f}× the memory of K = 1 (target ≤ 0.15×: "
                f"{'met' if mem <= 0.15 else 'not met'}). Rebuild ÷ full-copy fetch, slowest scheme: {loop:.2f}× on "
                "loopback (two shared cores)")
        if copy.get("nic_s") and all(r.get("nic_s") for r in rows):
            reb = max(r["nic_s"] / copy["nic_s"] for r in rows if r["g"])
            line += f", {reb:.2f}× with a {nic} Mbit/s NIC per node (target ≤ 2×: {'met' if reb <= 2 else 'not met'})"
        out.append(line + ".")
    return "\n".join(out) + "\n"


NODES = 8


def main() -> None:
    global NODES
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS / "parity_daemons")
    ap.add_argument("--nic-mbit", type=int, default=400,
                    help="per-node egress cap for the emulated-NIC rerun (0: skip it; needs root and tc)")
    a = ap.parse_args()
    nic = a.nic_mbit if a.nic_mbit and can_shape() else None
    if a.nic_mbit and nic is None:
        print("no emulated-NIC run: it needs root and tc", flush=True)
    NODES = a.nodes
    t0 = time.time()
    base = Path(tempfile.mkdtemp(prefix="ckparb-", dir="/tmp"))
    rows = []
    for name, flags, g, p in SCHEMES:
        if g <= a.nodes:
            rows.append(run_scheme(name, flags, g, p, a.mib, base, nic))
            print(rows[-1], flush=True)
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": time.time() - t0, "nodes": a.nodes,
           "mib": a.mib, "nic_mbit": nic, "machine": machine_info("/tmp"), "schemes": rows}
    write_results(a.out, res, to_markdown(res))


if __name__ == "__main__":
    main()
