"""Configuration: TOML file < CKPTD_* environment < CLI flags; strict validation at start."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.daemon.config import ConfigError, KEYS, env_name, load_settings, parse_duration, parse_size
from conftest import REPO, wait_for_socket


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
