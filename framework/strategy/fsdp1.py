"""FSDP1 (``FullyShardedDataParallel``) from a ``ResolvedFSDP``: ``apply_fsdp1`` wraps a model, and the
pieces the Lightning adapter needs around it (the wrapper arguments for ``enable_wrap``, the mesh, full
state dicts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from shardlight.strategy.activation_checkpointing import checkpoint_blocks, compile_blocks
from shardlight.strategy.options import ResolvedFSDP
from shardlight.strategy.sharded_load import has_meta_parameters, meta_param_init
from shardlight.strategy.unshard import register_fsdp_root
from shardlight.strategy.wrapping import find_block_classes, unit_modules, wrap_report


def fsdp1_mixed_precision(resolved: ResolvedFSDP):
    """``MixedPrecision`` with parameters, gradient reduction and buffers all in the resolved dtype, or None
    when the recipe sets none (Lightning's precision plugin then decides, as for ``*-true``)."""
    from torch.distributed.fsdp import MixedPrecision

    dtype = resolved.param_dtype
    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype) if dtype else None


def fsdp1_mesh(resolved: ResolvedFSDP, device_type: str):
    """The (replicate, shard) mesh for hybrid sharding, on ``device_type``; None for the other strategies."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, resolved.mesh_shape) if resolved.mesh_shape is not None else None


def fsdp1_kwargs(resolved: ResolvedFSDP, device: torch.device, mixed_precision: Any) -> Dict[str, Any]:
    """The arguments every FSDP1 wrapper of the run takes alike (the root and any ``enable_wrap`` wrap)."""
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy

    return {
        "sharding_strategy": ShardingStrategy[resolved.sharding_strategy],
        "cpu_offload": CPUOffload(offload_params=resolved.cpu_offload),
        "mixed_precision": mixed_precision,
        # FSDP1 refuses device_id=None on a CPU-only host; the device itself is accepted on both.
        "device_id": device if device.type == "cpu" else device.index,
        "forward_prefetch": resolved.forward_prefetch,
        "limit_all_gathers": resolved.limit_all_gathers,
        "use_orig_params": resolved.use_orig_params,
        "sync_module_states": resolved.sync_module_states,
        "backward_prefetch": BackwardPrefetch[resolved.backward_prefetch] if resolved.backward_prefetch else None,
    }


def apply_fsdp1(model: nn.Module, resolved: ResolvedFSDP, device: torch.device, *, mesh: Any = None,
                mixed_precision: Any = None, weights: Optional[Path] = None,
                weights_prefix: str = "") -> Tuple[nn.Module, Dict[str, Any]]:
    """Wrap ``model`` in FSDP1 (its blocks compiled first with ``resolved.compile``), then checkpoint
    activations of the blocks ``resolved`` picks (after wrapping, as Lightning does).

    ``mesh``: from ``fsdp1_mesh``; ``mixed_precision``: a ``MixedPrecision`` (or None); ``weights``: the
    safetensors checkpoint a skeleton ``model`` (meta parameters) is read from as it is wrapped, the HF model
    at ``weights_prefix`` in it. Returns the root wrapper (registered for ``unshard.full_params``) and the
    wrap report (computed before wrapping, so unit sizes are full).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = unit_modules(model, resolved.auto_wrap_policy, resolved.transformer_cls_names_to_wrap,
                         resolved.min_num_params)
    report = wrap_report(model, units, resolved.wrap_report_tiny_unit_params)
    kwargs = fsdp1_kwargs(resolved, device, mixed_precision)
    if units:
        # Exactly the units the report describes (and FSDP2 shards), not torch's policies' own pick.
        unit_ids = {id(u) for u in units}
        kwargs["auto_wrap_policy"] = lambda module, recurse, nonwrapped_numel: (
            True if recurse else id(module) in unit_ids
        )
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    if has_meta_parameters(model):
        # A skeleton for a sharded load: FSDP gives each unit's parameters storage (and their weights) as it
        # wraps them, then shards the unit before the next.
        kwargs["param_init_fn"] = meta_param_init(device, model, weights, weights_prefix)
    classes: tuple = ()
    if resolved.activation_checkpointing or resolved.compile:
        # Looked up before wrapping, so a bad class name fails before FSDP touches the model.
        classes = tuple(find_block_classes(model, resolved.transformer_cls_names_to_wrap))
    if resolved.compile:
        # Each block compiled in place before FSDP wraps it: FSDP's unshard/reshard stay outside the graph.
        compile_blocks([m for m in model.modules() if isinstance(m, classes)])
    wrapped = FullyShardedDataParallel(module=model, **kwargs)
    if resolved.activation_checkpointing:
        # Around each block inside its FSDP unit (after wrapping, as Lightning does).
        checkpoint_blocks(wrapped, [m for m in wrapped.modules() if isinstance(m, classes)],
                          mode=resolved.activation_checkpointing_mode, every=resolved.activation_checkpointing_every,
                          offload=resolved.activation_checkpointing_offload)
    # full_params on a module inside (the HF model) must unshard the root's own parameters too.
    register_fsdp_root(wrapped)
    return wrapped, report


def fsdp1_full_state_dict(root: nn.Module, device: torch.device) -> Dict[str, Any]:
    """Unsharded weights of the FSDP1 ``root`` on rank 0 (empty elsewhere); every rank must call it."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # offload_to_cpu on a CPU rank frees the storage it "copied" from: a segfault, not a copy.
    config = FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=True)
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
        return root.state_dict()
