"""TLS on peer traffic (``peers.tls_cert``/``tls_key``/``tls_ca``): the two ``ssl`` contexts, built once.

Mutual TLS: the listener requires a client certificate signed by ``tls_ca``, a link checks the
listener's certificate against it. Peers are addressed by ``host:port`` (often an IP), so only the
chain is verified, not the host name; the CA is the trust boundary. The HMAC handshake of
``ckptd.core.peer_protocol`` runs unchanged inside the TLS stream.
"""
from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerTLS:
    server: ssl.SSLContext       # for Channel.start_tls on an accepted connection
    client: ssl.SSLContext       # for Channel.connect(tls=...): no SNI, the chain checked


def check_file(what: str, path: str, private: bool) -> None:
    """A file the daemon reads at start (``what``: "peer secret file", "peer TLS key", ...): a regular
    file it can read; ``private`` (a secret or a key): also owned by root or this daemon's user and
    closed to group and others. RuntimeError (the daemon does not start) naming the fix otherwise."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise RuntimeError(f"{what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RuntimeError(f"{what} {path}: not a regular file")
    if private and st.st_mode & 0o077:
        raise RuntimeError(f"{what} {path} is readable or writable by group or others "
                           f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    if private and st.st_uid not in (0, os.geteuid()):
        raise RuntimeError(f"{what} {path} belongs to uid {st.st_uid}, not root or this daemon's user")
    if not os.access(path, os.R_OK):
        raise RuntimeError(f"{what} {path}: not readable by this daemon")


def load_tls(cert: str | None, key: str | None, ca: str | None) -> PeerTLS | None:
    """None when TLS is off (none of the three set; the settings refuse a partial set). RuntimeError
    (the daemon does not start) when a file is missing, unreadable, too open or not valid PEM."""
    if cert is None or key is None or ca is None:
        return None
    check_file("peer TLS certificate", cert, False)
    check_file("peer TLS key", key, True)
    check_file("peer TLS CA", ca, False)
    contexts = []
    for ctx in (ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(cert, key)
            ctx.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as e:
            raise RuntimeError(f"peer TLS: cannot load {cert} / {key} / {ca}: {e}") from None
        contexts.append(ctx)
    return PeerTLS(server=contexts[0], client=contexts[1])
