"""The FSDP strategy, FSDP1 and FSDP2, in Accelerate's FSDP plugin vocabulary. What lives where:

- ``options``: the recipe's ``fsdp:`` section (+ precision, world) → ``ResolvedFSDP``, via Accelerate's plugin.
- ``wrapping``: which modules become FSDP units, and the wrap report.
- ``fsdp1``: ``apply_fsdp1`` (``FullyShardedDataParallel``); ``fsdp2``: ``apply_fsdp2`` (``fully_shard``).
- ``lightning``: ``ShardlightFSDPStrategy``, the Lightning adapter calling them from its hooks.
- ``unshard``: ``full_params``, full parameters of a sharded model in a block (``fsdp1`` registers its roots).
"""

from typing import Any

from shardlight.strategy.fsdp1 import apply_fsdp1
from shardlight.strategy.fsdp2 import apply_fsdp2
from shardlight.strategy.options import ResolvedFSDP, resolve_fsdp, resolve_recipe_fsdp
from shardlight.strategy.wrapping import find_block_classes, unit_modules, wrap_report


def __getattr__(name: str) -> Any:
    # The Lightning adapter on first use: the planner and preflight import this package without Lightning
    # (about 4 s of start-up on 2 cores).
    if name == "ShardlightFSDPStrategy":
        from shardlight.strategy.lightning import ShardlightFSDPStrategy

        return ShardlightFSDPStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ShardlightFSDPStrategy",
    "ResolvedFSDP",
    "resolve_fsdp",
    "resolve_recipe_fsdp",
    "apply_fsdp1",
    "apply_fsdp2",
    "find_block_classes",
    "unit_modules",
    "wrap_report",
]
