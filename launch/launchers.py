"""What started this process, and the variables that cross process boundaries.

A launcher is whatever put this process on its machine: nothing (``local``), Lightning's own subprocess
launcher, torchrun, or Slurm's srun. Each one answers the same questions from the environment (is this a
rank it started, which rank, which job, what the run dir is called) and Slurm can requeue a job. Adding a
launcher is one class in a new file plus one line in ``LAUNCHERS`` (``shardlight/launch/__init__.py``).

The ``SHARDLIGHT_*`` names below are the only environment variables shardlight's own processes hand to
each other (parent → ranks, sbatch script → job); ``shardlight.run_context.RunContext`` reads and writes them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Protocol

ENV_RUN_DIR = "SHARDLIGHT_RUN_DIR"
ENV_RESUME_FROM = "SHARDLIGHT_RESUME_FROM"  # "" means "decided: start fresh"
ENV_WANDB_RUN_ID = "SHARDLIGHT_WANDB_RUN_ID"
# Test-only fault injection: a rank dies inside the checkpoint save of this step.
ENV_FAULT_KILL_IN_SAVE_STEP = "SHARDLIGHT_FAULT_KILL_IN_SAVE_STEP"
# torch's flight recorder (every rank's last collectives): its size, and where its NCCL watchdog dumps it on a
# collective timeout (the file name is this prefix plus the rank).
ENV_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
ENV_FR_DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
ENV_NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
RUN_ENV_VARS = (ENV_RUN_DIR, ENV_RESUME_FROM, ENV_WANDB_RUN_ID, ENV_FR_BUFFER_SIZE, ENV_FR_DUMP_FILE,
                ENV_NCCL_DUMP_ON_TIMEOUT)


class Launcher(Protocol):
    name: str

    def detect(self, env: Mapping[str, str]) -> bool:
        """This launcher started the current process."""

    def launched(self, env: Mapping[str, str]) -> bool:
        """The current process is a rank the launcher started (it inherits the parent's decisions)."""

    def rank(self, env: Mapping[str, str]) -> int:
        """The global rank of the current process."""

    def job_id(self, env: Mapping[str, str]) -> Optional[str]:
        """The scheduler's job id (or the launcher's run id), if there is one."""

    def run_dir_name(self, job_id: Optional[str]) -> str:
        """The run dir's name under ``output_dir/<recipe>/``, the same on every rank of one run."""

    def requeue(self, job_id: Optional[str]) -> str:
        """Put the job back in the queue after a preemption; a one-line account of what happened."""

    def lightning_plugins(self) -> List[Any]:
        """Lightning plugins this launcher needs (a cluster environment that reads its ranks), if any."""


def _timestamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def env_int(env: Mapping[str, str], *keys: str) -> int:
    for key in keys:
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


class LocalLauncher:
    """No launcher: ``shardlight train`` typed in a shell; Lightning may spawn the other ranks itself."""

    name = "local"

    def detect(self, env: Mapping[str, str]) -> bool:
        return True

    def launched(self, env: Mapping[str, str]) -> bool:
        return False

    def rank(self, env: Mapping[str, str]) -> int:
        return 0

    def job_id(self, env: Mapping[str, str]) -> Optional[str]:
        return None

    def run_dir_name(self, job_id: Optional[str]) -> str:
        return _timestamp()

    def requeue(self, job_id: Optional[str]) -> str:
        return "preempted outside a scheduler: checkpoint saved, nothing to requeue"

    def lightning_plugins(self) -> List[Any]:
        return []


class LightningLauncher(LocalLauncher):
    """A rank started by Lightning's subprocess launcher (it sets LOCAL_RANK/NODE_RANK/WORLD_SIZE)."""

    name = "lightning"

    def detect(self, env: Mapping[str, str]) -> bool:
        return "LOCAL_RANK" in env

    def launched(self, env: Mapping[str, str]) -> bool:
        return True

    def rank(self, env: Mapping[str, str]) -> int:
        return env_int(env, "RANK", "LOCAL_RANK")


class TorchrunLauncher(LightningLauncher):
    name = "torchrun"

    def detect(self, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env

    def job_id(self, env: Mapping[str, str]) -> Optional[str]:
        return env.get("TORCHELASTIC_RUN_ID")

    def run_dir_name(self, job_id: Optional[str]) -> str:
        return f"torchrun-{job_id}" if job_id else _timestamp()


def without_run_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """A copy of an environment without shardlight's per-run and per-rank variables: for starting a new,
    independent run (``launch local``, ``profile``) from inside another process."""
    drop = set(RUN_ENV_VARS) | {"LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"}
    return {k: v for k, v in environ.items() if k not in drop}
