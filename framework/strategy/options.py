"""FSDP options in Accelerate's vocabulary → the concrete settings the strategy applies.

Parsing and defaults come from ``accelerate.utils.FullyShardedDataParallelPlugin`` itself, so a recipe
means exactly what the same keys mean to Accelerate. (``accelerate config`` YAML files
become recipe values in ``shardlight.recipe.accelerate``.)
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from shardlight.recipe import FSDPConfig, RecipeConfig
from shardlight.errors import ShardlightError

# FSDP1 sharding strategy → FSDP2 (reshard_after_forward, hybrid mesh?) with the same memory/traffic shape.
_FSDP2_EQUIVALENT = {
    "FULL_SHARD": (True, False),
    "SHARD_GRAD_OP": (False, False),
    "HYBRID_SHARD": (True, True),
    "_HYBRID_SHARD_ZERO2": (False, True),
    "NO_SHARD": (False, True),
}
_PRECISION_TO_FSDP = {"bf16-mixed": "bf16", "bf16-true": None, "16-mixed": "fp16", "16-true": None}


@dataclass
class ResolvedFSDP:
    """What the strategy applies; every field already validated for ``version``."""

    version: int
    sharding_strategy: str            # FSDP1 name, also the FSDP2 equivalent shape
    reshard_after_forward: bool       # FSDP2
    hybrid: bool                      # 2-D (replicate × shard) mesh
    backward_prefetch: Optional[str]  # FSDP1 BackwardPrefetch name or None
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    cpu_offload: bool
    state_dict_type: str              # FULL_STATE_DICT | SHARDED_STATE_DICT
    sync_module_states: bool
    cpu_ram_efficient_loading: bool
    activation_checkpointing: bool
    mixed_precision: Optional[str]    # bf16 | fp16 | fp32 | None
    sync_each_batch: bool
    mesh_shape: Optional[Tuple[int, int]]


def _plugin(**kwargs: Any):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return FullyShardedDataParallelPlugin(**kwargs)
        except (ValueError, KeyError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ShardlightError(f"fsdp (fsdp_version {kwargs.get('fsdp_version')}): {message}") from None


def resolve_fsdp(fsdp: FSDPConfig, precision: str = "32-true", num_nodes: int = 1, devices: int = 1) -> ResolvedFSDP:
    version = fsdp.fsdp_version
    if version == 2:
        # The same refusals Accelerate makes for FSDP2, as errors (it only warns for some).
        if fsdp.backward_prefetch is not None:
            raise ShardlightError("fsdp.backward_prefetch is not supported in FSDP2 (fsdp_version: 2); remove it")
        if fsdp.forward_prefetch is not None:
            raise ShardlightError(
                "fsdp.forward_prefetch is not yet implemented in FSDP2, set to None or use `fsdp_version=1`"
            )
    strategy = fsdp.sharding_strategy
    # What both versions hand the plugin alike.
    shared = dict(
        auto_wrap_policy=fsdp.auto_wrap_policy,
        transformer_cls_names_to_wrap=fsdp.transformer_cls_names_to_wrap,
        min_num_params=fsdp.min_num_params,
        cpu_offload=fsdp.cpu_offload,
        state_dict_type=fsdp.state_dict_type,
        activation_checkpointing=fsdp.activation_checkpointing,
        mixed_precision_policy=fsdp.mixed_precision if fsdp.mixed_precision not in (None, "no") else None,
    )
    if version == 1:
        if strategy is None:
            strategy = fsdp.reshard_after_forward if isinstance(fsdp.reshard_after_forward, str) else "FULL_SHARD"
        plugin = _plugin(
            fsdp_version=1,
            reshard_after_forward=str(strategy),
            backward_prefetch=fsdp.backward_prefetch or "BACKWARD_PRE",
            forward_prefetch=bool(fsdp.forward_prefetch),
            limit_all_gathers=fsdp.limit_all_gathers,
            use_orig_params=True if fsdp.use_orig_params is None else fsdp.use_orig_params,
            # Checked by us: the plugin probes for a GPU when these are on ("no available devices").
            sync_module_states=False,
            **shared,
        )
        strategy = plugin.reshard_after_forward.name
        reshard, hybrid = _FSDP2_EQUIVALENT[strategy][0], "HYBRID" in strategy
        prefetch = plugin.backward_prefetch.name if plugin.backward_prefetch is not None else None
        forward_prefetch, use_orig = bool(plugin.forward_prefetch), bool(plugin.use_orig_params)
    else:
        # FSDP2 speaks reshard_after_forward; sharding_strategy only picks its default and the mesh.
        reshard, hybrid = _FSDP2_EQUIVALENT[strategy or "FULL_SHARD"]
        if fsdp.reshard_after_forward is not None:
            reshard = fsdp.reshard_after_forward
        plugin = _plugin(
            fsdp_version=2,
            reshard_after_forward=str(reshard).lower() if not isinstance(reshard, bool) else reshard,
            **shared,
        )
        reshard = bool(plugin.reshard_after_forward)
        if strategy in (None, "FULL_SHARD", "SHARD_GRAD_OP"):
            strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
        prefetch, forward_prefetch, use_orig = None, False, True
    mixed = fsdp.mixed_precision if fsdp.mixed_precision not in (None, "no") else _PRECISION_TO_FSDP.get(precision)
    mesh = _mesh_shape(fsdp, strategy, hybrid, num_nodes, devices)
    if version == 1 and hybrid and mesh is not None and mesh[1] == 1:
        # FSDP1 silently degrades a 1-wide shard group to NO_SHARD *and* stops syncing across replicas.
        raise ShardlightError(
            f"fsdp: {strategy} with a shard group of size 1 (mesh {mesh}) silently stops syncing gradients "
            "in FSDP1; use fsdp_version: 2, NO_SHARD, or a mesh with a shard dimension > 1"
        )
    return ResolvedFSDP(
        version=version,
        sharding_strategy=strategy,
        reshard_after_forward=reshard,
        hybrid=hybrid,
        backward_prefetch=prefetch,
        forward_prefetch=forward_prefetch,
        limit_all_gathers=fsdp.limit_all_gathers,
        use_orig_params=use_orig,
        cpu_offload=fsdp.cpu_offload,
        state_dict_type=plugin.state_dict_type.name,
        sync_module_states=bool(fsdp.sync_module_states or fsdp.cpu_ram_efficient_loading),
        cpu_ram_efficient_loading=bool(fsdp.cpu_ram_efficient_loading),
        activation_checkpointing=fsdp.activation_checkpointing,
        mixed_precision=mixed,
        sync_each_batch=fsdp.sync_each_batch,
        mesh_shape=mesh,
    )


def _mesh_shape(fsdp: FSDPConfig, strategy: str, hybrid: bool, num_nodes: int, devices: int):
    world = num_nodes * devices
    if not hybrid:
        if fsdp.mesh_shape is not None:
            raise ShardlightError(f"fsdp.mesh_shape only applies to hybrid sharding, not {strategy}")
        return None
    if strategy == "NO_SHARD":
        return (world, 1)
    shape = tuple(fsdp.mesh_shape) if fsdp.mesh_shape is not None else (num_nodes, devices)
    if len(shape) != 2 or any(int(d) <= 0 for d in shape):
        raise ShardlightError(f"fsdp.mesh_shape must be two positive sizes (replicate, shard), got {list(shape)}")
    if shape[0] * shape[1] != world:
        raise ShardlightError(
            f"fsdp.mesh_shape {list(shape)} does not match the world size {world} "
            f"(trainer.num_nodes {num_nodes} x trainer.devices {devices})"
        )
    return (int(shape[0]), int(shape[1]))


def resolve_recipe_fsdp(cfg: RecipeConfig) -> ResolvedFSDP:
    return resolve_fsdp(cfg.fsdp, cfg.trainer.precision, cfg.trainer.num_nodes, cfg.trainer.devices)


__all__: List[str] = ["ResolvedFSDP", "resolve_fsdp", "resolve_recipe_fsdp"]
