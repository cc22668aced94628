"""The step split: where each rank's step time went, in ms per step, from a trace analysis dict.

Per rank the six parts partition the step (they sum to ``step_ms``):

* ``compute_ms``: computation with no communication running under it;
* ``overlapped_ms``: computation with communication hidden under it (so compute time = the two together);
* ``exposed_transfer_ms``: communication moving data while nothing computes;
* ``exposed_wait_ms``: communication waiting for a peer (a slower rank) while nothing computes;
* ``input_wait_ms``: waiting on the data loader while nothing computes;
* ``idle_ms``: the rest of the wall time (host-side work, launch gaps): wall − the others, never negative.

``step_ms`` is the measured wall time per step, or the sum of the parts when rounding makes that larger, so
the shares always add up to 100 %. The overall split is the mean over ranks.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Mapping

from shardlight.errors import ShardlightError

PARTS = ("compute_ms", "overlapped_ms", "exposed_transfer_ms", "exposed_wait_ms", "input_wait_ms", "idle_ms")
SPLIT_KEYS = ("steps", "wall_us", "exposed_wait_us", "exposed_transfer_us", "input_us", "input_wait_us")


def _rank_split(rank: str, result: Mapping[str, Any]) -> Dict[str, float]:
    split = result.get("split")
    if not isinstance(split, Mapping):
        raise ShardlightError(
            f"trace analysis of rank {rank} has no step split (ranks[{rank}].split): it was made by a "
            "shardlight.trace without wait/transfer/input accounting; re-analyse the traces with this version"
        )
    missing = [key for key in SPLIT_KEYS if split.get(key) is None]
    if missing:
        raise ShardlightError(f"trace analysis of rank {rank}: split lacks {', '.join(missing)}")
    steps = int(split["steps"])
    if steps <= 0:
        raise ShardlightError(f"trace analysis of rank {rank}: no complete ProfilerStep was analysed")
    per_step_ms = 1e-3 / steps
    overlapped = float(result.get("overlap_us") or 0) * per_step_ms
    compute = max(0.0, float(result.get("compute_us") or 0) * per_step_ms - overlapped)
    parts = {
        "compute_ms": compute,
        "overlapped_ms": overlapped,
        "exposed_transfer_ms": max(0.0, float(split["exposed_transfer_us"]) * per_step_ms),
        "exposed_wait_ms": max(0.0, float(split["exposed_wait_us"]) * per_step_ms),
        "input_wait_ms": max(0.0, float(split["input_wait_us"]) * per_step_ms),
    }
    wall = float(split["wall_us"]) * per_step_ms
    parts["idle_ms"] = max(0.0, wall - sum(parts.values()))
    parts["step_ms"] = max(wall, sum(parts.values()))
    # Not parts of the partition, but what the straggler finding compares across ranks.
    parts["compute_total_ms"] = compute + overlapped
    parts["input_ms"] = float(split["input_us"]) * per_step_ms
    parts["steps"] = steps
    return parts


def split_by_rank(analysis: Mapping[str, Any]) -> Dict[int, Dict[str, float]]:
    """``{rank: split}`` of every rank in ``analysis["ranks"]`` (a clear error when the split is absent)."""
    ranks = analysis.get("ranks") if isinstance(analysis, Mapping) else None
    if not ranks:
        raise ShardlightError("trace analysis has no ranks")
    ordered = sorted(ranks.items(), key=lambda item: int(item[0]))
    return {int(rank): _rank_split(str(rank), result) for rank, result in ordered}


def overall_split(by_rank: Mapping[int, Mapping[str, float]]) -> Dict[str, float]:
    """The mean over ranks of every part (and of ``step_ms``): still a partition of the mean step."""
    keys = (*PARTS, "step_ms", "compute_total_ms", "input_ms")
    return {key: statistics.fmean(split[key] for split in by_rank.values()) for key in keys}


def shares(split: Mapping[str, float]) -> Dict[str, float]:
    """Each part as a percentage of the step: ``{"compute_pct": ..., ...}``, summing to 100."""
    step = split["step_ms"]
    return {part.replace("_ms", "_pct"): (100.0 * split[part] / step if step > 0 else 0.0) for part in PARTS}


def step_numbers(analysis: Mapping[str, Any]) -> Dict[int, List[int]]:
    """The ``ProfilerStep`` numbers each rank's analysis covers."""
    return {int(rank): sorted(int(s) for s in result.get("steps", {}) if str(s).isdigit())
            for rank, result in analysis.get("ranks", {}).items()}


def check_same_steps(analysis: Mapping[str, Any]) -> List[int]:
    """The steps every rank covers; a clear error when ranks analysed different ``ProfilerStep`` numbers."""
    numbers = step_numbers(analysis)
    distinct = {tuple(steps) for steps in numbers.values()}
    if len(distinct) > 1:
        shown = "; ".join(f"rank {r}: {steps or 'none'}" for r, steps in sorted(numbers.items()))
        raise ShardlightError(f"traces of different steps (ProfilerStep numbers disagree across ranks: {shown}); "
                              "diagnose one profiling window at a time")
    return list(next(iter(distinct), ()))
