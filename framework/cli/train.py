"""``shardlight train``: a recipe and overrides → a validated config → ``shardlight.train.train``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from shardlight.cli.common import add_recipe_items, split_recipe_and_overrides
from shardlight.launch.standby import StandbyRanks, serve_as_standby, standby_pays
from shardlight.recipe.files import peek_ranks
from shardlight.runtime import RunContext


def run_train(args: argparse.Namespace) -> int:
    # A rank started ahead of Lightning's launcher: import what a rank needs, then wait for its environment.
    serve_as_standby(lambda: importlib.import_module("shardlight.train"))
    recipe, overrides = split_recipe_and_overrides(args.items)
    # Quiet third-party chatter that is not the user's concern on an offline CPU run.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    # The other local ranks import beside this process (about 4 s each) instead of after it: started from the
    # recipe files' trainer.devices before anything heavy is imported, killed if the recipe or the preflight
    # refuses the run. The loaded recipe decides; the launcher starts any rank the peek missed.
    ctx = RunContext.from_env()
    ranks = peek_ranks(recipe, overrides) if args.own_command_line and not args.print_config else 1
    standby = StandbyRanks.start(ranks, os.environ) if standby_pays(ctx.launcher, ranks, 1) else None
    try:
        from shardlight.recipe import load_recipe, to_yaml  # the schema imports the callbacks, and so torch

        cfg = load_recipe(recipe, overrides, accelerate_config=args.accelerate_config)
        if args.print_config:
            sys.stdout.write(to_yaml(cfg))
            return 0
        if standby is not None and not standby_pays(ctx.launcher, cfg.trainer.devices, cfg.trainer.num_nodes):
            standby.cancel()  # the loaded recipe runs one rank here after all: no rank idles through the run
            standby = None
        from shardlight.train import train  # torch, Lightning, transformers: only once the recipe is known good

        summary = train(ctx, cfg, summary_json=args.summary_json, standby=standby)
    finally:
        if standby is not None:
            standby.cancel()
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
