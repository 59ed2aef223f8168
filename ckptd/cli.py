"""Command line: ``ckptd serve | ls | verify | status | gc``."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ckptd import __version__

from ckptd.daemon import logs

from ckptd.core import protocol

from ckptd.daemon import systemd
from ckptd.core.codec import CODECS, DEFAULT_CHUNK_BYTES
from ckptd.daemon.config import DEFAULT_CONFIG_PATH, LOG_FORMATS, LOG_LEVELS, ConfigError, load_settings
from ckptd.core.reader import StepReader, list_steps, verify_step
from ckptd.core.names import validate_job
from ckptd.core.protocol import DEFAULT_SOCKET
from ckptd.daemon.retention import RetentionPolicy, collect_root
from ckptd.daemon.server import Daemon, describe_error, tune_allocator


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


# serve flag → config key; a flag the user did not give is None and does not override.
_SERVE_FLAGS = {
    "root": "root", "socket": "socket", "socket_mode": "socket_mode", "socket_group": "socket_group",
    "allow_user": "allowed_users", "allow_group": "allowed_groups", "threads": "threads", "codec": "codec",
    "level": "level", "step_timeout": "step_timeout", "drain_grace": "drain_grace",
    "slot_memory_limit": "slot_memory_limit", "keep_last": "retention.keep_last",
    "keep_every": "retention.keep_every", "abandoned_after": "retention.abandoned_after",
    "metrics_address": "metrics.address", "log_format": "log_format", "log_level": "log_level",
}


def _cli_overrides(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            out[key] = value
    if getattr(args, "chunk_mib", None) is not None:
        out["chunk_size"] = args.chunk_mib * 1024 * 1024
    if getattr(args, "slot_memory_limit_mib", None):
        out["slot_memory_limit"] = args.slot_memory_limit_mib * 1024 * 1024
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, cli=_cli_overrides(args, _SERVE_FLAGS))
    except ConfigError as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        print(settings.render())
        return 0
    logs.setup(settings["log_format"], settings["log_level"])
    for w in settings.warnings:
        logging.getLogger("ckptd").warning(w)
    config = settings.to_daemon_config(debug_write_delay=args.debug_write_delay)
    try:
        listen_sock = systemd.listen_socket()
    except systemd.ActivationError as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 1
    tune_allocator()
    daemon = Daemon(config)
    try:
        import uvloop
        uvloop.run(daemon.serve(listen_sock))
    except (RuntimeError, OSError) as e:
        print(f"ckptd serve: {describe_error(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 1
    log = logging.getLogger("ckptd")
    if daemon.unfinished:
        # Writer threads of unfinished saves cannot be interrupted and must not be waited for:
        # their steps stay uncommitted (no index.json) and are collected as abandoned later.
        log.error("exiting with saves left uncommitted", extra={"ctx": {"unfinished": daemon.unfinished}})
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    log.info("stopped", extra={"ctx": {"steps_committed": daemon.stats["steps_committed"]}})
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, cli=_cli_overrides(args, _GC_FLAGS), require_root=False)
    except ConfigError as e:
        print(f"ckptd gc: {e}", file=sys.stderr)
        return 2
    root = args.root or settings["root"]
    if not root:
        print("ckptd gc: give ROOT (or root in the config file)", file=sys.stderr)
        return 2
    policy = RetentionPolicy(settings["retention.keep_last"], settings["retention.keep_every"],
                             settings["retention.abandoned_after"])
    try:
        for job in args.job or []:
            validate_job(job)
        result = collect_root(root, policy, dry_run=args.dry_run, jobs=args.job or None)
    except (OSError, ValueError) as e:
        print(f"ckptd gc: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"dry_run": args.dry_run,
                          "actions": [{"job": a.job, "step": a.step, "path": a.path, "kind": a.kind,
                                       "removed": a.done, "error": a.error} for a in result.actions],
                          "kept": [{"job": j, "step": st, "why": why} for j, st, why in result.kept],
                          "skipped": result.skipped}, indent=1))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for a in result.actions:
            if a.error:
                print(f"FAILED {a.describe()}: {a.error}")
            elif a.done or args.dry_run:
                print(f"{verb} {a.describe()}")
        if args.verbose:
            for job, step, why in result.kept:
                print(f"kept {job} step {step}: {why}")
        for sk in result.skipped:
            print(f"skipped {sk}")
        n = len(result.actions) if args.dry_run else len(result.removed)
        print(f"{verb} {n} step(s), kept {len(result.kept)}"
              + (f", {len(result.errors)} failed" if result.errors else ""))
    return 1 if result.errors else 0


_GC_FLAGS = {"keep_last": "retention.keep_last", "keep_every": "retention.keep_every",
             "abandoned_after": "retention.abandoned_after"}


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
                except (ValueError, OSError) as e:      # FormatError, or a file over its size limit
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
    try:
        faults = verify_step(args.step_dir, progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    except (ValueError, OSError, EOFError) as e:     # e.g. an index or manifest over its size limit
        faults = [str(e)]
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
    except (ConnectionError, RuntimeError, protocol.ProtocolError, OSError) as e:
        print(f"ckptd status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"daemon pid {st['pid']} version {st['version']} root {st['root']}"
          + (" (draining)" if st.get("draining") else ""))
    if st.get("socket"):
        print(f"socket {st['socket']}" + (f"  metrics http://{st['metrics']}/metrics" if st.get("metrics") else ""))
    print(f"slot memory {_size(st['slot_bytes_in_use'])} of {_size(st['slot_memory_limit'])}")
    print("stats " + " ".join(f"{k}={v}" for k, v in st["stats"].items()))
    sessions = sorted(st["sessions"], key=lambda s: (s["job"], s["rank"]))
    print(f"connected ranks: {len(sessions)}")
    for s in sessions:
        rep = s.get("last_report")
        stall = f" last stall {rep['stall_s'] * 1e3:.1f}ms (step {rep['step']})" if rep else ""
        print(f"  job={s['job']} rank={s['rank']}/{s['world_size']} pid={s['pid']} "
              f"slots busy={s['busy_slots']}/{s['slots']} saves={s['saves']}{stall}")
    saves = st.get("saves", [])
    print(f"saves in flight: {len(saves)}")
    for w in sorted(saves, key=lambda w: (w["job"], w["step"], w["rank"])):
        print(f"  job={w['job']} step={w['step']} rank={w['rank']} written {_size(w['written_bytes'])} "
              f"(compressed) of {_size(w['raw_bytes'])} raw, {w['elapsed_s']:.1f}s")
    for p in st["steps"]:
        print(f"  step job={p['job']} step={p['step']} ({p['mode']} commit) writing={p['writing']} "
              f"durable={p['durable']} of {p['world_size']} ranks, age {p['age_s']:.1f}s")
    last = st.get("last_committed", {})
    print("last committed step per job:" + ("" if last else " none"))
    for job, info in sorted(last.items()):
        print(f"  {job}: {info['step'] if info['step'] is not None else '-'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpoint daemon and tools.")
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon", description=(
        "Run the per-node checkpoint daemon. Settings come from the config file "
        f"({DEFAULT_CONFIG_PATH} unless --config), then CKPTD_* environment variables, then these flags. "
        "Under systemd it takes the socket passed by socket activation and reports with sd_notify."))
    s.add_argument("--config", help=f"TOML config file (default: $CKPTD_CONFIG or {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--check-config", action="store_true", help="print the effective settings and exit")
    s.add_argument("--root", help="directory checkpoints are written under")
    s.add_argument("--socket", help=f"unix socket to listen on when not socket-activated (default: {DEFAULT_SOCKET})")
    s.add_argument("--socket-mode", help="socket permission bits, octal (default: 0660)")
    s.add_argument("--socket-group", help="group owning the socket")
    s.add_argument("--allow-user", action="append", help="user (name or uid) allowed to connect; repeatable")
    s.add_argument("--allow-group", action="append", help="group whose members may connect; repeatable")
    s.add_argument("--threads", type=int, help="compression threads (default: CPUs available)")
    s.add_argument("--codec", choices=CODECS, help="chunk codec (default: bplane)")
    s.add_argument("--level", type=int, help="zstd level (default: 1)")
    s.add_argument("--chunk-mib", type=int, help=f"chunk size in MiB (default: {DEFAULT_CHUNK_BYTES >> 20})")
    s.add_argument("--step-timeout", help="how long a step may wait for all its ranks (default: 600s)")
    s.add_argument("--drain-grace", help="on SIGTERM, how long in-flight saves get to commit (default: 60s)")
    s.add_argument("--slot-memory-limit", help="total shared-memory slot budget, e.g. 64GiB (default: half of RAM)")
    s.add_argument("--slot-memory-limit-mib", type=int, help=argparse.SUPPRESS)
    s.add_argument("--keep-last", help="retention: keep the newest N committed steps per job (0: all)")
    s.add_argument("--keep-every", help="retention: also keep steps divisible by K (0: off)")
    s.add_argument("--abandoned-after", help="retention: remove uncommitted step dirs untouched this long")
    s.add_argument("--metrics-address", help="serve Prometheus metrics on HOST:PORT or PORT (loopback); off by default")
    s.add_argument("--debug-write-delay", type=float, default=0.0,
                   help="TEST ONLY: sleep this many seconds before writing each chunk")
    s.add_argument("--log-format", choices=LOG_FORMATS, help="json (default) or plain")
    s.add_argument("--log-level", choices=LOG_LEVELS, help="default: info")
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

    s = sub.add_parser("status", help="ask a running daemon",
                       description="Connected jobs and ranks, saves in flight with progress, last committed "
                                   "step per job, counters.")
    s.add_argument("--socket", default=protocol.default_socket_path(),
                   help="daemon socket (default: $CKPTD_SOCKET or %(default)s)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("gc", help="apply retention by hand", description=(
        "Apply the retention rules to every job under ROOT (or --job): keep the newest keep_last committed "
        "steps and every keep_every-th, never the newest committed; remove uncommitted step directories "
        "untouched for abandoned_after. Settings come from the config file like serve's, then these flags."))
    s.add_argument("root", nargs="?", help="checkpoint root (default: root from the config)")
    s.add_argument("--job", action="append", help="only this job; repeatable")
    s.add_argument("--dry-run", "-n", action="store_true", help="print what would be removed, remove nothing")
    s.add_argument("--config", help=f"TOML config file (default: $CKPTD_CONFIG or {DEFAULT_CONFIG_PATH} if present)")
    s.add_argument("--keep-last", help="keep the newest N committed steps per job (0: all)")
    s.add_argument("--keep-every", help="also keep steps divisible by K (0: off)")
    s.add_argument("--abandoned-after", help="remove uncommitted step dirs untouched this long (e.g. 6h)")
    s.add_argument("-v", "--verbose", action="store_true", help="also list what is kept and why")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
