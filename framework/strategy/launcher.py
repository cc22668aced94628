"""Lightning's subprocess launcher for ranks already running in standby (``shardlight.launch.standby``)."""

from __future__ import annotations

import os

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from shardlight.launch.standby import StandbyRanks


class StandbyScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``_SubprocessScriptLauncher`` (its observer, its ``kill``, its once-only check), except that
    ranks 1..N-1 already run in standby, imported: where Lightning would start each one, it is handed the
    environment Lightning would have given it.

    Arguments:
        cluster_environment, num_processes, num_nodes: as for Lightning's launcher.
        standby: the ranks started ahead, by the launching process.
    """

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, standby: StandbyRanks) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.standby = standby

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        # What Lightning's launcher publishes before it copies this process's environment into each rank.
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        ranks = {local_rank: {**os.environ, "LOCAL_RANK": str(local_rank)}
                 for local_rank in range(1, self.num_processes)}
        self.procs = self.standby.hand_off(ranks)
