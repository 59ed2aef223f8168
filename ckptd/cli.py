"""Command line: ``ckptd serve | ls | verify | inspect | status | gc | export | import`` (ls, verify and
inspect: cli_steps.py; export and import: ckptd.hf.commands)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from ckptd import __version__, bucket_cli, cli_steps
from ckptd.core import protocol
from ckptd.core.describe import human_size
from ckptd.core.errors import ProtocolError
from ckptd.core.step_files import UNREADABLE_FIX, os_reason
from ckptd.daemon.server import Daemon, describe_error, start_problems
from ckptd.daemon.service import logs, systemd
from ckptd.daemon.service.allocator import tune_allocator
from ckptd.daemon.settings.config import DEBUG_KEYS, DEFAULT_CONFIG_PATH, KEYS, ConfigError, load_settings
from ckptd.daemon.settings.spec import Key
from ckptd.daemon.tiers.fs.retention import collect_root
from ckptd.hf import commands as hf_commands
from ckptd.status_text import group_lines, memory_lines, shared_memory

# Flags derived from the settings' definition (config.py): serve takes them all, gc the retention ones.
SERVE_KEYS = [*KEYS.values(), *DEBUG_KEYS.values()]
GC_KEYS = [k for k in KEYS.values() if k.spec.gc]
STATUS_TIMEOUT_S = 10.0     # `ckptd status`'s wait for its answer (with --group: on top of peers.io_timeout)


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


def print_warnings(command: str, warnings: list[str]) -> None:
    """The settings' warnings (an unknown ``CKPTD_*`` variable: a misspelt setting, ignored) on stderr,
    where ``serve --check-config`` and ``gc`` are read; a running daemon logs them."""
    for w in warnings:
        print(f"ckptd {command}: warning: {w}", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, cli=setting_flags_given(args, SERVE_KEYS))
    except ConfigError as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        print_warnings("serve", settings.warnings)
        print(settings.render())
        # The start's own checks (shm_dir, the peers' files, the root), then the bucket's (a daemon
        # starts without its bucket, but its uploads would fail).
        problems = start_problems(settings.to_daemon_config())
        problems += [f"s3: {p}" for p in [bucket_cli.check_bucket(settings.settings.s3)] if p]
        for p in problems:
            print(f"ckptd serve: {p}", file=sys.stderr)
        return 1 if problems else 0
    logs.setup(settings["log_format"], settings["log_level"])
    for w in settings.warnings:
        logging.getLogger("ckptd").warning(w)
    config = settings.to_daemon_config()
    log = logging.getLogger("ckptd")      # (set up: a fatal start-up error goes out in the log's format too)
    try:
        listen_sock = systemd.listen_socket()
    except systemd.ActivationError as e:
        log.error("cannot start", extra={"ctx": {"error": str(e)}})
        return 1
    tune_allocator()
    try:
        daemon = Daemon(config)
        import uvloop
        uvloop.run(daemon.serve(listen_sock))
    except (RuntimeError, OSError) as e:
        log.error("cannot start", extra={"ctx": {"error": describe_error(e) if isinstance(e, OSError) else str(e)}})
        return 1
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
    print_warnings("gc", settings.warnings)
    root = args.root or settings["root"]
    if not root:
        print("ckptd gc: give ROOT (or root in the config file)", file=sys.stderr)
        return 2
    policy = settings.settings.retention.policy()  # settings: the Effective settings
    try:
        for job in args.job or []:      # a misspelt job would remove nothing and exit 0: as ls, a usage error
            cli_steps.job_path(root, job)
    except cli_steps.UsageError as e:
        print(f"ckptd gc: {e}", file=sys.stderr)
        return cli_steps.USAGE
    if args.remove_above is not None and not args.job:
        print("ckptd gc: --remove-above needs --job (it removes a rolled-back run's steps of one job)", file=sys.stderr)
        return cli_steps.USAGE
    in_bucket, bucket_errors = ([], []) if args.remove_above is None else \
        bucket_cli.remove_above(settings.settings.s3, args.job, args.remove_above, args.dry_run)
    try:
        result = collect_root(root, policy, dry_run=args.dry_run, jobs=args.job or None, above=args.remove_above)
    except (OSError, ValueError) as e:
        print(f"ckptd gc: {e}", file=sys.stderr)
        return 2
    # The bucket again, now that the local steps are gone: an upload in flight may have landed meanwhile.
    late, late_errors = ([], []) if args.remove_above is None or args.dry_run or bucket_errors else \
        bucket_cli.sweep_above(settings.settings.s3, args.job, args.remove_above)
    bucket_errors += late_errors
    if args.json:
        print(json.dumps({"dry_run": args.dry_run,
                          "actions": [{"job": a.job, "step": a.step, "path": a.path, "kind": a.kind,
                                       "removed": a.done, "error": a.error} for a in result.actions],
                          "kept": [{"job": j, "step": st, "why": why} for j, st, why in result.kept],
                          "skipped": result.skipped,
                          "unreadable": [{"path": p, "error": why} for p, why in result.unreadable],
                          "bucket_removed": in_bucket, "bucket_removed_late": late,
                          "bucket_errors": bucket_errors},
                         indent=1))
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
        for path, why in result.unreadable:
            print(f"FAILED {path}: cannot read it ({why}); left as it is (it may be committed); {UNREADABLE_FIX}")
        for key in in_bucket:
            print(f"{verb} {key}: a bucket step above --remove-above")
        for key in late:
            print(f"removed {key}: a bucket step above --remove-above that an upload in flight put there while gc ran")
        for err in bucket_errors:
            print(f"FAILED the bucket's steps above --remove-above: {err}")
        n = len(result.actions) if args.dry_run else len(result.removed)
        print(f"{verb} {n} step(s), kept {len(result.kept)}"
              + (f", {len(result.errors)} failed" if result.errors else "")
              + (f", {len(result.unreadable)} unreadable" if result.unreadable else ""))
    return 1 if result.errors or result.unreadable or bucket_errors else 0


def cmd_status(args: argparse.Namespace) -> int:
    timeout, bound = (args.timeout, "--timeout") if args.timeout else (STATUS_TIMEOUT_S, "the default")
    try:
        if args.group and not args.timeout:     # every member is asked, each within the daemon's peers.io_timeout
            io = protocol.request_once(args.socket, {"op": "info"}, timeout).get("peer_io_timeout")
            if isinstance(io, (int, float)) and io > 0:
                timeout, bound = io + STATUS_TIMEOUT_S, f"the daemon's peers.io_timeout {io:g}s + {STATUS_TIMEOUT_S:g}s"
        st = protocol.request_once(args.socket, {"op": "status", **({"group": True} if args.group else {})}, timeout)
    except TimeoutError:
        print(f"ckptd status: the daemon at {args.socket} did not answer within {timeout:g}s ({bound}; "
              "--timeout SECONDS waits longer)", file=sys.stderr)
        return 1
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
    print(f"slot memory {human_size(st['slot_bytes_in_use'])} of {human_size(st['slot_memory_limit'])}")
    pages = shared_memory(st)
    if pages is not None:
        print(f"shared memory pages: {pages}")
    way = st.get("direct_io") or {}
    if way:
        rates = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in sorted(way.get("bytes_per_s", {}).items()))
        print(f"shard writes: direct_io {way.get('mode')}" + (f" (measured: {rates})" if rates else ""))
    print("stats " + " ".join(f"{k}={human_size(v).replace(' ', '') if k.startswith('bytes_') else v}"
                              for k, v in st["stats"].items()))
    sessions = sorted(st["sessions"], key=lambda s: (s["job"], s["rank"]))
    print(f"connected ranks: {len(sessions)}")
    for s in sessions:
        rep = s.get("last_report")
        stall = f" last stall {rep['stall_s'] * 1e3:.1f}ms (step {rep['step']})" if rep else ""
        print(f"  job={s['job']} rank={s['rank']}/{s['world_size']} pid={s['pid']} "
              f"slots busy={s['busy_slots']}/{s['slots']} held={s.get('held_slots', 0)} "
              f"saves={s['saves']}{stall}")
    saves = st.get("saves", [])
    print(f"saves in flight: {len(saves)}")
    for w in sorted(saves, key=lambda w: (w["job"], w["step"], w["rank"])):
        print(f"  job={w['job']} step={w['step']} rank={w['rank']} written {human_size(w['written_bytes'])} "
              f"(compressed) of {human_size(w['raw_bytes'])} raw, {w['elapsed_s']:.1f}s")
    for p in st["steps"]:
        print(f"  step job={p['job']} step={p['step']} ({p['mode']} commit) writing={p['writing']} "
              f"durable={p['durable']} of {p['world_size']} ranks, age {p['age_s']:.1f}s")
    last = st.get("last_committed", {})
    print("last committed step per job:" + ("" if last else " none")
          + (" (the root's first 1000 jobs only)" if st.get("last_committed_partial") else ""))
    for job, info in sorted(last.items()):
        print(f"  {job}: {info['step'] if info['step'] is not None else '-'}")
    hosts = st.get("host_bytes") or {}
    print("host memory per job (each byte once):" + ("" if hosts else " none"))
    for job, b in sorted(hosts.items()):
        print(f"  {job}: slots {human_size(b['slots'])}, held steps {human_size(b['held'])}, "
              f"peers' replicas {human_size(b['replicas'])}, total {human_size(sum(b.values()))}")
    group = group_lines(st.get("groups"), st.get("group_members")) if args.group else []
    for line in [*memory_lines(st.get("memory")), *group]:
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

    cli_steps.add_parsers(sub)        # ls, verify, inspect

    s = sub.add_parser("status", help="ask a running daemon",
                       description="Connected jobs and ranks, saves in flight with progress, last committed "
                                   "step per job, counters.")
    s.add_argument("--socket", default=protocol.default_socket_path(),
                   help="daemon socket (default: $CKPTD_SOCKET or %(default)s)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--group", action="store_true",
                   help="parity mode: ask every member of this node's group whether each held step is protected")
    s.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help=f"how long to wait for the daemon's answer (default: {STATUS_TIMEOUT_S:g} s; with --group, "
                        f"the daemon's peers.io_timeout + {STATUS_TIMEOUT_S:g} s)")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("gc", help="apply retention by hand", description=(
        "Apply the retention rules to every job under ROOT (or --job): keep the newest keep_last committed "
        "steps and every keep_every-th, never the newest committed; remove uncommitted step directories "
        "untouched for abandoned_after. Settings come from the config file like serve's, then these flags. "
        "A --job that is not under ROOT is a usage error (exit 2)."))
    s.add_argument("root", nargs="?", help="checkpoint root (default: root from the config)")
    s.add_argument("--job", action="append", help="only this job; repeatable")
    s.add_argument("--dry-run", "-n", action="store_true", help="print what would be removed, remove nothing")
    s.add_argument("--config", help=f"TOML config file (default: $CKPTD_CONFIG or {DEFAULT_CONFIG_PATH} if present)")
    add_setting_flags(s, GC_KEYS)
    s.add_argument("--remove-above", type=cli_steps.step_argument, metavar="N",
                   help="also remove every step of --job numbered above N, committed or not, memory-level too: "
                        "a run rolled back to step N (restore(step=N)) saves below them, and they would outrank it "
                        "(retention and restore() go by number); run with the job's trainers stopped")
    s.add_argument("-v", "--verbose", action="store_true", help="also list what is kept and why")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_gc)

    hf_commands.add_parsers(sub)      # export, import (Hugging Face safetensors)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()          # here, not at exit: a reader gone (`| head`) raises now
        return code
    except PermissionError as e:        # (a file system's refusal, not a bug: one line, no traceback)
        print(f"ckptd {args.command}: {e.filename or ''}: {os_reason(e)} for uid {os.geteuid()}; run it as the "
              "daemon's user, or join its group (the root is the group's to read: docs/operations.md, "
              "\"Security model\")", file=sys.stderr)
        return cli_steps.USAGE
    except BrokenPipeError:
        # The reader stopped reading: not an error of ours. Point stdout at /dev/null so the
        # interpreter's last flush finds nothing to complain about, and exit as a piped tool does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
