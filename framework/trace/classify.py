"""Which events are communication, computation or memory, and which collective they are.

GPU traces use HTA 0.5.0's kernel rules verbatim (``hta.utils.utils``), so the numbers match it:

* communication: ``re.match(r"^nccl.*Kernel", name)`` (``ncclKernel_*`` and ``ncclDevKernel_*``),
* memory: ``re.match(r"(^Memcpy)|(^Memset)|(^dma)", name)``,
* computation: not ``re.match(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)", name)``,
* anything else is "other" (e.g. ``Event Sync``).

The collective is read from the NCCL kernel name (``ncclKernel_AllReduce_RING_LL_Sum_float``,
``ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL``); RCCL's ``ncclDevKernel_Generic`` does not say,
so it is ``unknown``.

CPU traces from gloo runs have no kernels; see :mod:`shardlight.trace.metrics` for that rule.
Collective names from ``gloo:<op>`` annotations and ``c10d::<op>`` / ``FSDP::<op>`` ops are
normalised to the same snake_case names as the NCCL ones.
"""

from __future__ import annotations

import re

COMMUNICATION = "communication"
COMPUTATION = "computation"
MEMORY = "memory"
OTHER = "other"

_COMM_RE = re.compile(r"^nccl.*Kernel")
_MEMORY_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_NCCL_COLLECTIVE_RE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")

UNKNOWN_COLLECTIVE = "unknown"

# NCCL kernel-name token -> collective
_NCCL_COLLECTIVES = {
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "AllReduce": "all_reduce",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "SendRecv": "send_recv",
    "Send": "send_recv",
    "Recv": "send_recv",
    "AllToAll": "all_to_all",
    "AlltoAll": "all_to_all",
    "Generic": UNKNOWN_COLLECTIVE,
}

# c10d / gloo / FSDP op names (lower case, underscores stripped at both ends) -> collective
_CPU_COLLECTIVES = {
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "allgather_base": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "post_backward_reduce": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allreduce_sparse": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "recv_any_source": "send_recv",
    "barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
}


_kernel_type_cache: dict[str, str] = {}


def kernel_type(name: str) -> str:
    """HTA's ``get_kernel_type``: the first of communication, memory, computation that matches."""
    known = _kernel_type_cache.get(name)
    if known is None:
        if len(_kernel_type_cache) > 100_000:
            _kernel_type_cache.clear()
        known = _kernel_type_cache[name] = _kernel_type(name)
    return known


def _kernel_type(name: str) -> str:
    if _COMM_RE.match(name):
        return COMMUNICATION
    if _MEMORY_RE.match(name):
        return MEMORY
    if not _NOT_COMPUTE_RE.match(name):
        return COMPUTATION
    return OTHER


def nccl_collective(name: str) -> str:
    """The collective of an NCCL/RCCL kernel, or ``unknown`` when the name does not say."""
    match = _NCCL_COLLECTIVE_RE.match(name)
    if not match:
        return UNKNOWN_COLLECTIVE
    token = match.group(1)
    if token in _NCCL_COLLECTIVES:
        return _NCCL_COLLECTIVES[token]
    # Longest known prefix wins, for tokens like "AllGatherRing" in unseen naming schemes.
    for known in sorted(_NCCL_COLLECTIVES, key=len, reverse=True):
        if token.startswith(known):
            return _NCCL_COLLECTIVES[known]
    return UNKNOWN_COLLECTIVE


def cpu_collective(name: str) -> str | None:
    """The collective named by ``gloo:<op>``, ``c10d::<op>`` or ``FSDP::<op>``; None if it names none."""
    _, sep, op = name.partition(":")
    op = op.lstrip(":") if sep else name
    op = op.strip("_").lower()
    return _CPU_COLLECTIVES.get(op)


def gloo_work_matches(gloo_collective: str, issued_collective: str) -> bool:
    """Whether a gloo work item can be the one a c10d/FSDP op issued.

    gloo runs reduce-scatter as an all-reduce (its annotation says ``gloo:all_reduce``), so an
    all_reduce work item may belong to a reduce_scatter call.
    """
    if gloo_collective == issued_collective:
        return True
    return gloo_collective == "all_reduce" and issued_collective == "reduce_scatter"
