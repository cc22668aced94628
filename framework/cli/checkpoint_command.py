"""``shardlight export`` and ``shardlight inspect``: argument parsing over ``shardlight.checkpoint``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardlight.files import write_json


def run_export(args: argparse.Namespace) -> int:
    from shardlight.checkpoint import export_checkpoint  # torch, transformers: when the command runs
    from shardlight.recipe.validate import parse_size

    max_shard_bytes = parse_size(args.max_shard_size, "--max-shard-size")
    report = export_checkpoint(Path(args.checkpoint), Path(args.out), merge=args.merge, max_shard_bytes=max_shard_bytes)
    verdict = "OK" if report["ok"] else "FAILED"
    if "adapter_dir" in report:  # a PEFT checkpoint: the adapter (+ its inline base) (+ with --merge the merged model)
        parts = ", ".join(f"{name}/ ({report['files'][name]} file(s))" for name in ("adapter", "base", "merged")
                          if name in report["files"])
        print(f"exported {report['checkpoint']} -> {report['out']}: {parts}; the adapter's base is "
              f"{report['base_model']}; read back tensor by tensor: max |diff| = {report['max_abs_diff']:.3g}: "
              f"{verdict}")
        return 0 if report["ok"] else 1
    print(f"exported {report['checkpoint']} -> {report['out']} ({report['files']} safetensors file(s), written one "
          f"at a time); read back tensor by tensor: max |diff| = {report['max_abs_diff']:.3g}: {verdict}")
    return 0 if report["ok"] else 1


def run_inspect(args: argparse.Namespace) -> int:
    from shardlight.checkpoint import format_inspect, inspect_checkpoint

    listing = inspect_checkpoint(Path(args.checkpoint), include_optimizer=args.all)
    if args.json:
        write_json(args.json, listing)
    print(format_inspect(listing))
    return 0


def add_parsers(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "export", help="sharded checkpoint -> Hugging Face save_pretrained dir, verified",
        description="Write safetensors files (+ index), config and tokenizer from a sharded checkpoint, one output "
        "file at a time, each read back and compared exactly with the shards; no process holds the whole model. A "
        "LoRA checkpoint gives OUT/adapter (PeftModel.from_pretrained; OUT/base beside it for a base that exists only "
        "in the run) and, with --merge, OUT/merged, merged one file at a time by peft's own per-layer merge.")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoints/step-N dir (or a run dir: its newest)")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, as save_pretrained's max_shard_size (default 5GB)")
    export.add_argument("--merge", action="store_true",
                        help="LoRA checkpoints: also write OUT/merged, the base with the adapter merged in")
    export.set_defaults(func=run_export)
    inspect = subparsers.add_parser(
        "inspect", help="list the tensors of a sharded checkpoint from its metadata",
        description="Parameter names, full shapes, dtypes, shard layout per rank and bytes, from DCP metadata "
        "(no weights are loaded).")
    inspect.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoints/step-N dir (or a run dir)")
    inspect.add_argument("--all", action="store_true", help="also list optimizer state")
    inspect.add_argument("--json", metavar="PATH", help="also write the listing as JSON")
    inspect.set_defaults(func=run_inspect)
