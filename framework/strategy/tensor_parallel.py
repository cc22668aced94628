"""Tensor parallelism under FSDP2: the recipe's ``parallelism:`` section → ``ParallelDims`` (the
(dp_replicate, dp_shard, tp) mesh, Accelerate's names), the TP plan (the model's ``base_model_tp_plan`` or
the recipe's), its checks against the model, and ``apply_tensor_parallel`` (``parallelize_module`` with
``torch.distributed.tensor.parallel`` styles), which ``fsdp2.apply_fsdp2`` calls before FSDP.

The plan's style strings are transformers' (``colwise``, ``rowwise``, ...), mapped to torch's own styles
rather than to ``transformers.integrations.tensor_parallel``: that integration shards while loading
(``from_pretrained(tp_plan=...)``), before Lightning and FSDP see the model, while here TP must be applied to
the built model in the same pass as FSDP so both share one device mesh. Local head counts need nothing:
transformers' attention reshapes with ``-1`` heads, so a column-sharded q/k/v projection simply yields
``heads / tp`` heads per rank.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from torch import nn

from shardlight.errors import ShardlightError
from shardlight.recipe.schema import TP_STYLES
from shardlight.strategy.wrapping import tie_groups

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "tp")
# The config sizes a TP degree must divide: heads are split whole across ranks, so are the MLP's columns.
DIVIDED_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


@dataclass(frozen=True)
class ParallelDims:
    """The device mesh: ``dp_replicate`` × ``dp_shard`` × ``tp`` ranks, row-major (TP innermost, so a TP
    group is consecutive ranks: one node). ``tp_plan``: the recipe's plan (None: the model's)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    tp_plan: Optional[Dict[str, str]] = None

    @property
    def dp_size(self) -> int:
        """Ranks holding different data: TP ranks of one group see the same batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple:
        return (self.dp_replicate, self.dp_shard, self.tp)

    def dp_rank(self, global_rank: int) -> int:
        return global_rank // self.tp


def resolve_parallel_dims(parallelism: Any, fsdp: Any, sharding_strategy: str, num_nodes: int,
                          devices: int) -> Optional[ParallelDims]:
    """``parallelism`` (a ``ParallelismConfig``) on this world; None when it asks for nothing beyond the
    ``fsdp:`` section's own mesh (tp_size 1, no dp sizes)."""
    p = parallelism
    if p.tp_size == 1:
        if p.dp_replicate_size is not None or p.dp_shard_size is not None or p.tp_plan is not None:
            raise ShardlightError(
                "parallelism.dp_replicate_size / dp_shard_size / tp_plan apply with tp_size > 1; without tensor "
                "parallelism set the data-parallel mesh with fsdp.sharding_strategy and fsdp.mesh_shape")
        return None
    if fsdp.fsdp_version != 2:
        raise ShardlightError(
            f"parallelism.tp_size {p.tp_size} needs fsdp.fsdp_version: 2 (FSDP1 cannot shard the DTensors "
            "tensor parallelism makes)")
    world = num_nodes * devices
    tp = p.tp_size
    if tp > devices and not p.allow_cross_node_tp:
        raise ShardlightError(
            f"parallelism.tp_size {tp} is larger than the {devices} devices per node (trainer.devices): TP "
            "all-reduces every layer and would cross nodes; lower tp_size or set parallelism.allow_cross_node_tp=true")
    if world % tp:
        raise ShardlightError(f"world size {world} (trainer.num_nodes {num_nodes} x trainer.devices {devices}) is "
                              f"not divisible by parallelism.tp_size {tp}")
    dp = world // tp
    replicate = p.dp_replicate_size
    if replicate is None:
        if sharding_strategy == "NO_SHARD":
            replicate = dp
        elif "HYBRID" in sharding_strategy and fsdp.mesh_shape is None:
            replicate = num_nodes
        elif "HYBRID" in sharding_strategy:
            replicate = int(fsdp.mesh_shape[0])
        else:
            replicate = 1
    if dp % replicate:
        raise ShardlightError(f"world size {world} is not divisible by dp_replicate_size {replicate} x tp_size {tp}")
    shard = p.dp_shard_size if p.dp_shard_size is not None else dp // replicate
    if replicate * shard * tp != world:
        raise ShardlightError(
            f"parallelism mesh dp_replicate {replicate} x dp_shard {shard} x tp {tp} = {replicate * shard * tp} "
            f"does not match the world size {world} (trainer.num_nodes {num_nodes} x trainer.devices {devices})")
    return ParallelDims(replicate, shard, tp, dict(p.tp_plan) if p.tp_plan is not None else None)


def model_tp_plan(model: nn.Module, recipe_plan: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The plan to apply, keyed by module globs over ``model.named_modules()``: the recipe's as written, else
    the config's ``base_model_tp_plan`` (keys relative to the base model) under the base model's prefix.
    The head's ``_tp_plan`` entry is left out on purpose: a replicated ``lm_head`` keeps logits whole for the
    loss and the export check."""
    if recipe_plan is not None:
        return dict(recipe_plan)
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not base_plan:
        raise ShardlightError(
            f"parallelism.tp_size > 1 but {type(model).__name__} has no base_model_tp_plan; give one as "
            "parallelism.tp_plan ({module glob: colwise|rowwise}); candidates: " + ", ".join(linear_globs(model)))
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{key}": style for key, style in base_plan.items()}
    return dict(base_plan)


def linear_globs(model: nn.Module) -> List[str]:
    """The model's ``nn.Linear`` module names with layer indices as ``*``: what a plan can name."""
    globs = {re.sub(r"\.\d+(?=\.|$)", ".*", name) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return sorted(globs)


def check_tensor_parallel(model: nn.Module, dims: ParallelDims) -> Dict[str, str]:
    """Everything TP needs of ``model`` (the meta skeleton is enough): ``dims.tp`` divides the heads, the key/
    value heads and the MLP width, and every plan entry names existing modules with a known style. Returns the
    plan."""
    config = getattr(model, "config", None)
    for name in DIVIDED_SIZES:
        size = getattr(config, name, None)
        if size is not None and size % dims.tp:
            raise ShardlightError(f"parallelism.tp_size {dims.tp} does not divide the model's {name} ({size}); "
                                  "use a tp_size that divides it")
    plan = model_tp_plan(model, dims.tp_plan)
    names = [name for name, _ in model.named_modules() if name]
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ShardlightError(f"TP plan entry {pattern}: style '{style}' is not supported here (supported: "
                                  f"{', '.join(TP_STYLES)}); give parallelism.tp_plan")
        if not any(_matches(name, pattern) for name in names):
            raise ShardlightError(f"parallelism.tp_plan: {pattern} matches no module of the model; candidates: "
                                  + ", ".join(linear_globs(model)))
    for group in tie_groups(model):
        sharded = [(p, n) for n in group for p in plan if _matches(n.rsplit(".", 1)[0], p)]
        if sharded:
            pattern, name = sharded[0]
            others = " and ".join(sorted(set(group) - {name}))
            raise ShardlightError(
                f"parallelism.tp_plan: {pattern} would shard {name}, one weight with {others} "
                "(tied embeddings), and tensor parallelism shards each module's weights apart, breaking the tie; "
                f"leave {name.rsplit('.', 1)[0]} out of the plan (it stays whole on every TP rank) or untie it with "
                "model.config.tie_word_embeddings=false")
    return plan


def _matches(name: str, pattern: str) -> bool:
    """As ``parallelize_module`` matches: atom by atom, so ``*`` stands for one name, never for a dotted path."""
    atoms, pattern_atoms = name.split("."), pattern.split(".")
    return len(atoms) == len(pattern_atoms) and all(map(fnmatch.fnmatchcase, atoms, pattern_atoms))


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    # transformers' names for a column-sharded layer whose output is gathered (e.g. the head).
    return ColwiseParallel(output_layouts=Replicate())


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims, tp_mesh: Any) -> Dict[str, str]:
    """Shard the plan's modules of ``model`` over ``tp_mesh`` in place; returns the plan applied."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = model_tp_plan(model, dims.tp_plan)
    # parallelize_module matches each dotted atom with fnmatch, so the plan's "layers.*.x" globs work as is.
    parallelize_module(model, tp_mesh, {pattern: _style(style) for pattern, style in plan.items()})
    return plan


def parallel_mesh(dims: ParallelDims, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIM_NAMES)


def data_parallel_mesh(mesh: Any, dims: ParallelDims):
    """The FSDP mesh: replicate × shard (HSDP) when replicated, else the shard dimension alone."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
