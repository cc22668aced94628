"""The Lightning strategy a recipe's ``fsdp:`` and ``trainer:`` sections describe."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

from shardlight.launch.standby import StandbyRanks
from shardlight.recipe import RecipeConfig
from shardlight.strategy import ShardlightFSDPStrategy, resolve_recipe_fsdp


def build_strategy(cfg: RecipeConfig, standby: Optional[StandbyRanks] = None) -> ShardlightFSDPStrategy:
    """``standby``: the other local ranks, already started (``shardlight.launch.standby``)."""
    t = cfg.trainer
    return ShardlightFSDPStrategy(
        resolve_recipe_fsdp(cfg), precision=t.precision, num_nodes=t.num_nodes, devices=t.devices,
        num_threads=t.num_threads, timeout=timedelta(seconds=t.collective_timeout_s), standby=standby,
    )
