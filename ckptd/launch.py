"""Start a private daemon as a child process and wait until it answers (public helper).

For jobs that bring their own daemon rather than use a node service: single-node jobs,
notebooks, the test suite, `make demo`, the benchmarks and the GPU check::

    with spawn_daemon(root, "/tmp/ckptd-job.sock", "--threads", "4") as daemon:
        ckpt = ckptd_client.Checkpointer(job="job", socket=str(daemon.socket))
        ...

The daemon is tied to this process: it gets SIGTERM when the spawning thread exits, SIGKILL
included (Linux; spawn from the main thread). ``Checkpointer(job, root=..., spawn=True)`` does
all of this for one process. The mechanism lives in ``ckptd.spawn`` (torch-free, daemon-free),
which the client imports too; this module is its name for scripts.

Node services run under systemd instead (packaging/systemd, docs/operations.md).
"""
from __future__ import annotations

from ckptd.spawn import DaemonProcess, spawn_daemon, spawn_private, wait_until_serving

__all__ = ["DaemonProcess", "spawn_daemon", "spawn_private", "wait_until_serving"]
