"""TLS on peer traffic: mutual certificates from a throwaway CA (made with the openssl CLI), the HMAC
handshake on top; a peer from another CA, or one without TLS, cannot place a replica."""
# mypy: disable-error-code="union-attr,index"
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import ckptd_client
from ckptd.launch import spawn_daemon

from test_acceptance import finish, free_port, launch
from test_memory_tier import remove_data_files, state_of, status
from test_peers import held_steps, peer_args, restart_on_new_node_b, secret_file, wait_for

SECRET = "tls-and-hmac-both-0123456789abcdef"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path) -> Path:
    """A CA (key and self-signed certificate) in ``d``; returns ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", f"/CN=ckptd test CA {d.name}", cwd=d)
    return d


def make_node(ca: Path, name: str) -> list[str]:
    """A node key and certificate signed by ``ca``: the three TLS flags for it."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=ca)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial",
            str(abs(hash(name)) % 10**9 + 1), "-days", "2", "-out", f"{name}.crt", cwd=ca)
    (ca / f"{name}.key").chmod(0o600)
    return ["--peer-tls-cert", str(ca / f"{name}.crt"), "--peer-tls-key", str(ca / f"{name}.key"),
            "--peer-tls-ca", str(ca / "ca.crt")]


def test_tls_daemons_replicate_and_a_fresh_one_restores_from_peer_memory(daemon_factory, tmp):
    """Two TLS daemons replicate a step (K = 1); node B is lost with every data file, and a fresh TLS
    daemon for B restores its ranks from A's memory, bit-exact."""
    ca = make_ca(tmp / "ca")
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", SECRET)
    a = daemon_factory(*peer_args(addrs[0], addrs, secret, *make_node(ca, "a")), name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret, *make_node(ca, "b")), name="b")
    finish(launch(4, [a.socket, b.socket], "tls", tmp / "first", "--steps", "8", "--every", "4"))
    wait_for(lambda: any(s["step"] == 8 and s["replicated"] and s["committed"] for s in held_steps(b.socket)),
             "B's step 8 replicated and seen committed")
    on_a = [s for s in held_steps(a.socket) if s["step"] == 8][0]
    assert {on_a["ranks"][r]["origin"] for r in "23"} == {"replica"}, on_a
    assert "tls=True" in a.log_text()

    b.kill()
    assert remove_data_files(a.root, "tls") >= 4
    b2 = daemon_factory(*peer_args(addrs[1], addrs, secret, *make_node(ca, "b2")), name="b2")
    restart_on_new_node_b(a, b2, "tls", tmp)
    assert status(a.socket)["memory"]["peers_refused"] == 0


def _save_and_expect_refusal(a, c, job: str) -> None:
    ck = ckptd_client.Checkpointer(job, socket=str(c.socket))
    ck.save(2, state_of(3)).wait(60)
    ck.close()
    wait_for(lambda: status(c.socket)["memory"]["replication_failures"] >= 1, "C's replication to fail", 30)
    assert "replication failed" in c.log_text()
    assert not [s for s in held_steps(a.socket) if s["job"] == job]        # nothing was stored on A
    assert not held_steps(c.socket)[0]["replicated"]


def test_certificate_from_another_ca_is_refused(daemon_factory, tmp):
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", SECRET)
    a = daemon_factory(*peer_args(addrs[0], addrs, secret, *make_node(make_ca(tmp / "ca"), "a")), name="a")
    c = daemon_factory(*peer_args(addrs[1], addrs, secret, *make_node(make_ca(tmp / "other"), "c")), name="c")
    _save_and_expect_refusal(a, c, "foreign")
    assert "TLS handshake failed" in c.log_text()
    # the listener's side: the foreign certificate refused in its handshake, logged and counted
    assert "peer refused" in a.log_text() and "TLS handshake failed" in a.log_text()
    assert status(a.socket)["memory"]["peers_refused"] >= 1


def test_plain_daemon_cannot_replicate_to_a_tls_one(daemon_factory, tmp):
    """No hang either way: the plain side's copy fails within the io_timeout, logged."""
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", SECRET)
    quick = ("--peer-io-timeout", "3s")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret, *quick, *make_node(make_ca(tmp / "ca"), "a")), name="a")
    c = daemon_factory(*peer_args(addrs[1], addrs, secret, *quick), name="c")
    _save_and_expect_refusal(a, c, "plain")


def test_tls_settings_are_checked_at_start(tmp):
    """All three or none; the key file must be private like the secret file."""
    from ckptd.daemon.settings.config import ConfigError, load_settings
    ca = make_ca(tmp / "ca")
    flags = make_node(ca, "n")
    cert, key, cafile = flags[1], flags[3], flags[5]
    secret = secret_file(tmp / "s", SECRET)
    me, other = "127.0.0.1:7465", "127.0.0.2:7465"
    base = {"root": str(tmp), "peers.listen": me, "peers.peers": f"{me},{other}", "peers.secret_file": str(secret)}
    assert load_settings(cli=base, env={})["peers.tls_cert"] is None                 # off by default
    ok = load_settings(cli={**base, "peers.tls_cert": cert, "peers.tls_key": key, "peers.tls_ca": cafile}, env={})
    assert ok["peers.tls_ca"] == cafile
    with pytest.raises(ConfigError, match=r"missing: peers\.tls_key, peers\.tls_ca"):
        load_settings(cli={**base, "peers.tls_cert": cert}, env={})
    with pytest.raises(ConfigError, match=r"missing: peers\.tls_cert"):
        load_settings(cli={**base, "peers.tls_key": key, "peers.tls_ca": cafile}, env={})

    addr = f"127.0.0.1:{free_port()}"
    Path(key).chmod(0o644)
    with pytest.raises(RuntimeError, match="exited"):
        spawn_daemon(tmp / "root", tmp / "loose.sock", *peer_args(addr, [addr], secret, *flags), log=tmp / "loose.log")
    assert "chmod 600" in (tmp / "loose.log").read_text()
    Path(key).chmod(0o600)
    with pytest.raises(RuntimeError, match="exited"):
        spawn_daemon(tmp / "root", tmp / "gone.sock", *peer_args(addr, [addr], secret, *flags[:5], str(tmp / "nope")),
                     log=tmp / "gone.log")
    assert "peer TLS CA" in (tmp / "gone.log").read_text()
