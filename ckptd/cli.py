"""Command line: ``ckptd serve | ls | verify | inspect | status | gc | export | import``."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ckptd import __version__, bucket_cli
from ckptd.core import protocol
from ckptd.core.describe import describe_step, render_step
from ckptd.core.errors import ProtocolError
from ckptd.core.names import STAGED_NAME, validate_job
from ckptd.core.reader import Fault, StepReader, list_steps, verify_step
from ckptd.daemon.server import Daemon, describe_error
from ckptd.daemon.service import logs, systemd
from ckptd.daemon.service.allocator import tune_allocator
from ckptd.daemon.settings.config import DEBUG_KEYS, DEFAULT_CONFIG_PATH, KEYS, ConfigError, load_settings
from ckptd.daemon.settings.spec import Key
from ckptd.daemon.tiers.fs.retention import collect_root
from ckptd.hf import commands as hf_commands
from ckptd.status_text import memory_lines


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


# Flags derived from the settings' definition (config.py): serve takes them all, gc the retention ones.
SERVE_KEYS = [*KEYS.values(), *DEBUG_KEYS.values()]
GC_KEYS = [k for k in KEYS.values() if k.spec.gc]


def add_setting_flags(parser: argparse.ArgumentParser, keys: list[Key]) -> None:
    """One option per flag of each setting; help and the default shown come from its definition."""
    for key in keys:
        for flag in key.flags:
            parser.add_argument(
                flag.name, dest=flag.dest, metavar=flag.metavar, choices=key.spec.choices or None,
                action="append" if key.spec.repeat else "store", type=int if flag.unit != 1 else str,
                help=argparse.SUPPRESS if flag.hidden else key.help().replace("%", "%%"))


def setting_flags_given(args: argparse.Namespace, keys: list[Key]) -> dict[str, object]:
    """Dotted key → raw value of each setting flag given; a flag not given overrides nothing."""
    out: dict[str, object] = {}
    for key in keys:
        for flag in key.flags:
            value = getattr(args, flag.dest, None)
            if value is not None:
                out[key.name] = value * flag.unit if flag.unit != 1 else value
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, cli=setting_flags_given(args, SERVE_KEYS))
    except ConfigError as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        print(settings.render())
        problem = bucket_cli.check_bucket(settings.settings.s3)
        if problem:
            print(f"ckptd serve: s3: {problem}", file=sys.stderr)
        return 1 if problem else 0
    logs.setup(settings["log_format"], settings["log_level"])
    for w in settings.warnings:
        logging.getLogger("ckptd").warning(w)
    config = settings.to_daemon_config()
    try:
        listen_sock = systemd.listen_socket()
    except systemd.ActivationError as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 1
    tune_allocator()
    try:
        daemon = Daemon(config)
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
        settings = load_settings(args.config, cli=setting_flags_given(args, GC_KEYS), require_root=False)
    except ConfigError as e:
        print(f"ckptd gc: {e}", file=sys.stderr)
        return 2
    root = args.root or settings["root"]
    if not root:
        print("ckptd gc: give ROOT (or root in the config file)", file=sys.stderr)
        return 2
    policy = settings.settings.retention.policy()  # settings: the Effective settings
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


def _dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        try:
            total += os.lstat(os.path.join(path, name)).st_size
        except OSError:
            pass
    return total


def cmd_ls(args: argparse.Namespace) -> int:
    if args.root.startswith("s3://"):
        return bucket_cli.ls_bucket(args)
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
            verified = False        # format 2: the index's digest covers the sizes shown
            state = "committed" if info.committed else "uncommitted"
            if os.path.isfile(os.path.join(info.path, STAGED_NAME)):    # a copy from the bucket, not a commit here
                state = "staged" if info.committed else "staging"
            if info.committed:
                try:
                    index = StepReader(info.path).index
                    raw = sum(r["raw_bytes"] for r in index["ranks"])
                    stored = sum(r["stored_bytes"] for r in index["ranks"])
                    verified = index["format_version"] >= 2
                except (ValueError, OSError) as e:      # FormatError, or a file over its size limit
                    state = f"invalid ({e})"
            on_disk = _dir_bytes(info.path)
            rows.append({"job": job, "step": info.step, "state": state, "bytes_on_disk": on_disk,
                         "raw_bytes": raw, "stored_bytes": stored, "sizes_verified": verified,
                         "ratio": round(raw / stored, 3) if raw and stored else None,
                         "age_s": round(now - os.stat(info.path).st_mtime, 1)})
    bucket_cli.add_tiers(rows, args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no checkpoints")
        return 0
    print(f"{'JOB':20s} {'STEP':>10s} {'STATE':12s} {'ON DISK':>11s} {'RAW':>11s} {'RATIO':>6s} {'AGE':>7s}")
    for r in rows:
        raw_text = _size(r["raw_bytes"]) + ("" if r["sizes_verified"] else "*") if r["raw_bytes"] is not None else "-"
        print(f"{r['job'][:20]:20s} {r['step']:>10d} {r['state']:12s} {_size(r['bytes_on_disk']):>11s} "
              f"{raw_text:>11s} {format(r['ratio'], '.3f') if r['ratio'] else '-':>6} "
              f"{_age(r['age_s']) if r['age_s'] is not None else '-':>7s}"
              + (f"  {r['tiers']}" if "tiers" in r else ""))
    if any(r["raw_bytes"] is not None and not r["sizes_verified"] for r in rows):
        print("* format-1 step: sizes from an index with no digest (unverified; `ckptd verify` checks the data)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr))
    try:
        faults = (bucket_cli.bucket_faults(args, progress) if args.step_dir.startswith("s3://")
                  else verify_step(args.step_dir, progress=progress))
    except (ValueError, OSError, EOFError) as e:     # e.g. an index or manifest over its size limit
        faults = [Fault(args.step_dir, None, str(e))]
    for f in faults:
        print(f"FAULT {f}")
    if faults:
        print(f"{args.step_dir}: {len(faults)} fault(s)")
        return 1
    print(f"{args.step_dir}: OK")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        desc = describe_step(StepReader(args.step_dir))
    except (ValueError, OSError) as e:     # FormatError, or a file over its size limit
        print(f"ckptd inspect: {e}", file=sys.stderr)
        return 1
    print(json.dumps(desc, indent=1) if args.json else "\n".join(render_step(desc, _size)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        st = protocol.request_once(args.socket, {"op": "status"})
    except (ConnectionError, RuntimeError, ProtocolError, OSError) as e:
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
    for line in memory_lines(st.get("memory")):
        print(line)
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
    add_setting_flags(s, SERVE_KEYS)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("ls", help="list steps", description="List steps, committed or not, with sizes and ratios.")
    s.add_argument("root", help="checkpoint root, or a bucket: s3://bucket/prefix")
    s.add_argument("job", nargs="?")
    s.add_argument("--json", action="store_true")
    bucket_cli.add_bucket_flags(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("verify", help="check every checksum and the geometry of a step", description=(
        "Verify every manifest digest and chunk checksum, and (format 2) that the index's tensor map agrees "
        "with the manifests and its sharded tensors' pieces tile them exactly; exit 1 on any fault."))
    s.add_argument("step_dir", help="a step directory, or one in a bucket: s3://bucket/prefix/<job>/step-<N>")
    s.add_argument("-q", "--quiet", action="store_true")
    bucket_cli.add_bucket_flags(s)
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("inspect", help="list a step's tensors and how they are split", description=(
        "Every tensor's dtype, global shape and split (sharded: each piece's rank and region; local: which "
        "ranks hold a copy, the same or per rank), the per-rank keys, world size and sizes. Reads index.json "
        "only (format 1: the manifests); `ckptd verify` checks the bytes."))
    s.add_argument("step_dir")
    s.add_argument("--json", action="store_true", help="everything, every piece, as JSON")
    s.set_defaults(func=cmd_inspect)

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
    add_setting_flags(s, GC_KEYS)
    s.add_argument("-v", "--verbose", action="store_true", help="also list what is kept and why")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_gc)

    hf_commands.add_parsers(sub)      # export, import (Hugging Face safetensors)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
