"""The comm window's metrics, from the trace analysis: per rank (``window_metrics``, ms per analysed step), the
cross-rank wait/transfer/input split (``split_metrics``) and bus bandwidth (``bandwidth_metrics``). The names
are the ``comm/*``, ``step/*`` and ``input/*`` keys ``CommTimeCallback`` logs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from shardlight.trace.metrics import mesh_role

COLLECTIVE_KEYS = {"all_gather": "comm/all_gather_ms", "reduce_scatter": "comm/reduce_scatter_ms",
                   "all_reduce": "comm/all_reduce_ms"}
METRIC_KEYS = ("comm/all_gather_ms", "comm/reduce_scatter_ms", "comm/all_reduce_ms", "comm/total_ms",
               "comm/exposed_ms", "comm/overlap_pct", "comm/compute_ms", "comm/ratio", "step/time_ms",
               "comm/wait_ms", "comm/transfer_ms", "comm/exposed_wait_ms", "comm/exposed_transfer_ms", "input/wait_ms")
# The trace split's keys (microseconds over the analysed steps) -> the per-step metric
SPLIT_KEYS = {"wait_us": "comm/wait_ms", "transfer_us": "comm/transfer_ms", "exposed_wait_us": "comm/exposed_wait_ms",
              "exposed_transfer_us": "comm/exposed_transfer_ms", "input_wait_us": "input/wait_ms"}


def window_metrics(result: Dict[str, Any], step_seconds: Dict[int, float],
                   tp_size: Optional[int] = None) -> Dict[str, float]:
    """Per-step metrics (ms per step) of one rank's analysed window.

    ``result`` is ``analyze_trace_file``'s dict; totals are divided by the number of profiler steps it
    analysed. ``step_seconds`` maps a ``ProfilerStep`` number to its wall time. With tensor parallelism
    (``tp_size`` > 1) and a trace that names each collective's process group, also ``comm/tp/<collective>_ms``
    and ``comm/fsdp/<collective>_ms`` (and ``comm/<role>/exposed_ms``), by the group's ranks.
    """
    steps = [s for s in result.get("steps", {}) if s.isdigit()]
    count = max(1, len(steps))
    per_step_ms = 1e-3 / count
    metrics = {key: 0.0 for key in COLLECTIVE_KEYS.values()}
    for collective, values in result.get("by_collective", {}).items():
        key = COLLECTIVE_KEYS.get(collective)
        if key:
            metrics[key] = values["comm_us"] * per_step_ms
    metrics["comm/total_ms"] = result["comm_us"] * per_step_ms
    metrics["comm/exposed_ms"] = result["exposed_comm_us"] * per_step_ms
    metrics["comm/overlap_pct"] = float(result["overlap_pct"])
    metrics["comm/compute_ms"] = result["compute_us"] * per_step_ms
    if result.get("comm_to_compute") is not None:
        metrics["comm/ratio"] = float(result["comm_to_compute"])
    walls = [step_seconds[int(s)] for s in steps if int(s) in step_seconds]
    if walls:
        metrics["step/time_ms"] = 1e3 * sum(walls) / len(walls)
    metrics["comm/window_steps"] = float(len(steps))
    if tp_size and tp_size > 1:
        metrics.update(group_metrics(result, tp_size, per_step_ms))
    return metrics


def group_metrics(result: Dict[str, Any], tp_size: int, per_step_ms: float) -> Dict[str, float]:
    """``comm/<tp|fsdp>/<collective>_ms`` and ``comm/<tp|fsdp>/exposed_ms`` from ``result["by_group"]``."""
    metrics: Dict[str, float] = {}
    world = result.get("world_size")
    for group in (result.get("by_group") or {}).values():
        role = mesh_role(group.get("ranks"), tp_size, world)
        if role is None:
            continue
        for collective, values in group["by_collective"].items():
            for key, us in ((f"comm/{role}/{collective}_ms", values["comm_us"]),
                            (f"comm/{role}/exposed_ms", values["exposed_comm_us"])):
                metrics[key] = metrics.get(key, 0.0) + float(us or 0) * per_step_ms
    return metrics


def group_metric_keys(per_rank: List[Optional[Dict[str, float]]]) -> List[str]:
    """The per-process-group keys any rank reported (they depend on the mesh and the trace)."""
    return sorted({key for m in per_rank if m for key in m if key.startswith(("comm/tp/", "comm/fsdp/"))})


def split_metrics(rank_result: Dict[str, Any]) -> Dict[str, float]:
    """Per-step wait/transfer/input metrics (ms) of one rank of a combined analysis (``shardlight.trace.combine``)."""
    split = rank_result.get("split") or {}
    steps = max(1, int(split.get("steps") or 0))
    return {key: split[us] * 1e-3 / steps for us, key in SPLIT_KEYS.items() if split.get(us) is not None}


def bandwidth_metrics(summary: Dict[str, Any]) -> Dict[str, float]:
    """``comm/<collective>_busbw_gbps`` of a combined analysis's summary."""
    return {f"comm/{kind}_busbw_gbps": values["busbw_gbps"]
            for kind, values in (summary.get("bandwidth") or {}).items() if values.get("busbw_gbps") is not None}
