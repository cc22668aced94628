"""NCCL (and RCCL) GPU traces: HTA 0.5.0's kernel rules and the collective in a kernel's name.

The kinds are HTA 0.5.0's rules verbatim (``hta.utils.utils.get_kernel_type``), so the numbers
match it:

* communication: ``re.match(r"^nccl.*Kernel", name)`` (``ncclKernel_*`` and ``ncclDevKernel_*``),
* memory: ``re.match(r"(^Memcpy)|(^Memset)|(^dma)", name)``,
* computation: not ``re.match(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)", name)``,
* anything else is "other" (e.g. ``Event Sync``).

The collective is read from the kernel name (``ncclKernel_AllReduce_RING_LL_Sum_float``,
``ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL``); RCCL's ``ncclDevKernel_Generic`` does not say,
so it is ``unknown``. RCCL traces match these rules too, so they are analysed here.
"""

from __future__ import annotations

import math
import re

from shardlight.trace.events import COMMUNICATION, COMPUTATION, MEMORY, OTHER, UNKNOWN_COLLECTIVE, comm_info
from shardlight.trace.records import as_int
from shardlight.trace.sizes import dtype_bytes, message_bytes
from shardlight.trace.sources.interface import DeviceSource, op_collective

_COMM_RE = re.compile(r"^nccl.*Kernel")
_MEMORY_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_COLLECTIVE_RE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")

# NCCL kernel-name token -> collective
_COLLECTIVES = {
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
    match = _COLLECTIVE_RE.match(name)
    if not match:
        return UNKNOWN_COLLECTIVE
    token = match.group(1)
    if token in _COLLECTIVES:
        return _COLLECTIVES[token]
    # Longest known prefix wins, for tokens like "AllGatherRing" in unseen naming schemes.
    for known in sorted(_COLLECTIVES, key=len, reverse=True):
        if token.startswith(known):
            return _COLLECTIVES[known]
    return UNKNOWN_COLLECTIVE


def _ranks(value) -> tuple[int, ...] | None:
    """``Process Group Ranks`` ("[0, 1]", as torch writes it) as a tuple of ints."""
    if isinstance(value, list):
        items = value
    elif isinstance(value, str):
        items = value.strip().strip("[]").split(",")
    else:
        return None
    ranks = tuple(as_int(item) for item in items if str(item).strip())
    return ranks if ranks and min(ranks) >= 0 else None


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def kernel_comm_info(collective: str, args: dict) -> dict:
    """The comm_info of an NCCL kernel from torch's record_param_comms args (Collective name, ...)."""
    kind = None
    if collective == UNKNOWN_COLLECTIVE:  # RCCL's Generic kernel: only the args say which it is
        kind = op_collective(str(args.get("Collective name", ""))) or None
    ranks = _ranks(args.get("Process Group Ranks"))
    size = as_int(args.get("Group size"), default=-1)
    group_size = size if size > 0 else (len(ranks) if ranks else None)
    element = dtype_bytes(args.get("dtype"))
    size_of = message_bytes(kind or collective, _number(args.get("In msg nelems")) * element,
                            _number(args.get("Out msg nelems")) * element, group_size)
    seq = as_int(args.get("Seq"), default=-1)
    group = args.get("Process Group Name")
    return comm_info(kind, size_of, None if group is None else str(group), ranks, group_size,
                     seq if seq >= 0 else None)


class NcclSource(DeviceSource):
    """Any trace with device rows: a GPU trace without NCCL kernels is all computation here, as in HTA."""

    name = "nccl"
    mode = "gpu"
    needs = "GPU kernels (events with args.stream)"

    def kernel_type(self, name: str) -> str:
        return kernel_type(name)

    def collective(self, name: str) -> str:
        return nccl_collective(name)

    def kernel_info(self, collective: str, args: dict) -> dict | None:
        return kernel_comm_info(collective, args)
