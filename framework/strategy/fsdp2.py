"""FSDP2 (``fully_shard``, DTensor) from a ``ResolvedFSDP``: ``apply_fsdp2`` shards a model in place, like
torchtitan's ``parallelize_llama`` (tensor parallelism, then activation checkpointing, then FSDP); also the
mesh it shards over and the full state dict and gradient clipping the Lightning adapter needs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from shardlight.collectives import all_gather_objects
from shardlight.strategy.options import ResolvedFSDP
from shardlight.strategy.tensor_parallel import apply_tensor_parallel, data_parallel_mesh, parallel_mesh
from shardlight.strategy.wrapping import block_modules, unit_modules, wrap_report


def fsdp2_mesh(resolved: ResolvedFSDP, device_type: str, world_size: int):
    """The (dp_replicate, dp_shard, tp) mesh with tensor parallelism; a (replicate, shard) mesh for hybrid
    sharding; else one dimension over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

    if resolved.parallel is not None:
        return parallel_mesh(resolved.parallel, device_type)
    if resolved.mesh_shape is not None:
        return init_device_mesh(device_type, resolved.mesh_shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,))


def _checkpoint_blocks(model: nn.Module, units: List[nn.Module], names: Optional[List[str]]) -> List[nn.Module]:
    """Non-reentrant checkpointing around each block. Returns the units to shard: the ``CheckpointWrapper``s
    (the modules their parents now call) of the units that are blocks, innermost first; the units unchanged
    when none is (size-based units)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    block_ids = {id(b) for b in block_modules(model, names)}
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: id(m) in block_ids)
    unit_ids = {id(u) for u in units}
    wrappers = [m for m in model.modules()
                if isinstance(m, CheckpointWrapper) and id(m._checkpoint_wrapped_module) in unit_ids]
    return wrappers[::-1] or units


def apply_fsdp2(model: nn.Module, resolved: ResolvedFSDP, mesh: Any) -> Tuple[nn.Module, Dict[str, Any]]:
    """Shard ``model`` (the HF model, the FSDP2 root) over ``mesh`` (``fsdp2_mesh``), in order: tensor
    parallelism over the mesh's ``tp`` dimension (with ``resolved.parallel``), activation checkpointing around
    each block, then ``fully_shard`` over the data-parallel dimensions on each unit innermost first, then on
    the root.

    Returns the root (now an ``FSDPModule``) and the wrap report (computed before sharding, so sizes are full;
    with TP also the mesh, the plan and this rank's parameter count).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    units = unit_modules(model, resolved.auto_wrap_policy, resolved.transformer_cls_names_to_wrap,
                         resolved.min_num_params)
    report = wrap_report(model, units, resolved.wrap_report_tiny_unit_params)
    dims = resolved.parallel
    if dims is not None:
        report["tp_plan"] = apply_tensor_parallel(model, dims, mesh["tp"])
        report["mesh"] = dict(zip(mesh.mesh_dim_names, dims.shape))
        mesh = data_parallel_mesh(mesh, dims)
    if resolved.activation_checkpointing:
        units = _checkpoint_blocks(model, units, resolved.transformer_cls_names_to_wrap)
    kwargs: Dict[str, Any] = {"mesh": mesh, "reshard_after_forward": resolved.reshard_after_forward}
    if resolved.param_dtype is not None:
        # Gradients reduce in fp32 whatever the parameter dtype (as torchtitan): bf16/fp16 sums lose precision.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=resolved.param_dtype, reduce_dtype=torch.float32)
    if resolved.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if dims is not None:
        report["params_this_rank"] = sum(_local(p).numel() for p in model.parameters())
        # uneven shards: FSDP pads the last rank's, TP splits whole heads
        report["params_per_rank"] = [int(v) for v in all_gather_objects(report["params_this_rank"])]
    return model, report


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def fsdp2_full_state_dict(module: nn.Module) -> Dict[str, Any]:
    """Unsharded weights of ``module`` (holding the FSDP2 root) on rank 0, on CPU (empty elsewhere); every
    rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fsdp2_clip_grad_norm(module: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm. Each DTensor group's norm is reduced across its shards by torch; with
    tensor parallelism the gradients live on two meshes (TP-sharded ones on dp × tp, the rest on dp alone),
    which one norm cannot mix, so the per-mesh norms are combined here (as torchtitan does across stages)."""
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    by_mesh: Dict[Any, List[nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.stack(norms).pow(2).sum().sqrt() if len(norms) > 1 else norms[0]
    for group in by_mesh.values():  # one foreach scaling per mesh: DTensor ops cannot mix meshes
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
