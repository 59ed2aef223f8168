"""Rank processes forked from a process that has already imported torch, instead of started fresh.

A test's rank process (a trainer, a DCP or FSDP2 worker) spent 1.7 s of CPU importing torch and
2.8 s with FSDP2 and DTensor, before doing a few milliseconds of work: on this 2-core machine that
was about half the suite's CPU. ``popen`` hands such a command to a zygote, one per test process,
started on first use, which imported torch, torch.distributed (FSDP2, DTensor) and ckptd_client
once and forks a child per command. Each child is a real process of its own, with its own pid,
process group (``pgid``), environment, working directory, arguments and stdin/stdout/stderr (the
caller's file descriptors, passed over a unix socket with SCM_RIGHTS), running the script as
``__main__`` the way ``python script.py`` / ``python -c code`` does; signals, exit codes, SIGKILL
and every wire and file it touches are what they would be. What differs from a fresh interpreter,
and how this file deals with it:

- the zygote's imports are already done: a child's environment is set before its script runs, but
  what torch read at import (``OMP_NUM_THREADS``: set again with ``torch.set_num_threads``) does
  not change; random generators seeded from OS entropy draw their own numbers in each child
  (``random`` re-seeds itself after a fork, ``numpy.random`` is re-seeded if the zygote loaded it;
  torch's default generator starts from its fixed seed in both cases);
- exit: non-daemon threads are joined and ``atexit`` handlers run, then ``os._exit`` with the
  script's code, as an interpreter's finalization would; an uncaught exception prints its
  traceback and exits 1;
- the child's parent is the zygote, not the test: its exit status comes back through a pipe the
  zygote writes when it reaps it (``Process.wait``), negative for a signal as ``subprocess`` does.

``popen(..., preload=(...))`` forks from a second zygote that also imported those modules (Lightning
spends seconds in its import). ``CKPTD`` is ``python -m ckptd`` as a ``-c`` command the zygote can fork
(ckptd.cli is preloaded).

Commands it cannot run this way (``-m``, other interpreter flags than ``-B``/``-u``, a stdin pipe, an
env whose ``PYTHONPATH`` names a directory the zygote's imports were not found on)
go to ``subprocess.Popen`` unchanged, and so does ``test_dtensor_bind``'s, which is about a fresh
interpreter's import order. ``CKPTD_TEST_NO_ZYGOTE=1`` sends every command there.
"""
from __future__ import annotations

import array
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "ckptd_client", "ckptd.cli")
_FLAGS = {"-B", "-u"}
# The ``ckptd`` command (``python -m ckptd``) as a command the zygote forks: what ckptd/__main__.py runs.
CKPTD = [sys.executable, "-c", "import sys; from ckptd.cli import main; sys.exit(main())"]
_STATUS = struct.Struct("<i")

# ---- the caller's side ------------------------------------------------------------------------


class Process:
    """What tests use of ``subprocess.Popen``, for a child of the zygote: ``pid``, ``stdout``/``stderr``
    (when PIPE), ``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``/``kill``/``terminate``."""

    def __init__(self, pid: int, status_fd: int, stdout: IO[Any] | None, stderr: IO[Any] | None,
                 args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.stdin = None
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._status = status_fd
        self._outs: dict[str, Any] = {}
        self._readers: list[threading.Thread] | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        data = os.read(self._status, _STATUS.size)
        os.close(self._status)
        self._status = -1
        # No status: the zygote died before it reaped the child (the caller's process is ending).
        self.returncode = _STATUS.unpack(data)[0] if len(data) == _STATUS.size else -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None:
            raise ValueError("zygote processes take no stdin input")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._readers is None:       # once: a call after a timeout goes on with the same readers, so
            outs = self._outs           # what they read before it is kept (as subprocess.Popen keeps it)
            self._readers = [threading.Thread(target=lambda k=k, f=f: outs.__setitem__(k, f.read()), daemon=True)
                             for k, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
            for t in self._readers:
                t.start()
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._close_streams()
        return self._outs.get("out"), self._outs.get("err")

    def _close_streams(self) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_streams()
        self.wait()

    def __del__(self) -> None:
        if getattr(self, "_status", -1) >= 0:
            os.close(self._status)


class _Zygote:
    """A zygote of this process: started on first use; it exits when this process's connection to it
    closes (this process ended, whatever the way), leaving running children to finish as Popen's would.
    ``extra``: modules it imports besides PRELOAD (one zygote per set: ``popen``'s ``preload``)."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.extra = extra
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def connect(self) -> socket.socket:
        if self.sock is None or self.proc is None or self.proc.poll() is not None:
            if self.sock is not None:          # its zygote is gone: a new one, a new connection
                self.sock.close()
            path = os.path.join(tempfile.mkdtemp(prefix="ckz-", dir="/tmp"), "z.sock")   # (removed on connect)
            ready_r, ready_w = os.pipe()
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), path, str(ready_w),
                                          *self.extra],
                                         stdin=subprocess.DEVNULL, pass_fds=(ready_w,))
            os.close(ready_w)
            try:
                if not select.select([ready_r], [], [], 120)[0] or os.read(ready_r, 1) != b"1":
                    raise RuntimeError(f"the zygote did not start (exit {self.proc.poll()})")
            finally:
                os.close(ready_r)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)
        return self.sock

    def spawn(self, request: dict[str, Any], fds: list[int]) -> tuple[int, int]:
        """(pid, the read end of its status pipe)."""
        status_r, status_w = os.pipe()
        try:
            with self.lock:
                sock = self.connect()
                body = json.dumps(request).encode()
                sock.sendmsg([struct.pack("<I", len(body)), body],
                             [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [*fds, status_w]))])
                pid = struct.unpack("<i", _recv_exact(sock, 4))[0]
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        if pid <= 0:
            os.close(status_r)
            raise OSError(-pid, f"the zygote could not fork: {os.strerror(-pid)}")
        return pid, status_r


_ZYGOTES: dict[tuple[str, ...], _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def _zygote(extra: tuple[str, ...]) -> _Zygote:
    with _ZYGOTES_LOCK:
        if extra not in _ZYGOTES:
            _ZYGOTES[extra] = _Zygote(extra)
        return _ZYGOTES[extra]


Proc = Process | subprocess.Popen   # what popen returns


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the zygote closed the connection")
        buf += part
    return buf


def _forkable(args: list[str]) -> bool:
    if not args or args[0] != sys.executable:
        return False
    rest = args[1:]
    while rest and rest[0] in _FLAGS:
        rest = rest[1:]
    return bool(rest) and (rest[0] == "-c" and len(rest) >= 2 or rest[0].endswith(".py"))


def _fd_for(spec: Any, default: int, mode: str, mine: list[int], theirs: list[int]) -> int:
    """The descriptor a child gets for one of its standard streams (PIPE: a new pipe)."""
    if spec is None:
        return default
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        theirs.append(fd)
        return fd
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        mine.append(r if mode == "r" else w)
        theirs.append(w if mode == "r" else r)
        return w if mode == "r" else r
    return spec if isinstance(spec, int) else spec.fileno()


def _paths_of_its_own(env: dict[str, str] | None) -> bool:
    """Whether ``env``'s PYTHONPATH names a directory the zygote's imports were not found on (this
    process's sys.path, or the repository's root, where ckptd is): a command that shadows a module
    must import it afresh."""
    if env is None:
        return False
    want = {os.path.realpath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    have = {os.path.realpath(p or ".") for p in sys.path} | {str(Path(__file__).resolve().parent.parent)}
    return not want <= have


def popen(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
          stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False,
          pgid: int | None = None, preload: tuple[str, ...] = ()) -> Process | subprocess.Popen[Any]:
    """``subprocess.Popen(args, ...)``, forked from the zygote where it can be (module docstring);
    ``pgid``: the child's process group (0: its own; a pid: that leader's), as ``os.setpgid(0, pgid)``;
    ``preload``: modules besides PRELOAD the command imports (lightning: seconds each time), forked from
    a zygote of this process that imported them too."""
    args = [str(a) for a in args]
    if os.environ.get("CKPTD_TEST_NO_ZYGOTE") or not _forkable(args) or stdin == subprocess.PIPE \
            or _paths_of_its_own(env):
        pre = None if pgid is None else (lambda: os.setpgid(0, pgid))
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                preexec_fn=pre)
    mine: list[int] = []
    theirs: list[int] = []
    try:
        fd_in = _fd_for(stdin, 0, "w", mine, theirs)
        fd_out = _fd_for(stdout, 1, "r", mine, theirs)
        fd_err = fd_out if stderr == subprocess.STDOUT else _fd_for(stderr, 2, "r", mine, theirs)
        request = {"args": args[1:], "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "pgid": pgid}
        pid, status = _zygote(tuple(preload)).spawn(request, [fd_in, fd_out, fd_err])
    except BaseException:
        for fd in mine:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)

    def wrap(fd: int) -> IO[Any]:
        raw = open(fd, "rb")
        return io.TextIOWrapper(raw, encoding="utf-8", errors="strict") if text else raw
    it = iter(mine)           # the caller's ends of the pipes, stdout's first
    out = wrap(next(it)) if stdout == subprocess.PIPE else None
    err = wrap(next(it)) if stderr == subprocess.PIPE else None
    return Process(pid, status, out, err, args)


def run(args: list[str], *, capture_output: bool = False, text: bool = False, timeout: float | None = None,
        env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
        check: bool = False, preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` through ``popen``."""
    pipe = subprocess.PIPE if capture_output else None
    p = popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, text=text, preload=preload)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    done = subprocess.CompletedProcess(args, p.wait(), out, err)
    if check:
        done.check_returncode()
    return done


# ---- the zygote -------------------------------------------------------------------------------

def _child(request: dict[str, Any], fds: list[int], close: list[int]) -> None:
    """In the forked child: become the command, run it, exit as an interpreter would. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        if request["pgid"] is not None:
            os.setpgid(0, request["pgid"])
        for target, fd in zip((0, 1, 2), fds[:3], strict=True):
            if fd != target:
                os.dup2(fd, target)
        for fd in set(fds[:3]):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # (random re-seeds itself after os.fork; numpy.random, seeded once at its import, would not)
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()
        import torch
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        args = list(request["args"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        while args[0] in _FLAGS:
            unbuffered |= args[0] == "-u"
            sys.dont_write_bytecode |= args[0] == "-B"
            args.pop(0)
        if unbuffered:
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
        code = _run(args)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]   # as interpreter finalization: join threads
            import atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(args: list[str]) -> int:
    """``args`` (after the interpreter flags) as ``__main__``; the exit code."""
    import runpy
    import types
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(args[0])
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return int(e.code)
        print(e.code, file=sys.stderr)
        return 1


def serve(path: str, ready: int, extra: list[str]) -> None:
    """The zygote's loop: one connection per caller's process; a request forks a child."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")     # (children set their own: _child)
    import importlib
    for name in (*PRELOAD, *extra):
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    os.write(ready, b"1")
    os.close(ready)
    conns: list[Any] = []
    status: dict[int, int] = {}          # child pid → the write end of its status pipe
    while True:
        readable = select.select([listener, wake_r, *conns], [], [], None if conns else 120)[0]
        if not readable and not conns:
            return             # nobody connected: the caller died before it could
        if wake_r in readable:
            os.read(wake_r, 4096)
        while status:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd = status.pop(pid, None)
            if fd is not None:
                os.write(fd, _STATUS.pack(-os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)))
                os.close(fd)
        if listener in readable:
            conns.append(listener.accept()[0])
            if os.path.exists(path):         # one caller: nobody else connects; leave nothing in /tmp
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
        for conn in [c for c in conns if c in readable]:
            try:
                request, fds = _receive(conn)
            except (ConnectionError, OSError, ValueError):
                conns.remove(conn)
                conn.close()
                if not conns:
                    return             # the caller's process closed its connection: done
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:
                pid = -(e.errno or 1)
            if pid == 0:
                _child(request, fds, [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in conns),
                                      *status.values(), fds[3]])
            for fd in fds[:3]:
                os.close(fd)
            if pid > 0 and request["pgid"] is not None:
                # The child sets its group too; set here as well, the group exists before the reply
                # (the next rank joins it), as Popen's preexec_fn had it done before returning.
                try:
                    os.setpgid(pid, request["pgid"] or pid)
                except OSError:
                    pass        # (the child set it already, or died)
            if pid > 0:
                status[pid] = fds[3]
            else:
                os.close(fds[3])
            conn.sendall(struct.pack("<i", pid))


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    head, anc, _, _ = conn.recvmsg(4, socket.CMSG_LEN(4 * fds.itemsize))
    if len(head) < 4:
        raise ConnectionError("closed")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected 4 descriptors, got {len(fds)}")
    body = _recv_exact(conn, struct.unpack("<I", head)[0])
    return json.loads(body), list(fds)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
