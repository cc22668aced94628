"""FSDP2 (``fully_shard``, DTensor) from a ``ResolvedFSDP``: ``apply_fsdp2`` shards a model in place, like
torchtitan's ``parallelize_llama``; also the mesh it shards over and the full state dict and gradient
clipping the Lightning adapter needs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from shardlight.strategy.options import ResolvedFSDP
from shardlight.strategy.wrapping import block_modules, unit_modules, wrap_report


def fsdp2_mesh(resolved: ResolvedFSDP, device_type: str, world_size: int):
    """A (replicate, shard) mesh for hybrid sharding, else one dimension over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh

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
    """Shard ``model`` (the HF model, the FSDP2 root) over ``mesh`` (``fsdp2_mesh``), in order: activation
    checkpointing around each block, then ``fully_shard`` on each unit innermost first, then on the root.

    Returns the root (now an ``FSDPModule``) and the wrap report (computed before sharding, so sizes are full).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    units = unit_modules(model, resolved.auto_wrap_policy, resolved.transformer_cls_names_to_wrap,
                         resolved.min_num_params)
    report = wrap_report(model, units, resolved.wrap_report_tiny_unit_params)
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
    return model, report


def fsdp2_full_state_dict(module: nn.Module) -> Dict[str, Any]:
    """Unsharded weights of ``module`` (holding the FSDP2 root) on rank 0, on CPU (empty elsewhere); every
    rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fsdp2_clip_grad_norm(module: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm: the DTensor gradients' norm is reduced across shards by torch."""
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
