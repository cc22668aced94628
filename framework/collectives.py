"""Small picklable values across ranks, the one place for it: callbacks, checkpoints and the FSDP wrap report
all gather a few Python objects (never tensors) this way. Each function is a collective: every rank calls it;
without an initialized process group it returns this process's value alone."""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_gather_objects(obj: Any, group: Optional[Any] = None) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank (of ``group``, by default the world)."""
    if not dist_ready() or dist.get_world_size(group) == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects_to_zero(obj: Any) -> List[Any]:
    """Every rank's ``obj`` in rank order on rank 0 (elsewhere: an empty list): for what only rank 0 reads, so
    that the others do not unpickle every rank's copy."""
    if not dist_ready() or dist.get_world_size() == 1:
        return [obj]
    is_zero = dist.get_rank() == 0
    out: Optional[List[Any]] = [None] * dist.get_world_size() if is_zero else None
    dist.gather_object(obj, out, dst=0)
    return out if is_zero else []
