"""The FSDP strategy (Lightning strategy speaking Accelerate's FSDP plugin vocabulary)."""

from framework.strategy.fsdp import ShardlightFSDPStrategy, build_auto_wrap_policy, find_block_classes

__all__ = ["ShardlightFSDPStrategy", "build_auto_wrap_policy", "find_block_classes"]
