"""``shardlight launch slurm|local``: validate here, then hand the run to a launcher in ``shardlight.launch``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

from shardlight.cli.common import add_recipe_items, split_recipe_and_overrides
from shardlight.errors import ShardlightError
from shardlight.launch.local import launch_local
from shardlight.launch.slurm import SlurmAllocation, check_overrides_match, submit, write_job
from shardlight.run_context import RunContext


def prepare_job(recipe: Optional[str], overrides: List[str], alloc: SlurmAllocation) -> tuple:
    """Validate everything first (allocation, recipe, the checks a rank would make), then write
    ``run_dir/job.sbatch``; returns (path, script text)."""
    alloc.validate()
    check_overrides_match(overrides, alloc)
    from shardlight.recipe import load_recipe  # the schema imports the callbacks, and so torch

    cfg = load_recipe(recipe, list(overrides) + [f"trainer.num_nodes={alloc.nodes}",
                                                  f"trainer.devices={alloc.gpus_per_node}"])
    from shardlight.preflight import preflight  # tokenizer, model config, wrap classes: torch and transformers

    preflight(cfg, RunContext(launcher="slurm"))  # judged for the job's nodes, not this login node
    recipe_arg = str(Path(recipe).resolve()) if recipe else None
    return write_job(cfg.name, dict(cfg.launch.env), recipe_arg, overrides, alloc,
                     Path(cfg.output_dir).resolve() / cfg.name)


def run_slurm(args: argparse.Namespace) -> int:
    if args.dry_run and args.submit:
        raise ShardlightError("choose one of --dry-run and --submit")
    recipe, overrides = split_recipe_and_overrides(args.items)
    alloc = SlurmAllocation(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, partition=args.partition, account=args.account,
        time=args.time, qos=args.qos, constraint=args.constraint, cpus_per_task=args.cpus_per_task,
        mem=args.mem, gres=args.gres,
    )
    path, script = prepare_job(recipe, overrides, alloc)
    if args.submit:
        job_id = submit(path)
        print(f"submitted job {job_id}: {path}")
        print(job_id)
    else:
        if args.dry_run:
            print(script, end="")
        print(f"wrote {path}")
    return 0


def run_local(args: argparse.Namespace) -> int:
    recipe, overrides = split_recipe_and_overrides(args.items)
    return launch_local(recipe, overrides, args.nproc)


def add_parsers(subparsers) -> None:
    launch = subparsers.add_parser("launch", help="launch training on SLURM or locally",
                                   description="Generate/submit a SLURM job, or launch on this machine.")
    kinds = launch.add_subparsers(dest="launch_kind", metavar="KIND")
    kinds.required = True

    slurm = kinds.add_parser("slurm", help="write (and submit) an sbatch job running srun shardlight train",
                             description="Writes run_dir/job.sbatch: one srun task per GPU, SIGUSR1 90 s before "
                             "the time limit, requeue, resume=auto.")
    add_recipe_items(slurm)
    slurm.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    slurm.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (= srun tasks = ranks) per node")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--time", help="time limit, HH:MM:SS")
    slurm.add_argument("--qos")
    slurm.add_argument("--constraint")
    slurm.add_argument("--cpus-per-task", type=int)
    slurm.add_argument("--mem", help="memory per node, e.g. 200G")
    slurm.add_argument("--gres", action="store_true", help="request GPUs as --gres=gpu:G (older clusters)")
    mode = slurm.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script (it is written either way)")
    mode.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    slurm.set_defaults(func=run_slurm)

    local = kinds.add_parser("local", help="run N ranks on this machine (no Slurm)")
    add_recipe_items(local)
    local.add_argument("--nproc", type=int, required=True, help="ranks on this machine")
    local.set_defaults(func=run_local)
