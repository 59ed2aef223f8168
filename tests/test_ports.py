"""tests/ports.py: each xdist worker's ports lie in a span of its own, below the ephemeral range."""
from __future__ import annotations

import socket

import pytest
from ports import SPAN, free_port, worker_span

from ckptd.s3_local import PORT_SPAN, free_ports


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_worker_spans_are_disjoint_and_cover_the_span():
    spans = [worker_span({"PYTEST_XDIST_WORKER": f"gw{k}", "PYTEST_XDIST_WORKER_COUNT": "3"}) for k in range(3)]
    assert spans[0][0] == PORT_SPAN[0] and spans[-1][1] <= PORT_SPAN[1]
    for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False):
        assert hi == lo                                       # next to each other, no overlap
    assert worker_span({}) == PORT_SPAN                       # a serial run: the whole span
    assert worker_span({"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "2"}) == PORT_SPAN


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(20, (PORT_SPAN[0], PORT_SPAN[0] + 200))
    assert len(set(ports)) == 20 and all(PORT_SPAN[0] <= p < PORT_SPAN[0] + 200 for p in ports)
    assert PORT_SPAN[1] <= _ephemeral_low()
    p = free_port()
    with socket.socket() as s:                                # free: a server can bind it now
        s.bind(("127.0.0.1", p))


def test_a_bound_port_is_never_picked():
    # A port of this worker's own span (another worker's servers may hold any port of theirs), bound
    # here; picking 3 of the 6 ports from it on, 20 times, would take it about half the time if
    # free_ports did not check.
    bound = free_ports(1, (SPAN[0], SPAN[1] - 6))[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", bound))
        for _ in range(20):
            picked = free_ports(3, (bound, bound + 6))
            assert bound not in picked and len(set(picked)) == 3


def test_a_span_without_enough_free_ports_raises_instead_of_spinning():
    lo = free_ports(1, (SPAN[0], SPAN[1] - 6))[0]
    held = []
    for port in range(lo, lo + 6):              # every port of the span taken (a few may be already)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        held.append(s)
    try:
        with pytest.raises(OSError, match="only 0 of the 3 loopback ports asked for are free"):
            free_ports(3, (lo, lo + 6))
    finally:
        for s in held:
            s.close()
