"""FSDP options in Accelerate's vocabulary → the concrete settings the strategy applies.

Parsing and defaults come from ``accelerate.utils.FullyShardedDataParallelPlugin`` itself, so a recipe
means exactly what the same keys mean to Accelerate. ``accelerate config`` YAML files are imported
unchanged into a recipe's ``fsdp:``/``trainer:`` sections.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from framework.config import FSDPConfig, RecipeConfig
from framework.errors import ShardlightError

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


# --- `accelerate config` YAML ------------------------------------------------------------------

_ACCELERATE_TOP_LEVEL_IGNORED = {
    "compute_environment", "debug", "downcast_bf16", "machine_rank", "main_training_function", "rdzv_backend",
    "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "enable_cpu_affinity", "main_process_ip",
    "main_process_port", "gpu_ids", "dynamo_config", "deepspeed_config", "megatron_lm_config",
}
_ACCELERATE_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "fp8": None}


def accelerate_config_overrides(path: str) -> Dict[str, Any]:
    """An ``accelerate config`` YAML → a nested dict of recipe values (``fsdp:`` and ``trainer:``)."""
    file = Path(path)
    if not file.is_file():
        raise ShardlightError(f"accelerate config not found: {path}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ShardlightError(f"accelerate config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ShardlightError(f"accelerate config {path} must be a mapping")
    kind = data.get("distributed_type", "FSDP")
    if str(kind).upper() != "FSDP":
        raise ShardlightError(f"accelerate config {path}: distributed_type is {kind}; shardlight runs FSDP")
    fsdp_fields = {f.name for f in fields(FSDPConfig)}
    fsdp: Dict[str, Any] = {}
    for key, value in (data.get("fsdp_config") or {}).items():
        name = key[len("fsdp_"):] if key.startswith("fsdp_") and key != "fsdp_version" else key
        if name not in fsdp_fields:
            close = difflib.get_close_matches(name, sorted(fsdp_fields), n=1)
            hint = f"; did you mean 'fsdp_{close[0]}'?" if close else ""
            raise ShardlightError(f"accelerate config {path}: unknown fsdp_config key '{key}'{hint}")
        if name in ("transformer_layer_cls_to_wrap", "transformer_cls_names_to_wrap") and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        fsdp[name] = value
    if fsdp.get("fsdp_version", 1) == 2 and isinstance(fsdp.get("reshard_after_forward"), str):
        fsdp["reshard_after_forward"] = fsdp["reshard_after_forward"].lower() == "true"
    if fsdp.get("fsdp_version", 1) == 1 and "reshard_after_forward" in fsdp and "sharding_strategy" not in fsdp:
        fsdp["sharding_strategy"] = fsdp.pop("reshard_after_forward")
    trainer: Dict[str, Any] = {}
    machines = int(data.get("num_machines", 1) or 1)
    if "num_processes" in data:
        processes = int(data["num_processes"])
        if processes <= 0 or processes % machines:
            raise ShardlightError(
                f"accelerate config {path}: num_processes {processes} is not a multiple of num_machines {machines}"
            )
        trainer["devices"] = processes // machines
    trainer["num_nodes"] = machines
    if "mixed_precision" in data:
        precision = _ACCELERATE_PRECISION.get(str(data["mixed_precision"]).lower(), "unknown")
        if precision in (None, "unknown"):
            raise ShardlightError(
                f"accelerate config {path}: mixed_precision '{data['mixed_precision']}' is not supported; "
                "allowed: no, bf16, fp16"
            )
        trainer["precision"] = precision
    if data.get("use_cpu"):
        trainer["accelerator"] = "cpu"
    unknown = set(data) - _ACCELERATE_TOP_LEVEL_IGNORED - {
        "distributed_type", "fsdp_config", "num_machines", "num_processes", "mixed_precision", "use_cpu"}
    if unknown:
        raise ShardlightError(f"accelerate config {path}: unknown keys {sorted(unknown)}")
    return {"fsdp": fsdp, "trainer": trainer}


def resolve_recipe_fsdp(cfg: RecipeConfig) -> ResolvedFSDP:
    return resolve_fsdp(cfg.fsdp, cfg.trainer.precision, cfg.trainer.num_nodes, cfg.trainer.devices)


__all__: List[str] = ["ResolvedFSDP", "resolve_fsdp", "resolve_recipe_fsdp", "accelerate_config_overrides"]
