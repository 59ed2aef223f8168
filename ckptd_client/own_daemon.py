"""A ``Checkpointer``'s own daemon (``spawn=True``): started with it, stopped after it closes.

The process machinery is ``ckptd.spawn`` (shared with ``ckptd.launch``); this adds the
lifetime a notebook needs: a Checkpointer never closed still has its saves waited for and its
daemon stopped at interpreter exit, and a process that dies takes the daemon with it (the tie).
"""
from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable
from typing import Any

from ckptd.spawn import DaemonProcess, spawn_private

from .api_guard import ProcessOwner

log = logging.getLogger("ckptd_client")

STOP_TIMEOUT = 30.0    # seconds the daemon gets to exit after SIGTERM once every save has settled


class OwnDaemon:
    """A private daemon for ``root``; ``stop()`` ends it (once), as does interpreter exit."""

    def __init__(self, root: str, owner: Any, close_owner: Callable[[Any], object]) -> None:
        self.process: DaemonProcess = spawn_private(root)
        self.socket = str(self.process.socket)
        self.stopped = self.exiting = False
        owner_ref = weakref.ref(owner)      # atexit must not keep a dropped Checkpointer alive
        here = ProcessOwner()               # a forked child's exit leaves the parent's daemon alone

        def at_exit() -> None:
            if not here.here():
                return
            self.exiting = True             # stop() must not unregister the callback that is running
            alive = owner_ref()
            try:
                if alive is not None:
                    close_owner(alive)      # waits for the saves in flight, then calls stop()
            finally:
                self.stop()

        self.at_exit = at_exit
        atexit.register(at_exit)
        log.info("ckptd: started a private daemon (pid %d) for %s on %s", self.process.pid, root, self.socket)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM, a bounded wait, SIGKILL; the temporary directory (socket, log) removed. Once."""
        if not self.exiting:
            atexit.unregister(self.at_exit)
        if self.stopped:
            return
        self.stopped = True
        rc = self.process.close(STOP_TIMEOUT)
        if rc != 0:
            log.warning("ckptd: the private daemon (pid %d) exited with %s", self.pid, rc)
