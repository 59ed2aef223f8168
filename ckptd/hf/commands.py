"""The ``ckptd export`` and ``ckptd import`` subcommands (registered by ``ckptd.cli``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ckptd.core.describe import human_size
from ckptd.core.errors import ChecksumError

from .export import MemoryLevelStep, OutputExists, export_hf
from .importer import import_hf
from .layout import EXPORT_DTYPES


def cmd_export(args: argparse.Namespace) -> int:
    try:
        r = export_hf(args.step_dir, args.out, max_shard_size=args.max_shard_size, select=args.select,
                      dtype=args.dtype, rename=args.rename, threads=args.threads, force=args.force)
    except MemoryLevelStep as e:                         # a step export does not take, as a wrong name
        print(f"ckptd export: {e}", file=sys.stderr)
        return 2                                         # a usage error (ckptd.cli_steps.USAGE)
    except OutputExists as e:                            # its text speaks of the API's force=True
        print(f"ckptd export: {e.out} exists and is not an empty directory; --force replaces it", file=sys.stderr)
        return 1
    except (OSError, ValueError, ChecksumError) as e:    # FormatError is a ValueError
        print(f"ckptd export: {e}", file=sys.stderr)
        return 1
    print(f"{r.out}: {r.tensors} tensors, {human_size(r.total_size)} in {len(r.files)} file(s)")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    try:
        r = import_hf(args.hf_dir, args.root, args.job, args.step, codec=args.codec, threads=args.threads)
    except (OSError, ValueError) as e:
        print(f"ckptd import: {e}", file=sys.stderr)
        return 1
    print(f"{r.step_dir}: committed, {r.tensors} tensors, {human_size(r.raw_bytes)} "
          f"({human_size(r.stored_bytes)} stored)")
    return 0


def add_parsers(sub: Any) -> None:
    threads = max(1, min(8, len(os.sched_getaffinity(0))))
    s = sub.add_parser("export", help="write a step as Hugging Face safetensors shards", description=(
        "Consolidate a committed step (any world size and sharding) into model-0000i-of-0000N.safetensors "
        "and model.safetensors.index.json, laid out as huggingface_hub.save_torch_state_dict does. A "
        "memory-level step has no files to export (exit 2)."))
    s.add_argument("step_dir", metavar="STEP_DIR")
    s.add_argument("out", metavar="OUT", help="output directory: new or empty (one holding files only with --force)")
    s.add_argument("--max-shard-size", default="5GB", help="per-file limit, e.g. 5GB, 500MB, 1GiB (default 5GB)")
    s.add_argument("--select", help="key path of the state entry to export; '' exports every tensor (default: "
                   "model, or every tensor of a step that holds a flat model state dict alone, as torchtitan's "
                   "model-only last step)")
    s.add_argument("--dtype", choices=EXPORT_DTYPES, help="convert floating tensors to this dtype")
    s.add_argument("--rename", metavar="FILE", help="JSON object: canonical name -> exported name")
    s.add_argument("--threads", type=int, default=threads, help=f"decode threads (default {threads})")
    s.add_argument("--force", action="store_true", help="replace OUT even if it holds files")
    s.set_defaults(func=cmd_export)
    s = sub.add_parser("import", help="commit a Hugging Face checkpoint as a step", description=(
        "Validate HF_DIR (sharded with model.safetensors.index.json, or one model.safetensors) and commit "
        "it as step N of JOB under ROOT, with state {\"model\": {...}}, for Checkpointer.restore."))
    s.add_argument("hf_dir", metavar="HF_DIR")
    s.add_argument("root", metavar="ROOT")
    s.add_argument("job", metavar="JOB")
    s.add_argument("--step", type=int, required=True, metavar="N")
    s.add_argument("--codec", choices=("bplane", "zstd", "none"), default="bplane")
    s.add_argument("--threads", type=int, default=threads, help=f"encode threads (default {threads})")
    s.set_defaults(func=cmd_import)
