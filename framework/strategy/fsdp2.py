"""FSDP2 (``fully_shard``, DTensor) from a ``ResolvedFSDP``: ``apply_fsdp2`` shards a model in place, like
torchtitan's ``parallelize_llama`` (tensor parallelism, compile, activation checkpointing, then FSDP); also the
mesh it shards over and the full state dict and gradient clipping the Lightning adapter needs."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from shardlight.collectives import all_gather_objects
from shardlight.strategy.activation_checkpointing import checkpoint_blocks, compile_blocks
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


def _compile_and_checkpoint(model: nn.Module, units: List[nn.Module], resolved: ResolvedFSDP) -> List[nn.Module]:
    """``torch.compile`` on each block (``resolved.compile``), then activation checkpointing around the blocks
    it picks. Returns the units to shard: each unit that is a block replaced by its outermost wrapper (the
    module its parent now calls); other units (size-based) unchanged."""
    blocks = block_modules(model, resolved.transformer_cls_names_to_wrap)
    if resolved.compile:
        compile_blocks(blocks)
    wrappers = {}
    if resolved.activation_checkpointing:
        wrappers = checkpoint_blocks(model, blocks, mode=resolved.activation_checkpointing_mode,
                                     every=resolved.activation_checkpointing_every,
                                     offload=resolved.activation_checkpointing_offload)
    return [wrappers.get(id(u), u) for u in units]


def apply_fsdp2(model: nn.Module, resolved: ResolvedFSDP, mesh: Any) -> Tuple[nn.Module, Dict[str, Any]]:
    """Shard ``model`` (the HF model, the FSDP2 root) over ``mesh`` (``fsdp2_mesh``), in order: tensor
    parallelism over the mesh's ``tp`` dimension (with ``resolved.parallel``), ``torch.compile`` per block
    (``resolved.compile``), activation checkpointing around the blocks it picks, then ``fully_shard`` over the
    data-parallel dimensions on each unit innermost first, then on the root.

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
    if resolved.activation_checkpointing or resolved.compile:
        units = _compile_and_checkpoint(model, units, resolved)
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
