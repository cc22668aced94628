"""The kinds of events and the NCCL kernel-name rules, under their historical import path.

Scripts outside the package (``benchmarks/gpu_check.sh``) classify kernels with
``shardlight.trace.classify.kernel_type`` / ``nccl_collective``. The rules live with their
backend in :mod:`shardlight.trace.sources.nccl`, the kinds in :mod:`shardlight.trace.events`.
"""

from shardlight.trace.events import COMMUNICATION, COMPUTATION, MEMORY, OTHER, UNKNOWN_COLLECTIVE
from shardlight.trace.sources.nccl import kernel_type, nccl_collective

__all__ = ["COMMUNICATION", "COMPUTATION", "MEMORY", "OTHER", "UNKNOWN_COLLECTIVE", "kernel_type", "nccl_collective"]
