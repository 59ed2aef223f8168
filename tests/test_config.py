"""Configuration: TOML file < CKPTD_* environment < CLI flags; strict validation at start."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.daemon.settings.config import (
    DEBUG_KEYS,
    KEYS,
    ConfigError,
    DaemonConfig,
    Settings,
    env_name,
    load_settings,
    parse_duration,
    parse_size,
    update_docs,
)
from ckptd.daemon.settings.retention import RetentionPolicy
from ckptd.daemon.settings.write import WriteSettings

from conftest import REPO, wait_for_socket

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def write(tmp: Path, text: str, name: str = "ckptd.toml") -> str:
    p = tmp / name
    p.write_text(text)
    return str(p)


def test_precedence_file_env_cli(tmp):
    cfg = write(tmp, f'root = "{tmp}/from-file"\nlevel = 3\ncodec = "zstd"\n[retention]\nkeep_last = 5\n')
    s = load_settings(cfg, env={"CKPTD_LEVEL": "7", "CKPTD_RETENTION_KEEP_LAST": "2"}, cli={"level": 9})
    assert s["root"] == f"{tmp}/from-file" and s.sources["root"] == f"config {cfg}"
    assert s["codec"] == "zstd"
    assert s["retention.keep_last"] == 2 and s.sources["retention.keep_last"] == "environment"
    assert s["level"] == 9 and s.sources["level"] == "command line"
    assert s["threads"] >= 1 and s.sources["threads"] == "default"


def test_values_are_parsed(tmp):
    cfg = write(tmp, f'''
root = "{tmp}/r"
socket = "{tmp}/s.sock"
socket_mode = "0600"
allowed_users = ["root", 4242]
allowed_groups = ["0"]
slot_memory_limit = "2GiB"
chunk_size = "1MiB"
step_timeout = "5m"
drain_grace = 12.5
[retention]
keep_every = 100
abandoned_after = "2h"
[metrics]
address = "9464"
''')
    s = load_settings(cfg, env={})
    assert s["socket_mode"] == 0o600
    assert s["allowed_users"] == [0, 4242] and s["allowed_groups"] == [0]
    assert s["slot_memory_limit"] == 2 * 1024**3 and s["chunk_size"] == 1024**2
    assert s["step_timeout"] == 300 and s["drain_grace"] == 12.5
    assert s["retention.keep_every"] == 100 and s["retention.abandoned_after"] == 7200
    assert s["metrics.address"] == ("127.0.0.1", 9464)          # a bare port binds loopback
    dc = s.to_daemon_config()
    assert dc.allowed_uids == frozenset({0, 4242}) and dc.retention.keep_every == 100
    assert dc.metrics_address == ("127.0.0.1", 9464) and dc.write.chunk_bytes == 1024**2


@pytest.mark.parametrize("text, needle", [
    ('root = "/x"\nbogus = 1\n', "unknown key 'bogus'"),
    ('root = "/x"\n[retention]\nkeep_lats = 1\n', "unknown key 'retention.keep_lats'"),
    ('root = "/x"\n[storage]\nx = 1\n', "unknown key 'storage'"),
    ('root = "/x"\nlevel = "fast"\n', "level: must be an integer"),
    ('root = "/x"\nlevel = 40\n', "level: must be between 1 and 22"),
    ('root = "/x"\ncodec = "lz4"\n', "codec: must be one of"),
    ('root = "/x"\nsocket_mode = "0999"\n', "socket_mode"),
    ('root = "/x"\nsocket_mode = "0400"\n', "socket_mode"),
    ('root = "/x"\nsocket_mode = "0666"\n', "lets every local user connect"),
    ('root = "/x"\nallowed_users = ["no-such-user-ckptd"]\n', "allowed_users: no such user"),
    ('root = "/x"\nallowed_groups = ["no-such-group-ckptd"]\n', "allowed_groups: no such group"),
    ('root = "/x"\nslot_memory_limit = "lots"\n', "slot_memory_limit"),
    ('root = "/x"\nstep_timeout = -1\n', "step_timeout"),
    ('root = "/x"\n[retention]\nkeep_last = -1\n', "retention.keep_last: must be at least 0"),
    ('root = "/x"\n[retention]\nabandoned_after = "1m"\n', "shorter than step_timeout"),
    ('root = "/x"\n[metrics]\naddress = "localhost:http"\n', "metrics.address"),
    ('root = "/x"\nthreads = true\n', "threads: must be an integer"),
    ('root = = "/x"\n', "not valid TOML"),
    ('level = 1\n', "root is not set"),
])
def test_bad_config_names_key_and_reason(tmp, text, needle):
    cfg = write(tmp, text)
    with pytest.raises(ConfigError) as e:
        load_settings(cfg, env={})
    assert needle in str(e.value)


def test_env_errors_name_the_variable(tmp):
    with pytest.raises(ConfigError, match="environment: CKPTD_RETENTION_KEEP_EVERY: must be an integer"):
        load_settings(None, env={"CKPTD_ROOT": str(tmp), "CKPTD_RETENTION_KEEP_EVERY": "often",
                                 "CKPTD_CONFIG": write(tmp, "")})


def test_missing_named_config_is_an_error(tmp):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(str(tmp / "nope.toml"), env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(None, env={"CKPTD_CONFIG": str(tmp / "nope.toml")})


def test_every_key_has_an_env_name_and_doc():
    for key, spec in KEYS.items():
        assert env_name(key).startswith("CKPTD_") and spec.doc
    assert env_name("retention.keep_last") == "CKPTD_RETENTION_KEEP_LAST"


def test_size_and_duration_parsing():
    assert parse_size(10) == 10 and parse_size("4KiB") == 4096 and parse_size("1.5 GiB") == 3 * 2**29
    assert parse_size("2G") == 2 * 10**9
    assert parse_duration("90s") == 90 and parse_duration("2d") == 172800 and parse_duration(1.5) == 1.5
    for bad in ("x", "10 parsecs", True, [1]):
        with pytest.raises(ValueError):
            parse_size(bad)
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_docs_settings_table_matches_definition():
    """docs/operations.md's settings table is generated; a stale one fails here."""
    assert update_docs(write=False), (
        "docs/operations.md: the settings table differs from the definition in ckptd/daemon/settings/config.py; "
        "regenerate it with: python -m ckptd.daemon.settings.config --write-docs")


def test_example_config_names_every_known_key_and_only_those():
    """Each `key = value` of the example, set or commented out, is a setting whose parser takes the value;
    every setting appears there (a new setting must be added to the example)."""
    seen, table = set(), ""
    for line in (REPO / "packaging" / "ckptd.toml.example").read_text().splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line.strip()):
            table = m.group(1) + "."
        elif m := re.fullmatch(r"#?\s*(\w+)\s*=\s*(.+?)(?:\s+#.*)?", line.strip()):
            key = table + m.group(1)
            assert key in KEYS, f"ckptd.toml.example: {key!r} is not a setting"
            value = tomllib.loads(f"v = {m.group(2)}")["v"]
            try:
                KEYS[key].spec.parse(value)
            except ValueError as e:
                assert "no such" in str(e), f"ckptd.toml.example: {key} = {m.group(2)}: {e}"  # names of this host
            seen.add(key)
    assert seen == set(KEYS), f"ckptd.toml.example does not mention {sorted(set(KEYS) - seen)}"


def test_example_config_is_valid(tmp):
    """packaging/ckptd.toml.example loads (with a group that exists on this machine)."""
    text = (REPO / "packaging" / "ckptd.toml.example").read_text()
    cfg = write(tmp, text.replace('allowed_groups = ["ckptd"]', 'allowed_groups = ["root"]'))
    s = load_settings(cfg, env={})
    assert s["retention.keep_last"] == 3 and s["metrics.address"] is None


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "serve", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_serve_fails_at_start_on_bad_config(tmp):
    cfg = write(tmp, f'root = "{tmp}/r"\n[retention]\nkeep_last = "three"\n')
    r = _serve("--config", cfg, "--socket", str(tmp / "s.sock"))
    assert r.returncode == 2
    assert "retention.keep_last" in r.stderr and "must be an integer" in r.stderr
    assert not (tmp / "s.sock").exists()
    r = _serve("--config", write(tmp, f'root = "{tmp}/r"\ncompression = 3\n', "b.toml"))
    assert r.returncode == 2 and "unknown key 'compression'" in r.stderr


def test_check_config_prints_effective_settings(tmp):
    cfg = write(tmp, f'root = "{tmp}/r"\nlevel = 3\n')
    r = _serve("--config", cfg, "--level", "5", "--check-config", env={"CKPTD_CODEC": "zstd"})
    assert r.returncode == 0, r.stderr
    assert 'level = 5    # command line' in r.stdout
    assert 'codec = "zstd"    # environment' in r.stdout
    assert f'root = "{tmp}/r"    # config {cfg}' in r.stdout
    # The printed settings are themselves a valid config file.
    again = load_settings(write(tmp, r.stdout, "eff.toml"), env={})
    assert again["level"] == 5 and again["codec"] == "zstd"


def test_an_unknown_environment_variable_is_warned_about_by_check_config_and_gc(tmp):
    """docs/operations.md promises an unknown CKPTD_* variable is warned about: only a running daemon
    logged it, so `serve --check-config` and `gc` said nothing of CKPTD_RETENTION_KEEP_LATS=3 (for
    KEEP_LAST) and ran as if keep_last were unset."""
    (tmp / "r").mkdir()
    cfg = write(tmp, f'root = "{tmp}/r"\n')
    warned = "warning: ignoring unknown environment variable CKPTD_RETENTION_KEEP_LATS"
    env = {"CKPTD_RETENTION_KEEP_LATS": "3"}
    r = _serve("--config", cfg, "--socket", str(tmp / "s.sock"), "--check-config", env=env)
    assert r.returncode == 0 and f"ckptd serve: {warned}" in r.stderr, r.stdout + r.stderr
    assert "LATS" not in r.stdout and "keep_last = 0    # default" in r.stdout, r.stdout    # the TOML stays clean
    r = subprocess.run([sys.executable, "-m", "ckptd", "gc", "--config", cfg, "--dry-run", "--json"],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert r.returncode == 0 and f"ckptd gc: {warned}" in r.stderr, r.stdout + r.stderr
    assert json.loads(r.stdout)["dry_run"] is True                                          # stdout stays JSON


def test_daemon_uses_config_file(tmp):
    """A real daemon takes root and codec from the file; status reports the root."""
    from ckptd.core import protocol
    cfg = write(tmp, f'root = "{tmp}/cfgroot"\ncodec = "zstd"\n')
    sock = tmp / "c.sock"
    args = [sys.executable, "-m", "ckptd", "serve", "--config", cfg, "--socket", str(sock), "--log-format", "plain"]
    log = open(tmp / "cfg.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_socket(sock, proc)
        st = protocol.request_once(str(sock), {"op": "status"})
        assert st["root"] == f"{tmp}/cfgroot"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        log.close()


# Flags users and tests type today; renaming any of them breaks someone.
SERVE_FLAGS = {"--root": "root", "--socket": "socket", "--socket-mode": "socket_mode",
               "--socket-group": "socket_group", "--allow-user": "allowed_users",
               "--allow-group": "allowed_groups", "--slot-memory-limit": "slot_memory_limit",
               "--slot-memory-limit-mib": "slot_memory_limit", "--codec": "codec", "--codec-mode": "codec_mode",
               "--direct-io": "direct_io",
               "--level": "level",
               "--chunk-mib": "chunk_size", "--threads": "threads", "--step-timeout": "step_timeout",
               "--drain-grace": "drain_grace", "--log-format": "log_format", "--log-level": "log_level",
               "--keep-last": "retention.keep_last", "--keep-every": "retention.keep_every",
               "--abandoned-after": "retention.abandoned_after", "--metrics-address": "metrics.address",
               "--debug-write-delay": "debug.write_delay",
               "--memory-steps": "memory.steps", "--memory-budget": "memory.budget", "--shm-dir": "memory.shm_dir",
               "--peer-listen": "peers.listen",
               "--peer": "peers.peers", "--peer-name": "peers.name", "--peer-secret-file": "peers.secret_file",
               "--peer-replicas": "peers.replicas", "--peer-jump": "peers.jump", "--peer-bandwidth": "peers.bandwidth",
               "--peer-io-timeout": "peers.io_timeout", "--peer-probe-interval": "peers.probe_interval",
               "--peer-redundancy": "peers.redundancy",
               "--peer-group": "peers.group", "--peer-parity": "peers.parity", "--peer-tls-cert": "peers.tls_cert",
               "--peer-tls-key": "peers.tls_key", "--peer-tls-ca": "peers.tls_ca",
               "--debug-commit-delay": "debug.commit_delay",
               "--debug-frame-timeout": "debug.frame_timeout"}
SERVE_FLAGS.update({f"--s3-{k.replace('_', '-')}": f"s3.{k}" for k in (
    "url", "endpoint", "region", "request_timeout", "concurrency", "part_size", "keep_last", "queue_depth",
    "retry_max_interval")})
SERVE_FLAGS["--debug-upload-delay"] = "debug.upload_delay"


def test_flags_come_from_the_definition():
    from ckptd.cli import GC_KEYS, SERVE_KEYS
    assert {f.name: k.name for k in SERVE_KEYS for f in k.flags} == SERVE_FLAGS
    assert [k.name for k in GC_KEYS] == ["retention.keep_last", "retention.keep_every", "retention.abandoned_after",
                                        "s3.url", "s3.endpoint", "s3.region", "s3.request_timeout"]  # (--remove-above)
    assert all(k.spec.doc for k in SERVE_KEYS)


def test_flags_reach_the_settings(tmp):
    from ckptd.cli import SERVE_KEYS, build_parser, setting_flags_given
    args = build_parser().parse_args([
        "serve", "--root", str(tmp), "--chunk-mib", "2", "--slot-memory-limit-mib", "64", "--allow-user", "root",
        "--allow-user", "4242", "--keep-last", "3", "--abandoned-after", "2h", "--metrics-address", "0",
        "--codec", "zstd", "--debug-write-delay", "0.5"])
    s = load_settings(None, env={"CKPTD_CONFIG": write(tmp, "")}, cli=setting_flags_given(args, SERVE_KEYS))
    assert s["chunk_size"] == 2 * 1024**2 and s["slot_memory_limit"] == 64 * 1024**2
    assert s["allowed_users"] == [0, 4242] and s["retention.keep_last"] == 3
    assert s["retention.abandoned_after"] == 7200 and s["metrics.address"] == ("127.0.0.1", 0)
    assert s.sources["chunk_size"] == "command line" and s.sources["codec"] == "command line"
    dc = s.to_daemon_config()
    assert dc.write.codec == "zstd" and dc.write.debug_write_delay == 0.5 and dc.allowed_uids == frozenset({0, 4242})


def test_debug_settings_come_from_flags_only(tmp):
    with pytest.raises(ConfigError, match="unknown key 'debug_write_delay'"):
        load_settings(write(tmp, f'root = "{tmp}"\ndebug_write_delay = 1\n'), env={})
    s = load_settings(write(tmp, f'root = "{tmp}"\n'), env={"CKPTD_DEBUG_WRITE_DELAY": "1"})
    assert s.debug.write_delay == 0 and "ignoring unknown environment variable CKPTD_DEBUG_WRITE_DELAY" in s.warnings
    assert "debug" not in s.render() and not set(DEBUG_KEYS) & set(KEYS)
    s = load_settings(write(tmp, f'root = "{tmp}"\n'), env={}, cli={"debug.write_delay": "0.25"})
    assert s.to_daemon_config().write.debug_write_delay == 0.25


def test_defaults_are_stated_once():
    """DaemonConfig's, WriteSettings' and RetentionPolicy's defaults are the settings' defaults."""
    assert Settings(root="/r").to_daemon_config() == DaemonConfig(root="/r", socket_path=KEYS["socket"].default())
    assert DaemonConfig("/r", "/s").write == WriteSettings() and DaemonConfig("/r", "/s").retention == RetentionPolicy()


def test_check_config_spells_every_default_loadably(tmp):
    s = load_settings(write(tmp, f'root = "{tmp}"\n'), env={})
    again = load_settings(write(tmp, s.render(), "eff.toml"), env={})
    assert dataclasses.asdict(again.settings) == dataclasses.asdict(s.settings)
    assert 'step_timeout = "10m"    # default' in s.render() and 'chunk_size = "4MiB"' in s.render()
