"""``shardlight launch slurm``: an sbatch script that runs ``srun shardlight train`` with one task per GPU.

Slurm is the scheduler and torch.distributed the engine; shardlight only writes and submits the job.
Lightning's SLURM environment assigns ranks from the srun task ids, so ``trainer.num_nodes``/``devices``
are set to the allocation. The job resumes with ``resume=auto`` from its own run dir, so a requeued job
(preemption, ``scontrol requeue``) continues where it stopped, in the same W&B run (id from the job id).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from shardlight.errors import ShardlightError
from shardlight.launch.launchers import ENV_RUN_DIR, ENV_WANDB_RUN_ID, LightningLauncher, env_int

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


@dataclass
class SlurmAllocation:
    nodes: int
    gpus_per_node: int
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    gres: bool = False  # --gres=gpu:G instead of --gpus-per-node=G (older clusters)

    def validate(self) -> None:
        if self.nodes <= 0:
            raise ShardlightError(f"--nodes must be positive, got {self.nodes}")
        if self.gpus_per_node <= 0:
            raise ShardlightError(f"--gpus-per-node must be positive, got {self.gpus_per_node}")
        if self.cpus_per_task is not None and self.cpus_per_task <= 0:
            raise ShardlightError(f"--cpus-per-task must be positive, got {self.cpus_per_task}")
        if self.time is not None and not _TIME.match(self.time):
            raise ShardlightError(f"--time '{self.time}' is not a Slurm time (HH:MM:SS, MM, or D-HH:MM:SS)")


def check_overrides_match(overrides: List[str], alloc: SlurmAllocation) -> None:
    """The allocation decides ranks; an explicit override saying otherwise is a mistake, not a preference."""
    wanted = {"trainer.num_nodes": alloc.nodes, "trainer.devices": alloc.gpus_per_node}
    for item in overrides:
        key, _, value = item.partition("=")
        if key in wanted and value.strip() != str(wanted[key]):
            flag = "--nodes" if key == "trainer.num_nodes" else "--gpus-per-node"
            raise ShardlightError(
                f"{key}={value} disagrees with the allocation ({flag} {wanted[key]}); one task runs per GPU"
            )


class SlurmLauncher(LightningLauncher):
    """A task started by srun inside a Slurm job (one task per GPU)."""

    name = "slurm"

    def detect(self, env: Mapping[str, str]) -> bool:
        return "SLURM_JOB_ID" in env

    def launched(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env or "LOCAL_RANK" in env

    def rank(self, env: Mapping[str, str]) -> int:
        return env_int(env, "RANK", "SLURM_PROCID", "LOCAL_RANK")

    def job_id(self, env: Mapping[str, str]) -> Optional[str]:
        return env.get("SLURM_JOB_ID")

    def run_dir_name(self, job_id: Optional[str]) -> str:
        return run_dir_name(job_id)

    def requeue(self, job_id: Optional[str]) -> str:
        if not job_id:
            return "preempted outside Slurm: checkpoint saved, nothing to requeue"
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if result.returncode != 0:
            return f"scontrol requeue {job_id} failed: {result.stderr.strip()}"
        return f"requeued Slurm job {job_id}"

    def lightning_plugins(self) -> List[Any]:
        # Lightning imported only here: the launchers are read by every command, most never train.
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        # Lightning's own SLURM requeue saves inside the signal handler (hangs; Lightning #21406); ours
        # (callbacks/preemption.py) does not. Lightning ignores interactive jobs (named bash/interactive).
        return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def run_dir_name(job_id: Optional[str]) -> str:
    """The one naming rule for Slurm run dirs: the job id inside a job, the submission time before one."""
    return f"slurm-{job_id}" if job_id else f"slurm-{datetime.now():%Y%m%d-%H%M%S-%f}"


def train_command() -> List[str]:
    """How to start ``shardlight`` again in another process: the installed script, else ``python -m``."""
    script = Path(sys.executable).with_name("shardlight")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardlight.cli"]


def _version() -> str:
    import importlib.metadata  # about 25 ms: for the job script only, not for every command that imports this

    try:
        return importlib.metadata.version("shardlight")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def job_name(recipe_name: str) -> str:
    # Lightning ignores SLURM for jobs named "bash" or "interactive"; a prefix keeps names recognisable.
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"shardlight-{recipe_name}")


def render_sbatch(recipe_name: str, job_env: Dict[str, str], recipe: Optional[str], overrides: List[str],
                  alloc: SlurmAllocation, run_dir: Path) -> str:
    """The job script. ``job_env`` is the recipe's ``launch.env`` (validated: no secrets)."""
    name = job_name(recipe_name)
    gpu_line = f"--gres=gpu:{alloc.gpus_per_node}" if alloc.gres else f"--gpus-per-node={alloc.gpus_per_node}"
    directives = [
        f"--job-name={name}",
        f"--nodes={alloc.nodes}",
        f"--ntasks-per-node={alloc.gpus_per_node}",
        gpu_line,
        "--signal=USR1@90",
        "--requeue",
        "--open-mode=append",
        f"--output={run_dir}/slurm-%j.out",
        f"--error={run_dir}/slurm-%j.err",
    ]
    for flag, value in (("partition", alloc.partition), ("account", alloc.account), ("time", alloc.time),
                        ("qos", alloc.qos), ("constraint", alloc.constraint),
                        ("cpus-per-task", alloc.cpus_per_task), ("mem", alloc.mem)):
        if value is not None:
            directives.append(f"--{flag}={value}")
    train = train_command() + ["train"] + ([recipe] if recipe else []) + list(overrides) + [
        f"trainer.num_nodes={alloc.nodes}",
        f"trainer.devices={alloc.gpus_per_node}",
        "resume=auto",
        f"resume_dir={run_dir}",
        f"logging.wandb.group={name}",
    ]
    env_lines = [f"export {key}={shlex.quote(str(value))}" for key, value in sorted(job_env.items())]
    lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives] + [
        f"# Generated by shardlight {_version()} on {datetime.now():%Y-%m-%d %H:%M:%S}.",
        "# Secrets (WANDB_API_KEY, HF_TOKEN) are never written here: sbatch passes the submitting",
        "# shell's environment through to the job.",
        "set -euo pipefail",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'export MASTER_PORT="$((20000 + SLURM_JOB_ID % 10000))"',
        f"export {ENV_RUN_DIR}={shlex.quote(str(run_dir))}",
        '# A requeued job keeps its id, so it continues the same W&B run.',
        f'export {ENV_WANDB_RUN_ID}="slurm-${{SLURM_JOB_ID}}"',
        *env_lines,
        "srun --kill-on-bad-exit=1 " + " ".join(shlex.quote(part) for part in train),
    ]
    return "\n".join(lines) + "\n"


def write_job(recipe_name: str, job_env: Dict[str, str], recipe: Optional[str], overrides: List[str],
              alloc: SlurmAllocation, output_root: Path) -> tuple:
    """Write ``<output_root>/slurm-<time>/job.sbatch`` for an already validated recipe; (path, script)."""
    run_dir = output_root / run_dir_name(None)
    script = render_sbatch(recipe_name, job_env, recipe, overrides, alloc, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.sbatch"
    path.write_text(script)
    return path, script


def submit(path: Path) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ShardlightError("--submit needs Slurm's sbatch on PATH; it was not found (use --dry-run to only write)")
    result = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        message = " ".join(result.stderr.strip().splitlines()) or f"exit code {result.returncode}"
        raise ShardlightError(f"sbatch rejected the job: {message}")
    return result.stdout.strip().split(";")[0]

