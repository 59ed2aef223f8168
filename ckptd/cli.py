"""Command line: ``ckptd serve | ls | verify | status``."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from . import __version__, logs, protocol
from .codec import CODECS, DEFAULT_CHUNK_BYTES
from .format import StepReader, FormatError, list_steps, verify_step, validate_job
from .server import Daemon, DaemonConfig, default_threads
from .writer import WriteSettings


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _age(seconds: float) -> str:
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= div:
            return f"{seconds / div:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_serve(args: argparse.Namespace) -> int:
    logs.setup(args.log_format, args.log_level)
    config = DaemonConfig(
        root=args.root, socket_path=args.socket, threads=args.threads,
        write=WriteSettings(codec=args.codec, level=args.level, chunk_bytes=args.chunk_mib * 1024 * 1024,
                            debug_write_delay=args.debug_write_delay),
        step_timeout=args.step_timeout)
    if args.slot_memory_limit_mib:
        config.slot_memory_limit = args.slot_memory_limit_mib * 1024 * 1024
    daemon = Daemon(config)
    try:
        import uvloop
        uvloop.run(daemon.serve())
    except RuntimeError as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 1
    return 0


def _dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        try:
            total += os.lstat(os.path.join(path, name)).st_size
        except OSError:
            pass
    return total


def cmd_ls(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.root):
        print(f"ckptd ls: {args.root}: no such directory", file=sys.stderr)
        return 2
    jobs = [args.job] if args.job else sorted(
        j for j in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, j)))
    rows = []
    now = time.time()
    for job in jobs:
        try:
            validate_job(job)
        except ValueError as e:
            print(f"ckptd ls: {e}", file=sys.stderr)
            return 2
        for info in list_steps(os.path.join(args.root, job)):
            raw = stored = None
            state = "committed" if info.committed else "uncommitted"
            if info.committed:
                try:
                    index = StepReader(info.path).index
                    raw = sum(r["raw_bytes"] for r in index["ranks"])
                    stored = sum(r["stored_bytes"] for r in index["ranks"])
                except (FormatError, OSError) as e:
                    state = f"invalid ({e})"
            on_disk = _dir_bytes(info.path)
            rows.append({"job": job, "step": info.step, "state": state, "bytes_on_disk": on_disk,
                         "raw_bytes": raw, "stored_bytes": stored,
                         "ratio": round(raw / stored, 3) if raw and stored else None,
                         "age_s": round(now - os.stat(info.path).st_mtime, 1)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no checkpoints")
        return 0
    print(f"{'JOB':20s} {'STEP':>10s} {'STATE':12s} {'ON DISK':>11s} {'RAW':>11s} {'RATIO':>6s} {'AGE':>7s}")
    for r in rows:
        print(f"{r['job'][:20]:20s} {r['step']:>10d} {r['state']:12s} {_size(r['bytes_on_disk']):>11s} "
              f"{_size(r['raw_bytes']) if r['raw_bytes'] is not None else '-':>11s} "
              f"{format(r['ratio'], '.3f') if r['ratio'] else '-':>6} {_age(r['age_s']):>7s}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    faults = verify_step(args.step_dir, progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    for f in faults:
        print(f"FAULT {f}")
    if faults:
        print(f"{args.step_dir}: {len(faults)} fault(s)")
        return 1
    print(f"{args.step_dir}: OK")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        st = protocol.request_once(args.socket, {"op": "status"})
    except (ConnectionError, RuntimeError, protocol.ProtocolError) as e:
        print(f"ckptd status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"daemon pid {st['pid']} version {st['version']} root {st['root']}")
    print(f"slot memory {_size(st['slot_bytes_in_use'])} of {_size(st['slot_memory_limit'])}")
    print("stats " + " ".join(f"{k}={v}" for k, v in st["stats"].items()))
    for s in st["sessions"]:
        print(f"  session job={s['job']} rank={s['rank']}/{s['world_size']} pid={s['pid']} "
              f"slots={s['busy_slots']}/{s['slots']} busy saves={s['saves']}")
    for p in st["steps"]:
        print(f"  in flight job={p['job']} step={p['step']} writing={p['writing']} durable={p['durable']} "
              f"of {p['world_size']} age={p['age_s']}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpoint daemon and tools.")
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon", description="Run the per-node checkpoint daemon.")
    s.add_argument("--root", required=True, help="directory checkpoints are written under")
    s.add_argument("--socket", default=protocol.default_socket_path(),
                   help="unix socket to listen on (default: $CKPTD_SOCKET or %(default)s)")
    s.add_argument("--threads", type=int, default=default_threads(), help="compression threads (default: %(default)s)")
    s.add_argument("--codec", choices=CODECS, default="bplane", help="chunk codec (default: %(default)s)")
    s.add_argument("--level", type=int, default=1, help="zstd level (default: %(default)s)")
    s.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20, help="chunk size in MiB")
    s.add_argument("--step-timeout", type=float, default=600.0,
                   help="seconds a step may wait for all its ranks before it is abandoned (default: %(default)s)")
    s.add_argument("--slot-memory-limit-mib", type=int, default=0,
                   help="total shared-memory slot budget (default: half of RAM)")
    s.add_argument("--debug-write-delay", type=float, default=0.0,
                   help="TEST ONLY: sleep this many seconds before writing each chunk")
    s.add_argument("--log-format", choices=("json", "plain"), default="json")
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("ls", help="list steps", description="List steps, committed or not, with sizes and ratios.")
    s.add_argument("root")
    s.add_argument("job", nargs="?")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("verify", help="check every checksum of a step",
                       description="Verify every manifest digest and chunk checksum; exit 1 on any fault.")
    s.add_argument("step_dir")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("status", help="ask a running daemon", description="Sessions, saves in flight, stats.")
    s.add_argument("--socket", default=protocol.default_socket_path())
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
