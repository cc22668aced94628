"""``full_params``: full, unsharded parameters of an FSDP1 or FSDP2 model (or a module inside one) in a block.

An FSDP1 root keeps the parameters no unit wraps (embeddings, final norm, head) in its own flat
parameter, so ``full_params`` on a submodule (the HF model inside the LightningModule) must unshard the
root: the strategy that wraps it records it with :func:`register_fsdp_root`. FSDP2 parameters are
DTensors, gathered and written back one by one.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor, distribute_tensor

_FSDP1_ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def register_fsdp_root(module: nn.Module) -> None:
    """Remember an FSDP1 root so ``full_params`` on a module inside it unshards the root's parameters too."""
    _FSDP1_ROOTS.add(module)


def _fsdp1_root_for(model: nn.Module) -> Optional[nn.Module]:
    if isinstance(model, FSDP):
        return model
    trainer = getattr(model, "_trainer", None)
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    if isinstance(wrapped, FSDP):
        return wrapped
    for root in list(_FSDP1_ROOTS):
        if any(m is model for m in root.modules()):
            return root
    if any(isinstance(m, FSDP) for m in model.modules()):
        return model
    return None


@contextmanager
def full_params(model: nn.Module, writeback: bool = False) -> Iterator[nn.Module]:
    """Show full, unsharded parameters of an FSDP1 or FSDP2 model (or a module inside one) in the block.

    ``with full_params(module.model): print(module.model.model.layers[0].self_attn.q_proj.weight.shape)``.
    Changes are copied back to the shards only with ``writeback=True``. Every rank must enter (it
    all-gathers); it is for inspecting and editing weights, not for running forward.
    """
    root = _fsdp1_root_for(model)
    if root is not None:
        with FSDP.summon_full_params(root, writeback=writeback, recurse=True):
            yield model
        return
    swapped: List[Tuple[nn.Module, str, DTensor]] = []
    full_of: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in full_of:  # tied weights stay tied
                    full_of[id(param)] = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
                module._parameters[name] = full_of[id(param)]
                swapped.append((module, name, param))
    try:
        yield model
    finally:
        done = set()
        for module, name, param in swapped:
            full = full_of[id(param)]
            if writeback and id(param) not in done:
                with torch.no_grad():
                    local = distribute_tensor(full.detach().to(param.device), param.device_mesh, param.placements,
                                              src_data_rank=None).to_local()
                    param.to_local().copy_(local)
                done.add(id(param))
            module._parameters[name] = param
