"""``shardlight launch local``: one machine, no Slurm. Lightning's own launcher starts the N ranks."""

from __future__ import annotations

import os
import subprocess
from typing import List, Optional

from shardlight.errors import ShardlightError
from shardlight.launch.launchers import without_run_env
from shardlight.launch.slurm import train_command


def launch_local(recipe: Optional[str], overrides: List[str], nproc: int) -> int:
    if nproc <= 0:
        raise ShardlightError(f"--nproc must be positive, got {nproc}")
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "trainer.devices" and value != str(nproc):
            raise ShardlightError(f"trainer.devices={value} disagrees with --nproc {nproc}")
    command = train_command() + ["train"] + ([recipe] if recipe else []) + list(overrides) + [
        f"trainer.devices={nproc}", "trainer.num_nodes=1"]
    # A fresh run of its own: nothing of a surrounding run (its dir, its rank) may leak into it.
    return subprocess.call(command, env=without_run_env(os.environ))
