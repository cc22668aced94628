"""The FSDP strategy: a Lightning strategy speaking Accelerate's FSDP plugin vocabulary (FSDP1 and FSDP2)."""

from framework.strategy.fsdp import ShardlightFSDPStrategy
from framework.strategy.options import ResolvedFSDP, accelerate_config_overrides, resolve_fsdp, resolve_recipe_fsdp
from framework.strategy.wrapping import find_block_classes, unit_modules, wrap_report

__all__ = [
    "ShardlightFSDPStrategy",
    "ResolvedFSDP",
    "accelerate_config_overrides",
    "resolve_fsdp",
    "resolve_recipe_fsdp",
    "find_block_classes",
    "unit_modules",
    "wrap_report",
]
