"""Settings of the memory tier and of peer copies (``[memory]``, ``[peers]``); config.py gathers them."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ckptd.core.peer_protocol import IO_TIMEOUT_S
from ckptd.daemon.settings.spec import (
    Flag,
    integer,
    listof,
    optional_path,
    optional_peer_address,
    parse_duration,
    parse_size,
    peer_address,
    setting,
    show_duration,
    show_size,
)

MIN_IO_TIMEOUT_S, MAX_IO_TIMEOUT_S = 0.1, 3600.0
REDUNDANCY = ("copies", "parity")
MAX_GROUP = 64                      # stripes.MAX_GROUP (settings import only core)


def _io_timeout(v: object) -> float:
    """A duration in [0.1 s, 1 h]: 0 would mean no bound at all, which is the defect it exists for."""
    s = parse_duration(v)
    if not MIN_IO_TIMEOUT_S <= s <= MAX_IO_TIMEOUT_S:
        raise ValueError(f"must be between {MIN_IO_TIMEOUT_S:g} s and {MAX_IO_TIMEOUT_S:g} s, got {s:g}")
    return s


def _probe_interval(v: object) -> float:
    """0 (off) or a duration in [0.1 s, 1 h]."""
    s = parse_duration(v)
    if s != 0 and not MIN_IO_TIMEOUT_S <= s <= MAX_IO_TIMEOUT_S:
        raise ValueError(f"must be 0 (off) or between {MIN_IO_TIMEOUT_S:g} s and {MAX_IO_TIMEOUT_S:g} s, got {s:g}")
    return s


def _default_memory_budget() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclass(frozen=True)
class MemorySettings:
    """``[memory]``: the memory tier (recent committed steps kept resident for fast restores)."""
    steps: int = setting(
        1, parse=integer(0, 64), flags=(Flag("--memory-steps"),),
        doc="Newest committed steps per job kept in the daemon's memory after they are written, as raw bytes, "
            "so a restarted trainer restores by a memory copy; `0` turns the memory tier off (and peer copies).")
    budget: int = setting(
        factory=_default_memory_budget, parse=parse_size, show=show_size, default_doc="a quarter of RAM",
        flags=(Flag("--memory-budget"),),
        doc="Most bytes the memory tier holds on this node, own shards and peers' replicas together; the "
            "oldest shards are evicted first (never one a restore is reading), and a shard that cannot fit "
            "is not held (storage serves it).")
    shm_dir: str | None = setting(
        None, parse=optional_path, default_doc="memfds", flags=(Flag("--shm-dir"),),
        doc="A directory on a tmpfs mount where the daemon makes its shared memory (slots, held shards, peers' "
            "replicas) as unnamed files instead of memfds: mounted with `huge=within_size` it gives them 2 MiB "
            "pages without changing the node's `shmem_enabled` (docs/operations.md). The daemon refuses to start "
            "unless it is a tmpfs directory owned by root or its user that no one else may write. Its files cannot "
            "be sealed against resizing as memfds are: a permitted user who shrinks a slot it was given can "
            "crash the daemon (SIGBUS), so use it only where every permitted user is trusted (it warns at start).")


@dataclass(frozen=True)
class PeerSettings:
    """``[peers]``: copies of this node's shards in other nodes' daemons' memory."""
    listen: str | None = setting(
        None, parse=optional_peer_address, default_doc="off", flags=(Flag("--peer-listen"),),
        doc="TCP `\"host:port\"` this daemon accepts peer daemons on; `\"\"` is off. The port must be open "
            "between the nodes (see the systemd unit's IPAddressAllow).")
    peers: list[str] = setting(
        factory=list, parse=listof(peer_address), repeat=True, flags=(Flag("--peer"),),
        doc="Every node's peer address, in the same order on every node (this node included).")
    name: str | None = setting(
        None, parse=optional_peer_address, default_doc="`listen`", flags=(Flag("--peer-name"),),
        doc="This node's entry in `peers`, when it differs from `listen` (e.g. listen on `0.0.0.0:7465`).")
    secret_file: str | None = setting(
        None, parse=optional_path, flags=(Flag("--peer-secret-file"),),
        doc="File holding the shared secret peers authenticate with (HMAC challenge both ways); it must be "
            "owned by root or the daemon's user and readable by nobody else, or the daemon refuses to start.")
    replicas: int = setting(
        1, parse=integer(1, 16), flags=(Flag("--peer-replicas"),),
        doc="K: peer daemons each of this node's shards is copied to (a step is *replicated* with K + 1 "
            "copies in memory).")
    jump: int = setting(
        1, parse=integer(1, 1 << 16), flags=(Flag("--peer-jump"),),
        doc="Copies of the node at position i of `peers` go to positions i + j·jump (j = 1..K): a jump of "
            "a rack's node count puts them in other racks.")
    bandwidth: int = setting(
        1024**3, parse=parse_size, show=show_size, flags=(Flag("--peer-bandwidth"),),
        doc="Bytes per second this node sends to peers at most (token bucket); `0` is unlimited.")
    io_timeout: float = setting(
        IO_TIMEOUT_S, parse=_io_timeout, show=show_duration, flags=(Flag("--peer-io-timeout"),),
        doc="Longest a peer may go without sending or taking a byte (connect, handshake, every read and "
            "write); past it that one copy or fetch fails, is logged with the peer's address and counted, "
            "and the other peers and storage go on. 0.1 s to 1 h.")
    probe_interval: float = setting(
        10.0, parse=_probe_interval, show=show_duration, flags=(Flag("--peer-probe-interval"),),
        doc="How often this node asks each of its K targets whether it still holds the copies it acknowledged "
            "(one connection per target a round, `has` per shard, each bounded by `io_timeout`): a copy a "
            "target lost (restarted, trimmed, evicted) or a target that cannot be reached stops counting, so "
            "`replicated` and `ckptd_memory_degraded_steps` say so within `probe_interval` + `io_timeout`; "
            "a target reachable again is asked about those and they count again once it confirms them. "
            "A lost copy of a job's newest held step is sent to its target again (at most 3 times per copy); "
            "an older step's is not. In parity mode each parity holder of the newest step's acknowledged "
            "pieces is asked for its records (`group_report`), and a piece it lost is sent again the same "
            "way (docs/erasure-coding.md). `0` turns the probe off: lost copies and pieces are then neither "
            "seen nor sent again.")
    redundancy: str = setting(
        "copies", choices=REDUNDANCY, flags=(Flag("--peer-redundancy"),),
        doc="How a lost node's held shards survive: `copies` (K full copies on peers, `replicas`) or `parity` "
            "(erasure-coded: groups of `group` nodes of `peers`, `parity` pieces per stripe; any `parity` nodes "
            "of a group may be lost, at about parity/(group − parity) of a shard's memory per node; "
            "docs/erasure-coding.md).")
    group: int = setting(
        4, parse=integer(3, MAX_GROUP), flags=(Flag("--peer-group"),),
        doc="G: nodes per parity group (`redundancy = \"parity\"`), cut from `peers` in the `jump` order; "
            "at least `parity` + 2 and at most the number of peers (the last group takes the remainder).")
    parity: int = setting(
        1, parse=integer(1, 16), flags=(Flag("--peer-parity"),),
        doc="P: parity pieces per stripe (`redundancy = \"parity\"`): 1 is XOR, 2 or more Reed-Solomon "
            "(ISA-L); a group survives the loss of any P of its nodes.")
    tls_cert: str | None = setting(
        None, parse=optional_path, default_doc="off", flags=(Flag("--peer-tls-cert"),),
        doc="This node's certificate (PEM) for TLS on peer traffic. TLS is on when `tls_cert`, `tls_key` and "
            "`tls_ca` are all set: mutual TLS 1.2 or later, each side's certificate checked against `tls_ca` "
            "(the chain only: peers are addressed by IP), the HMAC handshake on top; off by default.")
    tls_key: str | None = setting(
        None, parse=optional_path, default_doc="off", flags=(Flag("--peer-tls-key"),),
        doc="This node's private key (PEM) for `tls_cert`; like `secret_file` it must be readable by nobody "
            "but root or the daemon's user, or the daemon refuses to start.")
    tls_ca: str | None = setting(
        None, parse=optional_path, default_doc="off", flags=(Flag("--peer-tls-ca"),),
        doc="CA certificate(s) (PEM) that every peer's certificate must be signed by; a TLS daemon and a "
            "plain one cannot talk (that copy fails and is logged).")


def check_peers(memory: MemorySettings, p: PeerSettings, src: dict[str, str], error: type[Exception]) -> None:
    """Raise ``error`` when these settings cannot start a daemon."""
    if p.listen is None and not p.peers:
        return
    if memory.steps == 0:
        raise error(f"{src['peers.listen']}: peers: peer copies live in the memory tier; memory.steps is 0")
    if p.secret_file is None:
        raise error(f"{src['peers.secret_file']}: peers.secret_file: peers need a shared secret file")
    tls = {"tls_cert": p.tls_cert, "tls_key": p.tls_key, "tls_ca": p.tls_ca}
    missing = [k for k, v in tls.items() if v is None]
    if 0 < len(missing) < len(tls):
        raise error(f"{src['peers.' + missing[0]]}: peers.{missing[0]}: TLS on peer traffic needs tls_cert, "
                    f"tls_key and tls_ca together; missing: {', '.join('peers.' + k for k in missing)}")
    me = p.name or p.listen
    if p.peers and me not in p.peers:
        raise error(f"{src['peers.peers']}: peers.peers: this node ({me}) is not in the list; set peers.name "
                    "to its entry")
    if p.redundancy == "parity":
        where = src["peers.redundancy"]
        if p.group < p.parity + 2:
            raise error(f"{where}: peers.group: a parity group of G = {p.group} with P = {p.parity} parity pieces "
                        f"per stripe must have G >= P + 2 = {p.parity + 2} (else parity is a full copy)")
        if p.peers and len(p.peers) < p.group:
            raise error(f"{where}: peers.peers: parity groups of G = {p.group} need at least {p.group} nodes in "
                        f"peers, got {len(p.peers)}")
