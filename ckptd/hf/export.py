"""``ckptd export``: a committed step → a Hugging Face sharded safetensors directory, streaming.

Tensors are consolidated one at a time (``consolidate.StepSource``: any world size, any
sharding) and written straight into their output shard after its header (known up front from
the plan), so memory holds one tensor and its decode buffers, never the model. Everything is
written into a temporary directory next to OUT, fsynced, then renamed into place: a killed
export leaves no half directory at OUT (only a hidden ``.OUT.tmp-*`` beside it).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd.core import storage
from ckptd.core.errors import FormatError
from ckptd.core.reader import is_memory_level, split_step_path
from ckptd.core.sizes import parse_size
from ckptd.core.tree import decode_tree

from .consolidate import StepSource
from .layout import (
    EXPORT_DTYPES,
    FLOAT_DTYPES,
    INDEX_FILE,
    OutTensor,
    Plan,
    canonical_name,
    convert,
    load_rename,
    split,
)
from .progress import Progress
from .safetensors_io import build_header, st_dtype


class MemoryLevelStep(ValueError):
    """A memory-level step (``<root>/<job>/_memory/step-N``) has no data files to export: its bytes are
    only in the daemons' memory (FORMAT.md, "Memory-level steps")."""


class OutputExists(FileExistsError):
    """OUT is there and holds something; ``force`` replaces it (an empty directory is written into)."""

    def __init__(self, out: str) -> None:
        super().__init__(f"{out} exists and is not an empty directory; export_hf(..., force=True) replaces it")
        self.out = out


def _empty_dir(path: str) -> bool:
    """Nothing at ``path``, or an empty directory (huggingface_hub and save_pretrained make one first)."""
    if not os.path.lexists(path):
        return True
    return not os.path.islink(path) and os.path.isdir(path) and not os.listdir(path)


@dataclass(frozen=True)
class ExportResult:
    out: str
    files: tuple[str, ...]          # safetensors files written, in order
    tensors: int
    total_size: int                 # bytes of tensor data (the index's metadata.total_size)


DCP_RECORD, DCP_PIECES = "dcp_meta", "dcp"   # a DCP step's entries in its rank state trees (FORMAT.md)


def plan_export(source: StepSource, select: str | None, dtype: str | None, rename: Mapping[str, str],
                max_shard_size: int) -> Plan:
    """Which checkpoint tensors go out under which names and dtypes, split into shards."""
    prefix, keys = chosen_keys(source, select)
    out: list[OutTensor] = []
    seen: dict[str, str] = {}
    for key in keys:
        t = source.tensors[key]
        name = canonical_name(key[len(prefix):].replace("/", "."))
        name = rename.get(name, name)
        if name in seen:
            raise FormatError(f"tensors {seen[name]!r} and {key!r} would both be exported as {name!r}")
        seen[name] = key
        to = dtype if dtype is not None and t.dtype in FLOAT_DTYPES else t.dtype
        st_dtype(to)        # refuses a dtype safetensors cannot hold, before anything is written
        out.append(OutTensor(key, name, t.dtype, to, t.shape))
    unused = set(rename) - {canonical_name(k[len(prefix):].replace("/", ".")) for k in keys}
    if unused:
        raise FormatError(f"--rename names {len(unused)} tensors the checkpoint does not have, "
                          f"e.g. {sorted(unused)[0]!r}")
    return split(out, max_shard_size)


def chosen_keys(source: StepSource, select: str | None) -> tuple[str, list[str]]:
    """The tensors ``select`` names, and the prefix their exported names drop: the entry at that key path
    (``optim/state``), or the dotted FQNs under it (a step written through DCP: ``model.up.weight``); ``""``
    every tensor. ``None`` (the default) is ``model`` — or, in a step with no ``model`` entry that holds a
    flat model state dict alone (torchtitan's model-only last step, ``dcp.save(model.state_dict())``), every
    tensor: what else it holds (an optimizer, a scheduler) would be nested or, through DCP, pickled items."""
    chosen = "model" if select is None else select.strip("/")
    for prefix in (chosen + "/", chosen + ".") if chosen else ("",):
        if keys := source.key_order(prefix):
            return prefix, keys
    if select is None and _flat_model(source):
        return "", source.key_order("")
    tops = sorted({k.split("/", 1)[0].split(".", 1)[0] for k in source.tensors})
    flat = "" if select is not None or any("/" in k for k in source.tensors) else \
        ", a flat state dict that holds more than a model (DCP byte items: an optimizer, a scheduler...; " \
        "torchtitan saves the model alone in a step with last_save_model_only)"
    raise FormatError(f"no tensors under {chosen!r} in {source.reader.path}{flat}; its top-level entries with "
                      f"tensors are {tops}: pick one with --select ENTRY, or every tensor with --select ''")


def _flat_model(source: StepSource) -> bool:
    """Whether the step holds nothing but a flat state dict's tensors: no key path (``a/b``) among its
    tensors, and, for a step written through DCP, no byte item (a pickled object: an optimizer's param
    groups, a scheduler, a data loader) in its DCP record (rank 0's, or DCP's coordinator's)."""
    if not source.tensors or any("/" in k for k in source.tensors):
        return False
    for rank in range(source.reader.world_size):
        entries = dict(_entries(source.manifest(rank)[0].tree))
        if DCP_RECORD in entries:
            record = decode_tree(entries[DCP_RECORD], lambda name: None)
            return isinstance(record, dict) and record.get("bytes") == []
        if rank == 0 and DCP_PIECES not in entries:
            return True         # not written through DCP: every tensor is one
    return False


def _entries(tree: object) -> list[tuple[object, object]]:
    items = tree.get("d") if isinstance(tree, dict) else None
    return [(i[0], i[1]) for i in items if isinstance(i, list) and len(i) == 2] if isinstance(items, list) else []


def export_hf(step_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
              max_shard_size: int | str = "5GB", select: str | None = None, dtype: str | None = None,
              rename: Mapping[str, str] | str | os.PathLike[str] | None = None, threads: int = 4,
              force: bool = False, progress: bool | None = None) -> ExportResult:
    """Write the committed step ``step_dir``'s ``select`` entry (default ``model``; ``""``: every tensor;
    see ``chosen_keys``) to ``out`` as Hugging Face safetensors shards (see README, "Export to Hugging
    Face"). ``dtype``: convert floating tensors (``bfloat16``, ``float16``, ``float32``); ``rename``: a
    mapping (or a JSON file of one) from canonical names to exported names; ``progress``: None = a bar
    on a terminal, a line every ~10 s otherwise; False = quiet.
    Raises MemoryLevelStep (a ValueError) for a memory-level step, OutputExists (a FileExistsError)
    when ``out`` exists and is not an empty directory (unless ``force``), FormatError for a bad step."""
    if is_memory_level(os.fspath(step_dir)) and os.path.isdir(step_dir):
        _, _, step = split_step_path(os.fspath(step_dir))
        raise MemoryLevelStep(f"memory-level step {step} has no files: its bytes are only in the daemons' memory; "
                              'save it to storage (level="storage") to export it')
    out_path = os.path.abspath(os.fspath(out))
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    if isinstance(rename, (str, os.PathLike)):
        rename = load_rename(os.fspath(rename))
    if not force and not _empty_dir(out_path):
        raise OutputExists(out_path)
    limit = parse_size(max_shard_size, minimum=1)
    with StepSource(os.fspath(step_dir)) as source:
        plan = plan_export(source, select, dtype, rename or {}, limit)
        parent = os.path.dirname(out_path)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_path)}.tmp-", dir=parent)
        bar = Progress(f"export {os.path.basename(out_path)}", plan.total_size, progress)
        try:
            os.chmod(tmp, 0o755)
            with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptd-export") as pool:
                for name, tensors in plan.files.items():
                    _write_file(source, os.path.join(tmp, name), tensors, pool, bar)
            if plan.sharded:           # the mode of the shards (atomic_write's is 0640): readable alike
                _write_whole(os.path.join(tmp, INDEX_FILE), [plan.index_json()])
            storage.fsync_dir(tmp)
            _publish(tmp, out_path, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
    return ExportResult(out_path, tuple(plan.files), sum(len(t) for t in plan.files.values()), plan.total_size)


FILE_MODE = 0o644      # an export is for others to read (a model hub, a serving node), every file alike


def _write_whole(path: str, chunks: Iterable[bytes | memoryview]) -> None:
    """A new file in the (unpublished) temporary directory, fsynced; the directory's rename publishes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        for chunk in chunks:
            storage.write_all(fd, [chunk])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(source: StepSource, path: str, tensors: list[OutTensor], pool: ThreadPoolExecutor,
                bar: Progress) -> None:
    header, order = build_header([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"})
    by_name = {t.name: t for t in tensors}

    def chunks() -> Iterator[bytes | memoryview]:
        yield header
        for name, _ in order:            # data order: the header's offsets follow it
            t = by_name[name]
            data = convert(source.read_whole(t.key, pool), t.src_dtype, t.dtype)
            yield memoryview(data)  # type: ignore[arg-type]
            bar.update(t.nbytes)
            del data
    _write_whole(path, chunks())


def _publish(tmp: str, out: str, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; with ``force`` an existing ``out`` is moved aside first
    and removed only once the new directory is in place."""
    parent = os.path.dirname(out)
    old = None
    if force and not _empty_dir(out):           # an empty directory is replaced by the rename itself
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
        os.rename(out, os.path.join(old, "x"))
    os.rename(tmp, out)
    storage.fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
