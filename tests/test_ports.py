"""tests/ports.py: each xdist worker's ports lie in a span of its own, below the ephemeral range."""
from __future__ import annotations

import socket

from ports import free_port, worker_span

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", PORT_SPAN[0]))
        picked = free_ports(3, (PORT_SPAN[0], PORT_SPAN[0] + 6))
        assert PORT_SPAN[0] not in picked and len(set(picked)) == 3
