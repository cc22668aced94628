"""Who this process is and where its run lives: the ``RunContext``, passed as an argument everywhere.

Environment variables (named once, in ``shardlight.launch.launchers``) are read and written only here, at process
edges: ``RunContext.from_env()`` when a
process starts (a launcher's variables say which rank it is; a parent's ``SHARDLIGHT_*`` variables carry
the decisions it made for the run), and ``ctx.to_env()`` just before the ranks are spawned, so that every
rank agrees on one run dir, one resume checkpoint and one W&B run. No other module of ours touches
``os.environ`` for these.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional

from shardlight.launch import Launcher, detect_launcher
from shardlight.launch.launchers import (
    ENV_FAULT_KILL_IN_SAVE_STEP,
    ENV_FR_BUFFER_SIZE,
    ENV_FR_DUMP_FILE,
    ENV_NCCL_DUMP_ON_TIMEOUT,
    ENV_RESUME_FROM,
    ENV_RUN_DIR,
    ENV_WANDB_RUN_ID,
)

# Where a run's flight-recorder dumps go (``rank_<R>``, torch's format): the hang watchdog's and torch's own.
FLIGHT_RECORDER_DIR = "flight_recorder"
FLIGHT_RECORDER_PREFIX = "rank_"


@dataclass(frozen=True)
class RunContext:
    """The facts of one process in one run.

    Arguments:
        launcher: what started this process (``local``, ``lightning``, ``torchrun``, ``slurm``).
        rank: the global rank, 0 before any rank is spawned.
        launched: started by a launcher, so it inherits the parent's decisions instead of making them.
        run_dir: the run's directory; ``None`` until the launching process decides it.
        resume_from: the checkpoint this run resumes from (``None``: a fresh start).
        resume_decided: ``resume_from`` was decided (by this process or inherited); ranks never re-decide.
        wandb_run_id: a fixed W&B run id (a requeued Slurm job keeps its run); ``None``: W&B picks one.
        job_id: the scheduler's job id, if any.
        fault_kill_in_save_step: test-only; die inside the checkpoint save of this step.
        flight_recorder_entries: collectives torch's flight recorder keeps per rank (0: off); set before the
            process group starts, so every rank of the run records.
    """

    launcher: str = "local"
    rank: int = 0
    launched: bool = False
    run_dir: Optional[Path] = None
    resume_from: Optional[Path] = None
    resume_decided: bool = False
    wandb_run_id: Optional[str] = None
    job_id: Optional[str] = None
    fault_kill_in_save_step: Optional[int] = None
    flight_recorder_entries: int = 0

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "RunContext":
        env = os.environ if environ is None else environ
        launcher: Launcher = detect_launcher(env)
        launched = launcher.launched(env)
        # A launching process decides afresh; only ranks it started inherit its decisions.
        inherited = env if launched else {}
        run_dir = env.get(ENV_RUN_DIR) or None  # an sbatch script fixes the run dir for the whole job
        resume = inherited.get(ENV_RESUME_FROM)
        kill_step = env.get(ENV_FAULT_KILL_IN_SAVE_STEP)
        return cls(
            launcher=launcher.name,
            rank=launcher.rank(env),
            launched=launched,
            run_dir=Path(run_dir) if run_dir else None,
            resume_from=Path(resume) if resume else None,
            resume_decided=resume is not None,
            wandb_run_id=env.get(ENV_WANDB_RUN_ID) or None,
            job_id=launcher.job_id(env),
            fault_kill_in_save_step=int(kill_step) if kill_step and kill_step.isdigit() else None,
        )

    def to_env(self) -> Dict[str, str]:
        """The variables ranks spawned from this process need, to agree with it."""
        env: Dict[str, str] = {}
        if self.run_dir is not None:
            env[ENV_RUN_DIR] = str(self.run_dir)
        if self.resume_decided:
            env[ENV_RESUME_FROM] = str(self.resume_from) if self.resume_from else ""
        if self.wandb_run_id:
            env[ENV_WANDB_RUN_ID] = self.wandb_run_id
        if self.flight_recorder_entries and self.run_dir is not None:
            env[ENV_FR_BUFFER_SIZE] = str(self.flight_recorder_entries)
            env[ENV_FR_DUMP_FILE] = str(self.flight_recorder_dir() / FLIGHT_RECORDER_PREFIX)
            env[ENV_NCCL_DUMP_ON_TIMEOUT] = "1"
        return env

    def flight_recorder_dir(self) -> Path:
        """``run_dir/flight_recorder``: every rank's dump of its last collectives when the run hangs."""
        assert self.run_dir is not None, "the run dir is decided before anything asks for its folders"
        return self.run_dir / FLIGHT_RECORDER_DIR

    def export(self) -> None:
        """Publish ``to_env()`` for the ranks this process is about to spawn (Lightning's launcher copies
        ``os.environ`` into its children); the single place shardlight writes its own variables."""
        os.environ.update(self.to_env())

    def replace(self, **changes) -> "RunContext":
        return dataclasses.replace(self, **changes)


def usable_cores() -> int:
    """The cores this process may run on: a Slurm step or taskset may allow fewer than the machine has (its
    affinity), a container fewer than both (its cgroup's CPU quota; its ``os.cpu_count()`` is the host's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:  # cgroup v2: "QUOTA PERIOD", or "max PERIOD" for no limit
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores
