"""``shardlight launch slurm|local``."""

from __future__ import annotations

import argparse

from framework.errors import ShardlightError


def _split(items):
    from framework.cli import _split_recipe_and_overrides

    return _split_recipe_and_overrides(items)


def run_slurm(args: argparse.Namespace) -> int:
    from launch.slurm import SlurmAllocation, prepare_job, submit

    if args.dry_run and args.submit:
        raise ShardlightError("choose one of --dry-run and --submit")
    recipe, overrides = _split(args.items)
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
    from launch.local import launch_local

    recipe, overrides = _split(args.items)
    return launch_local(recipe, overrides, args.nproc)


def add_launch_parser(subparsers) -> None:
    launch = subparsers.add_parser("launch", help="launch training on SLURM or locally",
                                   description="Generate/submit a SLURM job, or launch on this machine.")
    kinds = launch.add_subparsers(dest="launch_kind", metavar="KIND")
    kinds.required = True

    slurm = kinds.add_parser("slurm", help="write (and submit) an sbatch job running srun shardlight train",
                             description="Writes run_dir/job.sbatch: one srun task per GPU, SIGUSR1 90 s before "
                             "the time limit, requeue, resume=auto.")
    slurm.add_argument("items", nargs="*", metavar="[RECIPE] [key=value ...]")
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
    local.add_argument("items", nargs="*", metavar="[RECIPE] [key=value ...]")
    local.add_argument("--nproc", type=int, required=True, help="ranks on this machine")
    local.set_defaults(func=run_local)
