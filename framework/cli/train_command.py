"""``shardlight train``: a recipe and overrides → a validated config → ``shardlight.train.train``."""

from __future__ import annotations

import argparse
import os
import sys

from shardlight.cli.common import add_recipe_items, split_recipe_and_overrides
from shardlight.run_context import RunContext


def run_train(args: argparse.Namespace) -> int:
    recipe, overrides = split_recipe_and_overrides(args.items)
    # Quiet third-party chatter that is not the user's concern on an offline CPU run.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    from shardlight.recipe import DEFAULT_RECIPE, load_recipe, resolve_recipe, to_yaml

    cfg = load_recipe(recipe, overrides, accelerate_config=args.accelerate_config)
    if args.print_config:  # which file it came from: a name may have meant a shipped recipe
        sys.stdout.write(f"# recipe: {resolve_recipe(recipe).resolve() if recipe else DEFAULT_RECIPE}\n" + to_yaml(cfg))
        return 0
    # No other rank starts before the run is accepted: train() runs the preflight first, and only then does
    # Lightning's launcher start ranks 1..N-1 (issue 34: ranks started ahead of it outran its refusal).
    from shardlight.instruments import Measurements  # the measuring callbacks, then the verdict
    from shardlight.train import train  # torch, Lightning, transformers: only once the recipe is known good

    summary = train(RunContext.from_env(), cfg, summary_json=args.summary_json, instruments=[Measurements()])
    # This rank's collectives are over: shut its process group down while the interpreter is whole (torch's
    # advice). Left to interpreter exit, gloo's threads can outlive what they hold and abort the rank ("terminate
    # called without an active exception", pytorch#190489), and under srun one aborted task fails the whole job.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # A run stopped by a non-finite loss or gradient norm has said so on stderr (rank 0); it failed.
    return 1 if summary.get("stopped") else 0


def add_parsers(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="fine-tune a model from a recipe",
        description="Train from a YAML recipe (default: the embedded tiny-llama-sft recipe). "
        "Overrides use OmegaConf dotted keys, e.g. trainer.max_steps=50 fsdp.sharding_strategy=SHARD_GRAD_OP. "
        "A list-typed key also takes a single value as a one-item list, in a recipe file or an override: "
        "data.train_files=my.jsonl means data.train_files=[my.jsonl]; "
        "several values: data.train_files=[a.jsonl,b.jsonl].",
    )
    add_recipe_items(train)
    train.add_argument("--accelerate-config", metavar="FILE",
                       help="an `accelerate config` YAML; its FSDP/process values land in fsdp:/trainer:")
    train.add_argument("--print-config", action="store_true", help="print the fully resolved recipe as YAML and exit")
    train.add_argument("--summary-json", metavar="PATH", help="write first/final val loss, steps, dirs, wall time")
    train.set_defaults(func=run_train)
