"""The ``shardlight`` command: ``train``, ``analyze``, ``plan``, ``profile``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from framework.errors import ShardlightError


def _split_recipe_and_overrides(items: List[str]):
    recipe, overrides = None, []
    for index, item in enumerate(items):
        if index == 0 and "=" not in item:
            recipe = item
        elif "=" not in item:
            raise ShardlightError(f"'{item}' is not an override of the form key.path=value")
        else:
            overrides.append(item)
    return recipe, overrides


def run_train(args: argparse.Namespace) -> int:
    from framework.config import load_recipe, to_yaml

    recipe, overrides = _split_recipe_and_overrides(args.items)
    cfg = load_recipe(recipe, overrides, accelerate_config=args.accelerate_config)
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    # Quiet third-party chatter that is not the user's concern on an offline CPU run.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_SILENT", "true")
    from framework.train import train

    train(cfg, summary_json=args.summary_json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlight",
        description="Recipe-driven FSDP fine-tuning of Hugging Face models, measuring where the bottleneck went.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser(
        "train",
        help="fine-tune a model from a recipe",
        description="Train from a YAML recipe (default: the embedded tiny-llama-sft recipe). "
        "Overrides use OmegaConf dotted keys, e.g. trainer.max_steps=50 fsdp.sharding_strategy=SHARD_GRAD_OP.",
    )
    train.add_argument("items", nargs="*", metavar="[RECIPE] [key=value ...]", help="recipe file, then overrides")
    train.add_argument("--accelerate-config", metavar="FILE",
                       help="an `accelerate config` YAML; its FSDP/process values land in fsdp:/trainer:")
    train.add_argument("--print-config", action="store_true", help="print the fully resolved recipe as YAML and exit")
    train.add_argument("--summary-json", metavar="PATH", help="write first/final val loss, steps, dirs, wall time")
    train.set_defaults(func=run_train)

    from framework.trace.cli import add_analyze_parser

    add_analyze_parser(sub)
    from framework.export import add_checkpoint_parsers

    add_checkpoint_parsers(sub)
    from framework.planner.cli import add_planner_parsers

    add_planner_parsers(sub)
    from launch.cli import add_launch_parser

    add_launch_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    # Overrides may come after options (train R --summary-json S a.b=1); argparse can't intermix
    # positionals with subcommands, so leftover key=value words are handed to train here.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or getattr(args, "items", None) is None]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.items = list(args.items) + extra
    try:
        return args.func(args)
    except ShardlightError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
