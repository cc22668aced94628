"""The FSDP strategy: a Lightning strategy speaking Accelerate's FSDP plugin vocabulary (FSDP1 and FSDP2)."""

from shardlight.strategy.fsdp import ShardlightFSDPStrategy
from shardlight.strategy.options import ResolvedFSDP, resolve_fsdp, resolve_recipe_fsdp
from shardlight.strategy.wrapping import find_block_classes, unit_modules, wrap_report

__all__ = [
    "ShardlightFSDPStrategy",
    "ResolvedFSDP",
    "resolve_fsdp",
    "resolve_recipe_fsdp",
    "find_block_classes",
    "unit_modules",
    "wrap_report",
]
