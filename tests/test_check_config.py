"""``ckptd serve --check-config`` fails for every config ``ckptd serve`` then refuses to start with:
it runs the start's own checks (shm_dir, the peers' secret and TLS files, the root), each problem
naming its setting. Each case: the check exits 1 naming the key, and the daemon itself refuses the
same config (exit 1), so the check and the start cannot drift apart."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_shm_dir import mounted_tmpfs

from conftest import REPO

PEERS = '[peers]\nlisten = "127.0.0.1:17465"\npeers = ["127.0.0.1:17465", "127.0.0.1:17466"]\n'


def ckptd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def config(tmp: Path, name: str, body: str) -> Path:
    (tmp / "root").mkdir(exist_ok=True)
    path = tmp / f"{name}.toml"
    path.write_text(f'root = "{tmp}/root"\nsocket = "{tmp}/{name}.sock"\n{body}')
    return path


def secret(tmp: Path) -> Path:
    path = tmp / "secret"
    path.write_bytes(os.urandom(16).hex().encode())
    path.chmod(0o600)
    return path


def cases(tmp: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """(case, config file, what the check's message must say)"""
    yield "shm_dir", config(tmp, "shm", '[memory]\nshm_dir = "/run/ckptd-no-such/shm"\n'), \
        ["memory.shm_dir", "/run/ckptd-no-such/shm", "No such file or directory"]
    yield "secret", config(tmp, "secret", f'{PEERS}secret_file = "{tmp}/nosecret"\n'), \
        ["peers.secret_file", f"{tmp}/nosecret", "No such file or directory"]
    open_secret = tmp / "open-secret"
    open_secret.write_text("x" * 32)
    open_secret.chmod(0o644)
    yield "secret-mode", config(tmp, "open", f'{PEERS}secret_file = "{open_secret}"\n'), \
        ["peers.secret_file", "chmod 600"]
    yield "tls", config(tmp, "tls", f'{PEERS}secret_file = "{secret(tmp)}"\ntls_cert = "{tmp}/no.crt"\n'
                                    f'tls_key = "{tmp}/no.key"\ntls_ca = "{tmp}/no-ca.crt"\n'), \
        ["peers.tls_cert", f"{tmp}/no.crt", "No such file or directory"]
    (tmp / "bad.crt").write_text("not PEM\n")
    key = tmp / "bad.key"
    key.write_text("not PEM\n")
    key.chmod(0o600)
    yield "tls-pem", config(tmp, "pem", f'{PEERS}secret_file = "{secret(tmp)}"\ntls_cert = "{tmp}/bad.crt"\n'
                                        f'tls_key = "{key}"\ntls_ca = "{tmp}/bad.crt"\n'), \
        ["peers.tls_cert", "peers.tls_key", "peers.tls_ca", "cannot load"]


def test_check_config_fails_where_serve_would(tmp: Path) -> None:
    for case, cfg, said in cases(tmp):
        check = ckptd("serve", "--config", str(cfg), "--check-config")
        assert check.returncode == 1, (case, check.stdout, check.stderr)
        problems = [ln for ln in check.stderr.splitlines() if ln.startswith("ckptd serve: ")]
        assert len(problems) == 1 and all(s in problems[0] for s in said), (case, check.stderr)
        serve = ckptd("serve", "--config", str(cfg), "--log-format", "plain")      # the start agrees
        assert serve.returncode == 1 and "cannot start" in serve.stderr, (case, serve.stdout, serve.stderr)
        assert not (tmp / f"{cfg.stem}.sock").exists()


def test_check_config_passes_a_config_serve_starts_with(tmp: Path) -> None:
    """A fit shm_dir (a tmpfs) and a good secret file: nothing to say."""
    mounts = mounted_tmpfs(tmp / "shm", "size=8m,mode=0700")
    shm = next(mounts)
    try:
        cfg = config(tmp, "ok", f'[memory]\nshm_dir = "{shm}"\n{PEERS}secret_file = "{secret(tmp)}"\n')
        check = ckptd("serve", "--config", str(cfg), "--check-config")
        assert check.returncode == 0 and check.stderr == "", check.stderr
    finally:
        next(mounts, None)


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
def test_the_docs_say_to_check_as_the_daemons_user(doc: str) -> None:
    text = " ".join((REPO / doc).read_text().split())
    assert "sudo -u ckptd ckptd serve --config" in text and "--check-config" in text, doc
