"""The Lightning strategy a recipe's ``fsdp:`` and ``trainer:`` sections describe."""

from __future__ import annotations

from datetime import timedelta

from shardlight.recipe import RecipeConfig
from shardlight.strategy import ShardlightFSDPStrategy, resolve_recipe_fsdp


def build_strategy(cfg: RecipeConfig) -> ShardlightFSDPStrategy:
    t = cfg.trainer
    return ShardlightFSDPStrategy(
        resolve_recipe_fsdp(cfg), precision=t.precision, num_nodes=t.num_nodes, devices=t.devices,
        num_threads=t.num_threads, timeout=timedelta(seconds=t.collective_timeout_s),
    )
