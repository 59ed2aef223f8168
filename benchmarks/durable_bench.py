"""Time to durable and restore of one rank's ~1 GiB GPT-like state against the disk's own limit, one run.

    .venv/bin/python benchmarks/durable_bench.py [--size-mib 1024] [--rounds 10] [--warmup 4] [--dir DIR]

One process, one rank. The state is a dict of plain tensors as a GPT-style model trained in bf16
with AdamW leaves it: bf16 weights, then per parameter a 0-d fp32 ``step``, the fp32 master weight,
``exp_avg`` and ``exp_avg_sq`` (``--size-mib`` in all). Round by round, on the same disk, the
disk's limit and the four methods' saves in an order that changes each round (``williams``): over
the 10 measured rounds each of the five comes right after each other one exactly twice, and first
(after the last round's restores, which only read) twice. What came before matters on this VM: a
save right after the disk test's 6 GiB of writes measured 0.36-0.41 s to durable against
0.31-0.35 s otherwise. A rotation keeps each one's predecessor fixed (ckptd followed the disk test
whenever the disk was in the cycle), and the disk test always first, as the run before this
design had it, measured the limit on a rested disk and every method after someone's writes:

- ``disk``: the physical limit, measured in the same round: a fresh file in the same directory
  tree, ``S`` bytes written by plain ``os.write`` of 64 MiB buffers, then ``os.fsync`` — once
  with ``S`` = the bytes ckptd stored for its last step, once with ``S`` = the raw state size —
  and the same again with writeback started every 32 MiB as it writes (``sync_file_range``, as
  ckptd's writer does; faster on some disks), and with ``O_DIRECT`` writes of 32 MiB from an
  aligned buffer (around the page cache, as ckptd's ``direct_io`` writes; faster on others); the
  limit is the fastest of the three;
- ``ckptd``: ``Checkpointer.save`` to a real daemon (``ckptd.launch.spawn_daemon``, memory tier
  on, its default, ``codec_mode = "adaptive"``, the default), ``commit="local"``; time to durable
  = from the ``save()`` call to the handle committed (the step's ``index.json`` durable);
- ``ckptd_always``: the same with a second daemon run with ``--codec-mode always`` (every chunk
  encoded, as before ``adaptive`` existed): the before/after of the adaptive writer in one run;
- ``DCP``: ``torch.distributed.checkpoint.async_save`` with its default stager on a one-rank gloo
  group; time to durable = until its future is done (FileSystemWriter fsyncs its files);
- ``torch_checkpointing``: its async ``CheckpointManager`` (``use_direct_io=False``); it never
  fsyncs, so its "done" is the files written to the page cache; an explicit fsync of its files
  afterwards is timed apart (not part of its figure, and so no dirty pages of it leak into the
  next method's time).

Every timed operation (save, disk write, restore) starts after ``os.sync()`` and twice the state's
size written to a scratch file and removed unsynced (``Quiesce``: this VM hands memory that stays
free to its host, and page cache allocated there is slow; the effect is measured once at the
start, ``vm_page_cache``). After the saves, each method's checkpoint is
restored into zeroed tensors: warm (every file of it read once first, so it is in the page cache)
and cold (``os.sync()`` then ``posix_fadvise(DONTNEED)`` on every file of it): ckptd
``Checkpointer(memory=False).restore`` (storage, not the daemon's memory), DCP ``load``,
torch_checkpointing ``CheckpointManager.load``. Every restore is checked bit-exact
(``torch.equal`` on every tensor) outside the timing; then DCP's and torch_checkpointing's
checkpoints are deleted (ckptd's daemon runs with ``--keep-last 1``). The first ``--warmup``
rounds are not reported (4: a daemon's ``direct_io = auto`` times two shards each way before it
chooses). Results: benchmarks/results/durable.md and durable.json.
"""
from __future__ import annotations

import argparse
import math
import mmap
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.core import storage  # noqa: E402
from ckptd.core.names import step_dir  # noqa: E402
from ckptd.launch import spawn_daemon  # noqa: E402

from common import RESULTS, fmt, machine_info, median, synthetic_weights, table, write_results  # noqa: E402

JOB = "durable"
LAYERS = 8
BUF = 64 * 2**20
READ_PIECE = 16 * 2**20     # the disk's cold read (disk_read): per preadv
SAVES = ("disk", "ckptd", "ckptd_always", "dcp", "tc")       # in a round's order: williams()
RESTORES = ("ckptd", "ckptd_always", "dcp", "tc")
LABELS = {"ckptd": "ckptd", "ckptd_always": "ckptd (codec_mode always)", "dcp": "DCP", "tc": "torch_checkpointing"}
WRITEBACK = 32 * 2**20

State = dict[str, dict[str, torch.Tensor]]


# ---- the state --------------------------------------------------------------------------------

def williams(n: int) -> list[list[int]]:
    """Orders of ``n`` items, one per round (a Williams design): across all of them each item comes
    right after each other item equally often, and is first equally often (``2n`` orders for odd
    ``n``, ``n`` for even). A rotation of one order keeps every item's predecessor the same."""
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    return orders + [o[::-1] for o in orders] if n % 2 else orders


def gpt_shapes(size_mib: int) -> dict[str, tuple[int, ...]]:
    """A GPT-2-like model (``LAYERS`` blocks of width d, a multiple of 64) whose bf16 weights, fp32
    master weights and two fp32 Adam moments (14 bytes a parameter) come to about ``size_mib``: the
    token embedding's rows take what the blocks leave."""
    params = size_mib * 2**20 // 14
    d = max(64, int(math.sqrt(params / (LAYERS * 12 + 8)) // 64 * 64))
    vocab = max(64, (params - LAYERS * (12 * d * d + 2 * d) - d) // d)
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, d)}
    for i in range(LAYERS):
        p = f"h.{i}."
        shapes.update({p + "ln_1.weight": (d,), p + "attn.c_attn.weight": (3 * d, d),
                       p + "attn.c_proj.weight": (d, d), p + "ln_2.weight": (d,),
                       p + "mlp.c_fc.weight": (4 * d, d), p + "mlp.c_proj.weight": (d, 4 * d)})
    shapes["ln_f.weight"] = (d,)
    return shapes


def make_state(size_mib: int) -> State:
    """The model's bf16 weights, then per parameter what AdamW keeps of it (as ``optimizer.state_dict()``
    orders it): a 0-d fp32 ``step`` first, then the fp32 master weight, ``exp_avg`` and ``exp_avg_sq``."""
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(gpt_shapes(size_mib).items()):
        n = math.prod(shape)
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            master = (1 + synthetic_weights(n, torch.float32, seed=3 * i)).reshape(shape)
        else:
            master = synthetic_weights(n, torch.float32, seed=3 * i).reshape(shape)
        model[name] = master.to(torch.bfloat16)
        optim[f"optim_{name.replace('.', '_')}"] = {      # (torch_checkpointing: top-level keys [A-Za-z0-9_-])
            "step": torch.tensor(1000.0), "master": master,
            "exp_avg": synthetic_weights(n, torch.float32, seed=3 * i + 1, scale=1e-3).reshape(shape),
            "exp_avg_sq": synthetic_weights(n, torch.float32, seed=3 * i + 2, scale=1e-3).reshape(shape).square_()}
    return {"model": model, **optim}


def tensors(state: State) -> list[tuple[str, torch.Tensor]]:
    return [(f"{g}.{k}", t) for g, d in state.items() for k, t in d.items()]


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors(state))


def zero(state: State) -> None:
    for _, t in tensors(state):
        t.zero_()


def bit_exact(live: State, source: State) -> bool:
    return all(torch.equal(live[g][k], t) for g, d in source.items() for k, t in d.items())


# ---- files ------------------------------------------------------------------------------------

def files_under(directory: Path) -> list[Path]:
    return [f for f in directory.rglob("*") if f.is_file()]


def drop_cache(directory: Path) -> None:
    """Every file under ``directory`` out of the page cache, after ``os.sync()`` (clean pages only go)."""
    os.sync()
    for f in files_under(directory):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(directory: Path) -> None:
    """Every file under ``directory`` read once, so it is in the page cache."""
    for f in files_under(directory):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(BUF):
                pass


def disk_read(directory: Path, bufs: list[memoryview]) -> None:
    """Every file under ``directory`` read once in ``READ_PIECE`` pieces, on one thread per buffer of
    ``bufs`` (each reads into its own, already touched): the disk's read of those bytes, nothing checked
    or decoded. Of the ways measured here (2 or 4 threads, 4 or 16 MiB pieces, POSIX_FADV_WILLNEED, O_DIRECT),
    the fastest cold (within 15 %; O_DIRECT slower)."""
    pieces = [(f, off) for f in files_under(directory) for off in range(0, f.stat().st_size, READ_PIECE)]
    fds = {f: os.open(f, os.O_RDONLY) for f in {f for f, _ in pieces}}

    def read(i: int) -> None:
        for f, off in pieces[i::len(bufs)]:
            os.preadv(fds[f], [bufs[i]], off)
    try:
        workers = [threading.Thread(target=read, args=(i,)) for i in range(len(bufs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for fd in fds.values():
            os.close(fd)


def fsync_tree(directory: Path) -> None:
    for f in files_under(directory):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(path: Path, size: int, buf: memoryview, fsync: bool = True, writeback: bool = False,
               direct: bool = False) -> tuple[float, float]:
    """``size`` bytes to a fresh file by plain os.write of ``buf``-sized pieces (``writeback``: starting
    writeback of every WRITEBACK bytes as they are written; ``direct``: its whole blocks first by
    ``O_DIRECT`` writes of up to WRITEBACK bytes, ``buf`` page-aligned, around the page cache), then
    os.fsync; the file is removed after. Returns (seconds of the writes, seconds of the fsync), or
    (inf, inf) where the file system refuses ``O_DIRECT``."""
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pos = 0
        if direct:
            try:
                dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                return math.inf, math.inf
            try:
                body = size // storage.DIRECT_BLOCK * storage.DIRECT_BLOCK
                while pos < body:
                    pos += os.pwrite(dfd, buf[:min(body - pos, len(buf), WRITEBACK)], pos)
            finally:
                os.close(dfd)
            os.lseek(fd, pos, os.SEEK_SET)
        left, flushed = size - pos, pos
        while left:
            n = os.write(fd, buf[:min(left, len(buf), WRITEBACK)])
            left -= n
            pos += n
            if writeback and pos - flushed >= WRITEBACK:
                storage.start_writeback(fd, flushed, pos - flushed)
                flushed = pos
        t1 = time.monotonic()
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
        t2 = time.monotonic()
        path.unlink()
    return t1 - t0, t2 - t1


def disk_write(path: Path, size: int, buf: memoryview, writeback: bool = False,
               direct: bool = False) -> tuple[float, float]:
    """Seconds to write ``size`` bytes to a fresh file (``write_file``), then fsync (the physical limit),
    and of them the writes alone (until the last write() returned, before the fsync)."""
    writes, flush = write_file(path, size, buf, writeback=writeback, direct=direct)
    return writes + flush, writes


class Quiesce:
    """What every timed operation starts from: ``os.sync()`` (no method's dirty pages left to be written
    back in another's time), then ``nbytes`` written to a scratch file and removed unsynced (never sent to
    the disk). The second step undoes a VM artifact: page cache written after a few idle seconds is several
    times slower to fill than right after other memory was freed (measured at the start of the run,
    ``vm_page_cache``; this VM's balloon has free page reporting on, which would explain it). After it, every
    operation finds recently freed memory, as on a bare machine."""

    def __init__(self, path: Path, nbytes: int, buf: memoryview) -> None:
        self.path, self.nbytes, self.buf = path, nbytes, buf

    def __call__(self) -> None:
        os.sync()
        write_file(self.path, self.nbytes, self.buf, fsync=False)


def vm_page_cache(path: Path, nbytes: int, buf: memoryview, idle_s: float = 10) -> dict[str, Any]:
    """The artifact Quiesce removes, measured: a write + fsync of ``nbytes`` after ``idle_s`` idle, then the
    same right after (memory the first one freed)."""
    os.sync()
    time.sleep(idle_s)
    out: dict[str, Any] = {"bytes": nbytes, "idle_s": idle_s}
    for key in ("after_idle", "right_after"):
        os.sync()
        out[key] = dict(zip(("write_s", "fsync_s"), write_file(path, nbytes, buf), strict=True))
    return out


def disk_round(directory: Path, stored: int, raw: int, buf: memoryview, abuf: memoryview,
               quiesce: Quiesce) -> dict[str, Any]:
    """The disk's write + fsync of a fresh file: ckptd's stored bytes, then the raw bytes, plainly, with
    writeback started as it writes and around the page cache; ``stored_s`` / ``raw_s`` are the fastest of
    the three (the limit)."""
    out: dict[str, Any] = {"stored_size": stored, "raw_size": raw}
    for key, size in (("stored", stored), ("raw", raw)):
        for how, wb, direct in (("plain", False, False), ("writeback", True, False), ("direct", False, True)):
            quiesce()
            out[f"{key}_{how}_s"], out[f"{key}_{how}_writes_s"] = disk_write(directory / "w.bin", size,
                                                                           abuf if direct else buf,
                                                                           writeback=wb, direct=direct)
        out[f"{key}_s"] = min(out[f"{key}_plain_s"], out[f"{key}_writeback_s"], out[f"{key}_direct_s"])
    return out


class SizeWatch:
    """Polls the total size of the files matching ``pattern`` in ``directory`` every millisecond, so
    the moment the data file(s) reached their final size — the last write() returned, the bytes in
    the page cache, before the fsync — can be read off once the save is done."""

    def __init__(self, directory: Path, pattern: str) -> None:
        self.directory, self.pattern = directory, pattern
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _size(self) -> int:
        try:
            return sum(f.stat().st_size for f in self.directory.glob(self.pattern))
        except OSError:
            return 0

    def _run(self) -> None:
        last = -1
        while not self._stop.is_set():
            size = self._size()
            if size != last:
                self.samples.append((time.monotonic(), size))
                last = size
            time.sleep(0.001)

    def reached(self) -> float | None:
        """When the files first had their final size (time.monotonic), None if never seen."""
        self._stop.set()
        self._thread.join()
        final = self._size()
        return next((t for t, s in self.samples if s >= final and final > 0), None)


# ---- the methods ------------------------------------------------------------------------------

class Ckptd:
    def __init__(self, socket: str, root: Path, log: Path) -> None:
        from ckptd_client import Checkpointer
        self.root, self.log = root, log
        self.ck = Checkpointer(JOB, socket=socket, root=str(root), commit="local")
        self.reader = Checkpointer(JOB, socket=socket, root=str(root), commit="local", memory=False, prepare=False)
        self.stored_bytes = 0

    def step_path(self, step: int) -> Path:
        return Path(step_dir(str(self.root), JOB, step))

    def save(self, step: int, state: State) -> dict[str, Any]:
        watch = SizeWatch(self.step_path(step), "rank-*.data")
        t0 = time.monotonic()
        h = self.ck.save(step, state)
        h.wait(600)
        assert h.committed_s is not None and h.durable_s is not None
        offset = h.started    # durable_s / committed_s count from it (time.monotonic, taken inside save())
        written = watch.reached()
        self.stored_bytes = h.stored_bytes
        return {"durable_s": offset + h.committed_s - t0, "shard_durable_s": offset + h.durable_s - t0,
                "page_cache_s": None if written is None else written - t0, "stall_s": h.stall_s,
                "write_s": self.daemon_log(step, "write_s"), "stored_bytes": h.stored_bytes, "raw_bytes": h.raw_bytes,
                "direct_bytes": self.daemon_log(step, "direct_bytes")}

    def daemon_log(self, step: int, key: str) -> float | None:
        """A figure of the daemon's "durable" log line for ``step``: ``write_s``, its own seconds for the shard
        write (encode, write, fsync, manifest); ``direct_bytes``, of it written around the page cache."""
        pat = re.compile(rf" durable .*\bstep={step}\b.*\b{key}=([0-9.]+)")
        for line in reversed(self.log.read_text(errors="replace").splitlines()):
            m = pat.search(line)
            if m:
                return float(m.group(1))
        return None

    def settle(self, step: int) -> None:
        """Wait (up to 10 s) until the daemon's --keep-last 1 removed the older steps."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if [p for p in (self.root / JOB).glob("step-*") if p != self.step_path(step)] == []:
                return
            time.sleep(0.01)

    def files(self, step: int) -> Path:
        return self.step_path(step)

    def restore(self, step: int, live: State) -> None:
        self.reader.restore(live, step)
        info = self.reader.last_restore
        assert info is not None and info.source == "storage", info

    def remove(self, step: int) -> None:
        pass          # the daemon's --keep-last 1 removes it when the next step commits

    def close(self) -> None:
        self.ck.close()
        self.reader.close()


class Dcp:
    def __init__(self, workdir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        self.dcp, self.workdir = dcp, workdir

    def files(self, step: int) -> Path:
        return self.workdir / f"dcp-{step}"

    def save(self, step: int, state: State) -> dict[str, Any]:
        path = self.files(step)
        path.mkdir()
        watch = SizeWatch(path, "*.distcp")
        done: list[float] = []
        t0 = time.monotonic()
        fut = self.dcp.async_save(state, checkpoint_id=str(path))
        stall = time.monotonic() - t0
        upload: Any = getattr(fut, "upload_completion", fut)
        upload.add_done_callback(lambda _: done.append(time.monotonic()))
        upload.result()
        written = watch.reached()
        while not done:
            time.sleep(0.001)
        return {"durable_s": done[0] - t0, "page_cache_s": None if written is None else written - t0,
                "stall_s": stall}

    def restore(self, step: int, live: State) -> None:
        self.dcp.load(live, checkpoint_id=str(self.files(step)))

    def remove(self, step: int) -> None:
        shutil.rmtree(self.files(step))

    def settle(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TorchCheckpointing:
    def __init__(self, workdir: Path) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        # use_direct_io=False: O_DIRECT refuses its unaligned writes on this file system.
        self.manager = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.workdir = workdir

    def files(self, step: int) -> Path:
        return self.workdir / f"tc-{step}"

    def save(self, step: int, state: State) -> dict[str, Any]:
        done: list[float] = []
        t0 = time.monotonic()
        fut = self.manager.save(str(self.files(step)), state)
        stall = time.monotonic() - t0
        assert fut is not None
        fut.add_done_callback(lambda _: done.append(time.monotonic()))
        fut.result()
        while not done:
            time.sleep(0.001)
        t1 = time.monotonic()
        fsync_tree(self.files(step))
        return {"page_cache_s": done[0] - t0, "stall_s": stall, "fsync_after_s": time.monotonic() - t1}

    def restore(self, step: int, live: State) -> None:
        out = self.manager.load(str(self.files(step)), into=live)
        for g, d in live.items():          # it loads in place: the same tensors come back
            for k, t in d.items():
                assert out[g][k] is t, f"torch_checkpointing did not load {g}.{k} in place"

    def remove(self, step: int) -> None:
        shutil.rmtree(self.files(step))

    def settle(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.manager.close()


# ---- the run ----------------------------------------------------------------------------------

def run(cfg: argparse.Namespace, base: Path, state: State) -> dict[str, Any]:
    live: State = {g: {k: torch.empty_like(t) for k, t in d.items()} for g, d in state.items()}
    raw = nbytes(state)
    buf = memoryview(os.urandom(BUF))
    amap = mmap.mmap(-1, BUF)           # page-aligned: what O_DIRECT writes from
    amap[:] = buf
    abuf = memoryview(amap)
    rbufs = [memoryview(bytearray(b"\x01" * READ_PIECE)) for _ in range(2)]     # disk_read's, touched
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    workdir = base / "peers"
    workdir.mkdir()
    (base / "disk").mkdir()
    vm = vm_page_cache(base / "disk" / "w.bin", raw, buf)
    quiesce = Quiesce(base / "disk" / "scratch.bin", 2 * raw, buf)
    samples: list[dict[str, Any]] = []
    threads = 0
    try:
        with spawn_daemon(base / "root", base / "d.sock", "--keep-last", "1") as d, \
                spawn_daemon(base / "root2", base / "d2.sock", "--keep-last", "1", "--codec-mode", "always") as d2:
            methods: dict[str, Any] = {"ckptd": Ckptd(str(d.socket), base / "root", base / "d.log"),
                                       "ckptd_always": Ckptd(str(d2.socket), base / "root2", base / "d2.log"),
                                       "dcp": Dcp(workdir), "tc": TorchCheckpointing(workdir)}
            methods["ckptd"].ck.prepare(state)
            methods["ckptd_always"].ck.prepare(state)
            threads = methods["ckptd"].reader.restore_threads
            design = williams(len(SAVES))
            try:
                for r in range(cfg.warmup + cfg.rounds):
                    step = r + 1
                    # (measured rounds start a whole design anew)
                    order = [SAVES[i] for i in design[(r if r < cfg.warmup else r - cfg.warmup) % len(design)]]
                    rec: dict[str, Any] = {"round": r, "warmup": r < cfg.warmup, "order": list(order)}
                    for name in order:
                        if name == "disk":
                            rec["disk"] = disk_round(base / "disk", methods["ckptd"].stored_bytes or raw, raw, buf,
                                                     abuf, quiesce)
                        else:
                            quiesce()
                            rec[name] = methods[name].save(step, state)
                            methods[name].settle(step)
                    rec["free_gib_after_saves"] = round(shutil.disk_usage(base).free / 2**30, 1)
                    rorder = RESTORES[r % len(RESTORES):] + RESTORES[:r % len(RESTORES)]   # each first equally often
                    cold = (*RESTORES, "disk")          # the disk's own cold read of ckptd's files too
                    for mode in ("warm", "cold"):
                        for name in rorder if mode == "warm" else cold[r % len(cold):] + cold[:r % len(cold)]:
                            if name == "disk":
                                drop_cache(methods["ckptd"].files(step))
                                quiesce()
                                t0 = time.monotonic()
                                disk_read(methods["ckptd"].files(step), rbufs)
                                rec["disk"]["read_cold_s"] = time.monotonic() - t0
                                continue
                            m = methods[name]
                            zero(live)
                            if mode == "warm":
                                read_all(m.files(step))
                            else:
                                drop_cache(m.files(step))
                            quiesce()
                            t0 = time.monotonic()
                            m.restore(step, live)
                            dt = time.monotonic() - t0
                            assert bit_exact(live, state), f"{name} restore ({mode}) is not bit-exact"
                            rec[name][f"restore_{mode}_s"] = dt
                    for name in RESTORES:
                        methods[name].remove(step)
                    samples.append(rec)
                    print(f"round {r}{' (warm-up)' if r < cfg.warmup else ''}: "
                          f"disk {rec['disk']['stored_s']:.2f}/{rec['disk']['raw_s']:.2f} s, "
                          + ", ".join(f"{n} {rec[n].get('durable_s', rec[n].get('page_cache_s')):.2f} s "
                                      f"(restore {rec[n]['restore_warm_s']:.2f}/{rec[n]['restore_cold_s']:.2f})"
                                      for n in RESTORES) + f"; {rec['free_gib_after_saves']} GiB free", flush=True)
            finally:
                for m in methods.values():
                    m.close()
    finally:
        dist.destroy_process_group()
    return {"raw_bytes": raw, "samples": samples, "restore_threads": threads, "vm_page_cache": vm}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    rounds = [s for s in res["samples"] if not s["warmup"]]

    def col(name: str, key: str) -> list[float]:
        return [s[name][key] for s in rounds if s[name].get(key) is not None]

    figures: dict[str, list[float]] = {
        "disk stored MB/s": [s["disk"]["stored_size"] / s["disk"]["stored_s"] / 1e6 for s in rounds],
        "disk raw MB/s": [s["disk"]["raw_size"] / s["disk"]["raw_s"] / 1e6 for s in rounds],
        "disk stored s": col("disk", "stored_s"), "disk raw s": col("disk", "raw_s"),

        "ckptd durable s": col("ckptd", "durable_s"), "ckptd shard durable s": col("ckptd", "shard_durable_s"),
        "ckptd page cache s": col("ckptd", "page_cache_s"), "ckptd write s": col("ckptd", "write_s"),
        "ckptd stall s": col("ckptd", "stall_s"),
        "disk stored plain s": col("disk", "stored_plain_s"),
        "disk stored writeback s": col("disk", "stored_writeback_s"),
        "disk stored writeback writes s": col("disk", "stored_writeback_writes_s"),
        "disk stored writeback fsync s": [s["disk"]["stored_writeback_s"] - s["disk"]["stored_writeback_writes_s"]
                                          for s in rounds if "stored_writeback_writes_s" in s["disk"]],
        "ckptd after page cache s": [s["ckptd"]["durable_s"] - s["ckptd"]["page_cache_s"] for s in rounds
                                     if s["ckptd"].get("page_cache_s") is not None],
        "disk raw plain s": col("disk", "raw_plain_s"), "disk raw writeback s": col("disk", "raw_writeback_s"),
        "disk stored direct s": col("disk", "stored_direct_s"), "disk raw direct s": col("disk", "raw_direct_s"),
        "ckptd_always durable s": col("ckptd_always", "durable_s"),
        "ckptd_always write s": col("ckptd_always", "write_s"),
        "ckptd_always stall s": col("ckptd_always", "stall_s"),
        "ckptd_always page cache s": col("ckptd_always", "page_cache_s"),
        "ckptd before write s": [s["ckptd"]["shard_durable_s"] - s["ckptd"]["write_s"] for s in rounds
                                 if s["ckptd"].get("write_s") is not None],
        "ckptd commit s": [s["ckptd"]["durable_s"] - s["ckptd"]["shard_durable_s"] for s in rounds],
        "ckptd direct share": [s["ckptd"]["direct_bytes"] / s["ckptd"]["stored_bytes"] for s in rounds
                               if s["ckptd"].get("direct_bytes") is not None and s["ckptd"]["stored_bytes"]],
        "dcp durable s": col("dcp", "durable_s"), "dcp page cache s": col("dcp", "page_cache_s"),
        "dcp stall s": col("dcp", "stall_s"),
        "tc page cache s": col("tc", "page_cache_s"), "tc stall s": col("tc", "stall_s"),
        "tc fsync after s": col("tc", "fsync_after_s"),
        # ckptd's time to durable over the time the disk took for the same bytes in the same round
        "ckptd / disk limit": [s["ckptd"]["durable_s"] / s["disk"]["stored_s"] for s in rounds],
        "dcp / disk raw": [s["dcp"]["durable_s"] / s["disk"]["raw_s"] for s in rounds],
        # ... over the disk's O_DIRECT way alone (the way a direct_io daemon writes), same round
        "ckptd / disk direct": [s["ckptd"]["durable_s"] / s["disk"]["stored_direct_s"] for s in rounds
                                if 0 < s["disk"].get("stored_direct_s", math.inf) < math.inf],
    }
    for name in RESTORES:
        for mode in ("warm", "cold"):
            figures[f"{name} restore {mode} s"] = col(name, f"restore_{mode}_s")
    figures["disk read cold s"] = col("disk", "read_cold_s")
    figures["ckptd cold / disk read"] = [s["ckptd"]["restore_cold_s"] / s["disk"]["read_cold_s"] for s in rounds
                                         if s["disk"].get("read_cold_s")]
    figures["dcp cold / disk read"] = [s["dcp"]["restore_cold_s"] / s["disk"]["read_cold_s"] for s in rounds
                                       if s["disk"].get("read_cold_s")]
    med = {k: median(v) for k, v in figures.items()}
    stored = median([s["ckptd"]["stored_bytes"] for s in rounds])
    stored_always = median([s["ckptd_always"]["stored_bytes"] for s in rounds])
    ratios = {
        "ckptd / DCP time to durable": med["ckptd durable s"] / med["dcp durable s"],
        "ckptd codec_mode always (before) / DCP time to durable": med["ckptd_always durable s"] / med["dcp durable s"],
        "ckptd adaptive / ckptd always, time to durable": med["ckptd durable s"] / med["ckptd_always durable s"],
        "ckptd / physical limit (stored bytes / disk MB/s, medians)":
            med["ckptd durable s"] / (stored / 1e6 / med["disk stored MB/s"]),
        "ckptd / physical limit (paired by round, median)": med["ckptd / disk limit"],
        "ckptd / physical limit of the raw bytes": med["ckptd durable s"] / med["disk raw s"],
        "ckptd / the disk's O_DIRECT way alone (paired by round, median)": med["ckptd / disk direct"],
        "DCP / physical limit of the raw bytes (paired, median)": med["dcp / disk raw"],
        "ckptd time to durable / torch_checkpointing time to page cache":
            med["ckptd durable s"] / med["tc page cache s"],
    }
    for peer in ("dcp", "tc"):
        for mode in ("warm", "cold"):
            ratios[f"ckptd / {LABELS[peer]} restore {mode}"] = \
                med[f"ckptd restore {mode} s"] / med[f"{peer} restore {mode} s"]
    if figures["ckptd cold / disk read"]:
        ratios["ckptd restore cold / the disk's cold read of ckptd's files (paired by round, median)"] = \
            med["ckptd cold / disk read"]
        ratios["DCP restore cold / the disk's cold read of ckptd's files (paired by round, median)"] = \
            med["dcp cold / disk read"]
    return {"figures": figures, "median": med, "ratios": ratios, "stored_bytes": stored,
            "stored_bytes_always": stored_always}


def to_markdown(res: dict[str, Any]) -> str:
    m, s, vm = res["machine"], res["summary"], res["vm_page_cache"]
    f, med = s["figures"], s["median"]
    mib = res["raw_bytes"] / 2**20

    def row(label: str, key: str, unit: str = " s", digits: int = 2) -> list[str]:
        v = f[key]
        return [label, fmt(med[key], digits, unit), fmt(min(v) if v else None, digits, unit),
                fmt(max(v) if v else None, digits, unit)]

    saves = [row(f"disk: write + fsync of ckptd's stored bytes ({s['stored_bytes'] / 2**20:.0f} MiB) — the physical "
                 "limit (the fastest of the next three, by round)", "disk stored s"),
             row("disk: the same, plain writes then fsync", "disk stored plain s"),
             row("disk: the same, writeback started every 32 MiB", "disk stored writeback s"),
             row("disk: the same, O_DIRECT writes of 32 MiB then fsync", "disk stored direct s"),
             row("disk: of it the writes (the last write() returned, before the fsync)",
                 "disk stored writeback writes s"),
             row("disk: of it the fsync", "disk stored writeback fsync s"),
             row("disk: the limit, MB/s", "disk stored MB/s", " MB/s", 0),
             row(f"disk: write + fsync of the raw bytes ({mib:.0f} MiB), the faster way", "disk raw s"),
             row("disk: the same, plain writes then fsync", "disk raw plain s"),
             row("disk: the same, writeback started every 32 MiB", "disk raw writeback s"),
             row("disk: the same, O_DIRECT writes of 32 MiB then fsync", "disk raw direct s"),
             row("disk: the raw limit, MB/s", "disk raw MB/s", " MB/s", 0),

             row("**ckptd: time to durable** (save() → committed, index.json durable)", "ckptd durable s"),
             row("ckptd: save() → its shard durable (DURABLE event, before the commit)", "ckptd shard durable s"),
             row("ckptd: of its data file, the share written around the page cache (direct_io auto: the way its "
                 "daemon measured faster in the warm-up saves)", "ckptd direct share", "", 2),
             row("ckptd: save() → its data file at its final size (bytes in the page cache, before fsync)",
                 "ckptd page cache s"),
             row("ckptd: from then to committed (the rest of the fsync, the manifest, the commit)",
                 "ckptd after page cache s"),
             row("ckptd: the daemon's shard write (write_s: encode + write + fsync + manifest)", "ckptd write s"),
             row("ckptd: save() call (copy into the slot)", "ckptd stall s"),
             row("ckptd: save() → the daemon's shard write starts (shard durable − write_s)", "ckptd before write s"),
             row("ckptd: the commit (DURABLE event → committed)", "ckptd commit s"),
             row(f"**ckptd, codec_mode always: time to durable** (stored {s['stored_bytes_always'] / 2**20:.0f} MiB)",
                 "ckptd_always durable s"),
             row("ckptd, codec_mode always: the daemon's shard write (write_s)", "ckptd_always write s"),
             row("ckptd, codec_mode always: save() call", "ckptd_always stall s"),
             row("**DCP async_save: time to durable** (call → future done)", "dcp durable s"),
             row("DCP: call → its .distcp file at its final size (before fsync)", "dcp page cache s"),
             row("DCP: async_save() call (default stager: a synchronous copy)", "dcp stall s"),
             row("**torch_checkpointing: time to page cache** (save() → future done; never fsynced: not durable)",
                 "tc page cache s"),
             row("torch_checkpointing: save() call", "tc stall s"),
             row("torch_checkpointing: an fsync of its files afterwards (ours, not its)", "tc fsync after s")]
    restores = [row(f"{LABELS[n]} restore, {mode} page cache", f"{n} restore {mode} s")
                for mode in ("warm", "cold") for n in RESTORES]
    if f.get("disk read cold s"):
        restores.append(row("disk: a cold read of ckptd's stored files (16 MiB preadv on 2 threads, nothing checked) "
                            "— the physical limit of a cold restore", "disk read cold s"))
    ratio_rows = [[k, fmt(v, 2, "×")] for k, v in s["ratios"].items()]
    la = ", ".join(f"{x:.2f}" for x in m["loadavg_at_start"])
    when = res.get("generated") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if res.get("resummarized"):
        when += f" (its summary recomputed from the same samples on {res['resummarized']})"
    shapes = res["shapes"]
    lines = [
        "# Time to durable and restore vs the disk's physical limit (one rank)", "",
        f"Generated by `benchmarks/durable_bench.py` on {when} in {res['wall_s']:.0f} s. Machine: {m['cpu']}, "
        f"{m['cores_available']} cores available (a shared VM), {m['ram_gib']} GiB RAM, disk {m['disk']['device']} "
        f"({m['disk']['fstype']}), Linux {m['kernel']}, torch {m['versions']['torch']}, load average at start {la}.",
        "",
        f"State: {mib:.0f} MiB, {res['tensor_count']} plain tensors of a GPT-2-like model ({LAYERS} blocks, d = "
        f"{shapes['wte.weight'][1]}, vocabulary {shapes['wte.weight'][0]}): bf16 weights, then per parameter as "
        "AdamW orders it a 0-d fp32 step, the fp32 master weight, exp_avg and exp_avg_sq. ckptd stored "
        f"{s['stored_bytes'] / 2**20:.0f} MiB ({s['stored_bytes'] / res['raw_bytes']:.3f} of raw, codec bplane, "
        "codec_mode adaptive: chunks the disk was ready for before a codec thread stored raw); with codec_mode "
        f"always {s['stored_bytes_always'] / 2**20:.0f} MiB ({s['stored_bytes_always'] / res['raw_bytes']:.3f}). "
        f"{res['rounds']} measured rounds after {res['warmup']} warm-up; in each round the disk, ckptd (adaptive and "
        "always), DCP and torch_checkpointing saves in an order changing each round so that over the measured rounds "
        "each comes right after each other one, and first, equally often (a Williams design: the disk test "
        "always first measured the limit on a rested disk and every method after someone's writes), then the "
        "restores (warm, "
        "then cold) in a rotating order; medians, min and max over the measured rounds; every restore checked "
        "bit-exact.", "",
        "## Headline", "", table(["ratio", "value"], ratio_rows), "",
        "## Saves", "", table(["figure", "median", "min", "max"], saves), "",
        "## Restores", "", table(["figure", "median", "min", "max"], restores), "",
        "## Notes", "",
        "- *The disk's O_DIRECT way alone*: ckptd's time to durable over the O_DIRECT write + fsync of the same "
        "bytes in the same round: where the daemon writes around the page cache (`direct_io`, the share row), "
        "what is left beyond this ratio is the device writing slower that way than through the page cache, not "
        "work of ckptd's.",
        "- *Physical limit*: in each round, a fresh file in the same directory tree gets the bytes ckptd stored for "
        "its last step (and, apart, the raw state size) by plain `os.write` of 32 MiB pieces and one `os.fsync`, and "
        "again with writeback started (`sync_file_range`) every 32 MiB as it writes, and again with `O_DIRECT` "
        "writes of 32 MiB around the page cache: what the disk needs for those bytes with no encoding and no other "
        "work, the fastest of the three. *ckptd ÷ physical limit* divides ckptd's "
        "time to durable by stored bytes ÷ that bandwidth (medians), and also paired by round. *Of it the writes* "
        "and *of it the fsync* split the writeback way's time where its last `write()` returned: on a disk that "
        "acknowledges writes at page-cache speed and flushes at the fsync, compare them with ckptd's time to its "
        "data file's final size and the time from then to committed.",
        "- *codec_mode*: `adaptive` (the default) has the daemon's writer go at the disk's pace and write raw any "
        "chunk no codec thread has started on when the disk is ready for it; `always` encodes every chunk (the "
        "behaviour before `adaptive`), from a second daemon in the same run.",
        "- *Every timed save, disk write and restore starts the same way*: `os.sync()` (no dirty pages of an earlier "
        f"method written back in its time), then {2 * mib:.0f} MiB written to a scratch file and removed without an "
        "fsync (nothing reaches the disk). The second step removes an artifact of this VM: page cache written after a "
        "few seconds with the memory idle is several times slower to fill than right after other memory was freed "
        "(its virtio balloon has free page reporting on: memory free for a few seconds goes back to the host, and a "
        "page allocated there again costs a host fault; that is our reading, not traced). Measured at the start of "
        "this run: a write + fsync of the raw size "
        f"after {vm['idle_s']:.0f} s idle took {vm['after_idle']['write_s']:.2f} s of writes + "
        f"{vm['after_idle']['fsync_s']:.2f} s of fsync; the same right after, {vm['right_after']['write_s']:.2f} + "
        f"{vm['right_after']['fsync_s']:.2f} s. Without the scratch write, each figure depends on how long before "
        "its start memory was freed, so on the order of the methods in the round; with it, every method finds "
        "recently freed memory, as on a bare machine. A "
        "training job that checkpoints every few minutes on this VM would pay the slower figure on every save.",
        "- *ckptd time to durable*: from the `save()` call until the handle is committed: the copy into the shared "
        "slot, the hand-off, the daemon's encode (bplane, on its threads) + write + fsync of the data file, the "
        "manifest, and the commit (index.json written and fsynced, the step directory fsynced). The hand-off comes "
        "before the copy (a *filling* save: the state has no optimizer to fence, so the whole copy is in the call; "
        "FORMAT.md): the daemon writes what is copied while the rest is copied, so the copy and the write share "
        "this VM's two cores (the `save()` call row). *Shard durable* stops "
        "at the DURABLE event, before the commit. *Page cache* is when the data file first had its final size (the "
        "benchmark polls `st_size` every millisecond): every byte had been `write()`n, the fsync not yet done; the "
        "daemon starts writeback every 32 MiB as it writes, so part of the disk time is in it. `write_s` is the "
        "daemon's own figure for the shard (its log's `durable` line): it includes the fsync, so it is no page-cache "
        "figure.",
        "- *DCP time to durable*: `async_save` (its default stager copies the state in the call), then its "
        "FileSystemWriter on a thread writes one `.distcp` file and `.metadata`, each fsynced (the directory is not); "
        "until the returned future is done.",
        "- *torch_checkpointing*: its async CheckpointManager stages on a thread and writes in a subprocess; it calls "
        "no fsync, so its figure is the time until its files are in the page cache, not durable. The fsync of its "
        "files the benchmark does afterwards is shown apart, not added.",
        "- *Restore warm*: every file of the checkpoint read once just before (in the page cache); *cold*: "
        "`os.sync()`, then `posix_fadvise(POSIX_FADV_DONTNEED)` on every file of it. ckptd restores with "
        "`Checkpointer(memory=False)` (from its files, not the daemon's memory tier; decoding bplane on "
        f"{res['restore_threads']} threads); DCP `load`; torch_checkpointing `CheckpointManager.load(into=...)` "
        "(in place). All into zeroed, pre-allocated tensors. *The disk's cold read* takes its place among the cold "
        "restores, rotating with them: ckptd's files for the step dropped from the page cache the same way, then "
        "read once in 16 MiB `preadv`s on 2 threads into buffers of their own, nothing checked or decoded: the "
        "fastest of the ways a probe compared here (2 or 4 threads, 4 or 16 MiB pieces, `POSIX_FADV_WILLNEED` of "
        "the file or 64 MiB ahead, `O_DIRECT`): all but O_DIRECT within 15 % of each other, O_DIRECT 25 % slower.",
        "- Methods interleave round by round because a VM's disk can slow down as a run writes more (each round "
        "writes about five times the state); compare figures of one run, not across runs.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=10)     # one whole Williams design of the five saves
    ap.add_argument("--warmup", type=int, default=4)      # auto's two shards each way (write_way.py)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--out", default=str(RESULTS / "durable"))
    cfg = ap.parse_args()
    t_start = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="ckptd-durable-", dir=cfg.dir))
    state = make_state(cfg.size_mib)
    res: dict[str, Any] = {"size_mib": cfg.size_mib, "rounds": cfg.rounds, "warmup": cfg.warmup,
                           "machine": machine_info(base), "shapes": gpt_shapes(cfg.size_mib),
                           "tensor_count": len(tensors(state))}
    try:
        res.update(run(cfg, base, state))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["summary"] = summarize(res)
    res["wall_s"] = time.monotonic() - t_start
    res["generated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_results(Path(cfg.out), res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
