"""``shardlight launch local``: one machine, no Slurm. Lightning's own launcher starts the N ranks."""

from __future__ import annotations

import os
import subprocess
from typing import List, Optional

from framework.errors import ShardlightError
from launch.slurm import _train_command


def launch_local(recipe: Optional[str], overrides: List[str], nproc: int) -> int:
    if nproc <= 0:
        raise ShardlightError(f"--nproc must be positive, got {nproc}")
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "trainer.devices" and value != str(nproc):
            raise ShardlightError(f"trainer.devices={value} disagrees with --nproc {nproc}")
    command = _train_command() + ["train"] + ([recipe] if recipe else []) + list(overrides) + [
        f"trainer.devices={nproc}", "trainer.num_nodes=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "SHARDLIGHT_RUN_DIR")}
    return subprocess.call(command, env=env)
