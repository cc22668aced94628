"""The recipe's ``fsdp:`` section, ``trainer.precision`` and the world → ``ResolvedFSDP``, the only FSDP
configuration the rest of the strategy (``fsdp1``, ``fsdp2``, ``lightning``) sees.

Parsing and defaults come from ``accelerate.utils.FullyShardedDataParallelPlugin`` itself, so a recipe
means exactly what the same keys mean to Accelerate. (``accelerate config`` YAML files become recipe values
in ``shardlight.recipe.accelerate``.) Every recipe field named as a plugin field goes to the plugin as
written, except the few in ``_DECIDED_HERE``; each ``ResolvedFSDP`` field says where its value comes from.

Adding an Accelerate option: its field in ``FSDPConfig`` (named as the plugin's), one ``_parsed(...)`` line
in ``ResolvedFSDP``, and its use in ``fsdp1`` / ``fsdp2``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, List, Optional, Tuple

import torch

from shardlight.errors import ShardlightError
from shardlight.recipe import FSDPConfig, RecipeConfig
from shardlight.strategy.tensor_parallel import ParallelDims, resolve_parallel_dims

# FSDP1 sharding strategy → FSDP2 (reshard_after_forward, hybrid mesh?) with the same memory/traffic shape.
_FSDP2_EQUIVALENT = {
    "FULL_SHARD": (True, False),
    "SHARD_GRAD_OP": (False, False),
    "HYBRID_SHARD": (True, True),
    "_HYBRID_SHARD_ZERO2": (False, True),
    "NO_SHARD": (False, True),
}
_PRECISION_TO_FSDP = {"bf16-mixed": "bf16", "bf16-true": None, "16-mixed": "fp16", "16-true": None}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Plugin fields resolve_fsdp fills per version instead of passing the recipe's value through: the sharding
# shape, shardlight's defaults, the precision, and the two the plugin would act on at once (a GPU probe for
# sync_module_states, an environment variable for cpu_ram_efficient_loading).
_DECIDED_HERE = frozenset({
    "fsdp_version", "sharding_strategy", "reshard_after_forward", "backward_prefetch", "forward_prefetch",
    "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading", "mixed_precision_policy",
})


def _as_is(value: Any) -> Any:
    return value


def _enum_name(value: Any) -> Optional[str]:
    return value.name if value is not None else None


def _orig_params(value: Optional[bool]) -> bool:
    # The plugin drops the setting for FSDP2 (None): fully_shard always keeps the original parameters.
    return True if value is None else bool(value)


def _parsed(convert: Callable[[Any], Any] = _as_is) -> Any:
    """A field read back from the plugin, as Accelerate parsed and defaulted it for the version."""
    return field(metadata={"source": "plugin", "convert": convert})


def _given(convert: Callable[[Any], Any] = _as_is) -> Any:
    """A field taken from the recipe as written (the schema checked it; the plugin may have too)."""
    return field(metadata={"source": "recipe", "convert": convert})


@dataclass(frozen=True)
class ResolvedFSDP:
    """What the strategy applies; every field already validated for ``version``. Fields without a source
    are decided by ``resolve_fsdp``, where the two FSDP versions spell the same thing differently."""

    version: int
    sharding_strategy: str                  # FSDP1 name, also the FSDP2 equivalent shape
    reshard_after_forward: bool             # FSDP2
    hybrid: bool                            # 2-D (replicate × shard) mesh
    mesh_shape: Optional[Tuple[int, int]]
    mixed_precision: Optional[str]          # bf16 | fp16 | fp32 | None (see param_dtype)
    sync_module_states: bool                # FSDP1
    backward_prefetch: Optional[str] = _parsed(_enum_name)  # FSDP1 BackwardPrefetch name or None
    forward_prefetch: bool = _parsed(bool)
    limit_all_gathers: bool = _parsed(bool)
    use_orig_params: bool = _parsed(_orig_params)
    state_dict_type: str = _parsed(_enum_name)  # FULL_STATE_DICT | SHARDED_STATE_DICT
    activation_checkpointing: bool = _parsed(bool)
    activation_checkpointing_offload: bool = _parsed(bool)  # Accelerate: FSDP2 only
    activation_checkpointing_mode: str = _given()            # full | selective
    activation_checkpointing_every: int = _given()           # checkpoint blocks 0, n, 2n, ...
    cpu_offload: bool = _given(bool)
    cpu_ram_efficient_loading: bool = _given(bool)
    auto_wrap_policy: str = _given()        # TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP
    transformer_cls_names_to_wrap: Optional[List[str]] = _given()
    min_num_params: Optional[int] = _given()
    sync_each_batch: bool = _given()
    wrap_report_tiny_unit_params: int = _given()
    # The recipe's parallelism: section (tensor parallelism and its mesh); None: the mesh above, as before TP.
    parallel: Optional[ParallelDims] = None
    compile: bool = False                   # the recipe's compile: each block, after checkpointing, before FSDP

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        """``mixed_precision`` as a dtype: FSDP's parameter dtype (FSDP1: also reduce and buffers; FSDP2
        reduces in fp32). None: no policy from the recipe (FSDP1 then follows Lightning's precision plugin)."""
        return _DTYPES[self.mixed_precision] if self.mixed_precision else None


def _plugin(**kwargs: Any):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return FullyShardedDataParallelPlugin(**kwargs)
        except (ValueError, KeyError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ShardlightError(f"fsdp (fsdp_version {kwargs.get('fsdp_version')}): {message}") from None


def _passed_through(fsdp: FSDPConfig) -> dict:
    """The recipe's values for every plugin field not in ``_DECIDED_HERE``, as written."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin_fields = {f.name for f in fields(FullyShardedDataParallelPlugin)} - _DECIDED_HERE
    return {f.name: getattr(fsdp, f.name) for f in fields(FSDPConfig) if f.name in plugin_fields}


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
    explicit_mixed = fsdp.mixed_precision if fsdp.mixed_precision not in (None, "no") else None
    common = dict(fsdp_version=version, mixed_precision_policy=explicit_mixed, **_passed_through(fsdp))
    if version == 1:
        if strategy is None:
            strategy = fsdp.reshard_after_forward if isinstance(fsdp.reshard_after_forward, str) else "FULL_SHARD"
        plugin = _plugin(
            reshard_after_forward=str(strategy),
            backward_prefetch=fsdp.backward_prefetch or "BACKWARD_PRE",
            forward_prefetch=bool(fsdp.forward_prefetch),
            use_orig_params=True if fsdp.use_orig_params is None else fsdp.use_orig_params,
            # Checked by us: the plugin probes for a GPU when these are on ("no available devices").
            sync_module_states=False,
            **common,
        )
        strategy = plugin.reshard_after_forward.name
        reshard, hybrid = _FSDP2_EQUIVALENT[strategy][0], "HYBRID" in strategy
    else:
        # FSDP2 speaks reshard_after_forward; sharding_strategy only picks its default and the mesh.
        reshard, hybrid = _FSDP2_EQUIVALENT[strategy or "FULL_SHARD"]
        if fsdp.reshard_after_forward is not None:
            reshard = fsdp.reshard_after_forward
        plugin = _plugin(
            reshard_after_forward=str(reshard).lower() if not isinstance(reshard, bool) else reshard, **common
        )
        reshard = bool(plugin.reshard_after_forward)
        if strategy in (None, "FULL_SHARD", "SHARD_GRAD_OP"):
            strategy = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
    mesh = _mesh_shape(fsdp, strategy, hybrid, num_nodes, devices)
    if version == 1 and hybrid and mesh is not None and mesh[1] == 1:
        # FSDP1 silently degrades a 1-wide shard group to NO_SHARD *and* stops syncing across replicas.
        raise ShardlightError(
            f"fsdp: {strategy} with a shard group of size 1 (mesh {mesh}) silently stops syncing gradients "
            "in FSDP1; use fsdp_version: 2, NO_SHARD, or a mesh with a shard dimension > 1"
        )
    sources = {"plugin": plugin, "recipe": fsdp}
    read = {
        f.name: f.metadata["convert"](getattr(sources[f.metadata["source"]], f.name))
        for f in fields(ResolvedFSDP) if "source" in f.metadata
    }
    return ResolvedFSDP(
        version=version,
        sharding_strategy=strategy,
        reshard_after_forward=reshard,
        hybrid=hybrid,
        mesh_shape=mesh,
        mixed_precision=explicit_mixed or _PRECISION_TO_FSDP.get(precision),
        # Accelerate's rule, applied here because the plugin is never told (see _DECIDED_HERE).
        sync_module_states=bool(fsdp.sync_module_states),
        **read,
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
    t = cfg.trainer
    resolved = replace(resolve_fsdp(cfg.fsdp, t.precision, t.num_nodes, t.devices), compile=bool(cfg.compile))
    parallel = resolve_parallel_dims(cfg.parallelism, cfg.fsdp, resolved.sharding_strategy, t.num_nodes, t.devices)
    return replace(resolved, parallel=parallel) if parallel is not None else resolved


__all__: List[str] = ["ResolvedFSDP", "resolve_fsdp", "resolve_recipe_fsdp"]
