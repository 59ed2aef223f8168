"""Loopback ports for the tests' servers: one place, safe when pytest-xdist runs tests side by side.

A port found by binding port 0 and closing the socket is in Linux's ephemeral range (32768 up): any
outgoing connection — another test's store client, a gloo pair — may take it before the server that
was meant to get it binds. Ports are picked here below that range instead, at random in a span of
their own for each xdist worker (``PYTEST_XDIST_WORKER`` gwN of ``PYTEST_XDIST_WORKER_COUNT``,
inherited by the processes a test starts), and checked free by binding them. The local SeaweedFS
takes its ports from the same span (``conftest.seaweed``).
"""
from __future__ import annotations

import os

from ckptd.s3_local import PORT_SPAN, free_ports


def worker_span(env: dict[str, str] | None = None) -> tuple[int, int]:
    """The [lo, hi) ports this xdist worker (or a serial run: the whole span) picks from."""
    env = dict(os.environ) if env is None else env
    lo, hi = PORT_SPAN
    worker, count = env.get("PYTEST_XDIST_WORKER", ""), int(env.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return lo, hi
    k, width = int(worker[2:]), (hi - lo) // count
    return lo + k * width, lo + (k + 1) * width


SPAN = worker_span()


def free_port() -> int:
    """One loopback port free now, in this worker's span."""
    return free_ports(1, SPAN)[0]
