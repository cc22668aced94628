"""The numbers every verdict reads, gathered once from the analysis and the optional inputs.

Inputs are plain data (no planner, no callbacks): ``memory`` is ``{rank: {"headroom_bytes", "capacity_bytes",
"peak_bytes", "params_bytes", "grads_bytes", "optim_bytes"}}`` (any may be missing), ``throughput`` is
``{"tokens_per_sec_per_device", "scaling_efficiency"}``, ``wrap`` the wrap report
(``shardlight.strategy.wrapping.wrap_report``), ``alternatives`` the planner's rows for this recipe
(``shardlight.planner.alternatives``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from shardlight.recipe.instrument_sections import DiagnosisConfig
from shardlight.trace.metrics import mesh_role

GB = 1e9
# Below this many parameters per unit, per-collective latency dominates (the wrap report's default too).
TINY_UNIT_PARAMS = 1_000_000
MAX_BATCH_FACTOR = 8


@dataclass
class Straggler:
    """The rank everybody waits for and how its compute and input compare with the other ranks' median."""

    rank: int
    wait_ms: float
    median_wait_ms: float
    compute_ms: float
    median_compute_ms: float
    input_ms: float
    median_input_ms: float
    compute_slower_pct: float
    input_slower_pct: float
    cause: Optional[str]  # "compute", "input" or None: neither is slower than the median by straggler_pct


@dataclass
class Fullest:
    """The rank with the least free memory."""

    rank: int
    headroom_bytes: float
    capacity_bytes: Optional[float]
    peak_bytes: Optional[float]

    @property
    def headroom_pct(self) -> Optional[float]:
        return 100.0 * self.headroom_bytes / self.capacity_bytes if self.capacity_bytes else None


@dataclass
class Facts:
    split: Dict[str, float]
    by_rank: Dict[int, Dict[str, float]]
    shares: Dict[str, float]
    config: DiagnosisConfig
    memory: Dict[int, Dict[str, float]] = field(default_factory=dict)
    throughput: Optional[Dict[str, Any]] = None
    wrap: Optional[Dict[str, Any]] = None
    alternatives: List[Dict[str, Any]] = field(default_factory=list)
    micro_batch_size: Optional[int] = None
    collectives: Dict[str, Dict[str, float]] = field(default_factory=dict)
    bandwidth: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    straggler: Optional[Straggler] = None
    fullest: Optional[Fullest] = None
    missing_ranks: List[int] = field(default_factory=list)
    tp_exposed_ms: Optional[float] = None      # exposed TP communication per step (None: no TP, or no groups)

    @property
    def straggler_wait_pct(self) -> Optional[float]:
        """% of the step the ranks wait for the straggler: their mean exposed wait less what the straggler itself
        waits. Waiting that every rank does alike -- the ranks arriving at each collective in a different order
        step by step (timing jitter, a shared host's scheduling) -- is nobody's doing: with two ranks that wait
        40 and 58 ms a step, 9 ms of the mean 49 is waiting for rank 0. A rank that makes the others wait and
        waits for nobody itself keeps the whole wait."""
        s = self.straggler
        step = self.split.get("step_ms") or 0.0
        if s is None or step <= 0:
            return None
        return max(0.0, 100.0 * (self.split["exposed_wait_ms"] - s.wait_ms) / step)

    @property
    def dominant_collective(self) -> Optional[str]:
        exposed = {name: c["exposed_ms"] for name, c in self.collectives.items() if c["exposed_ms"] > 0}
        return max(exposed, key=exposed.get) if exposed else None

    def dominant_collective_pct(self) -> Optional[float]:
        name = self.dominant_collective
        total = sum(c["exposed_ms"] for c in self.collectives.values())
        return 100.0 * self.collectives[name]["exposed_ms"] / total if name and total > 0 else None

    def batch_factor(self) -> Optional[int]:
        """How many times the micro-batch the fullest rank's headroom allows (activations scale with it),
        keeping ``min_headroom_pct`` free; None without the memory numbers."""
        if self.fullest is None or not self.fullest.capacity_bytes:
            return None
        mem = self.memory.get(self.fullest.rank, {})
        state = sum(mem.get(k) or 0 for k in ("params_bytes", "grads_bytes", "optim_bytes"))
        activations = (mem.get("peak_bytes") or 0) - state
        if activations <= 0:
            return None
        spare = self.fullest.headroom_bytes - self.config.min_headroom_pct / 100 * self.fullest.capacity_bytes
        return max(1, min(MAX_BATCH_FACTOR, math.floor(1 + spare / activations)))

    def current_alternative(self) -> Optional[Dict[str, Any]]:
        return next((a for a in self.alternatives if a.get("current")), None)


def normalize_memory(memory: Optional[Mapping[Any, Mapping[str, Any]]]) -> Dict[int, Dict[str, float]]:
    return {int(rank): {k: float(v) for k, v in values.items() if v is not None}
            for rank, values in (memory or {}).items() if values}


def fullest_rank(memory: Mapping[int, Mapping[str, float]]) -> Optional[Fullest]:
    """The least headroom, ties broken by the highest peak (as the memory callback's ``fullest_rank``)."""
    ranked = [(m["headroom_bytes"], -(m.get("peak_bytes") or 0), r) for r, m in memory.items() if "headroom_bytes" in m]
    if not ranked:
        return None
    headroom, _, rank = min(ranked)
    return Fullest(rank, headroom, memory[rank].get("capacity_bytes"), memory[rank].get("peak_bytes"))


def _slower_pct(value: float, median: float) -> float:
    return 100.0 * (value - median) / median if median > 0 else (math.inf if value > 0 else 0.0)


def find_straggler(by_rank: Mapping[int, Mapping[str, float]], straggler_pct: float) -> Optional[Straggler]:
    """The rank that waits least (the others wait for it), ties broken by the most compute + input."""
    if len(by_rank) < 2:
        return None
    rank = min(by_rank, key=lambda r: (by_rank[r]["exposed_wait_ms"],
                                       -(by_rank[r]["compute_total_ms"] + by_rank[r]["input_ms"])))
    others = [s for r, s in by_rank.items() if r != rank]
    mine = by_rank[rank]
    med = {key: statistics.median(s[key] for s in others) for key in ("exposed_wait_ms", "compute_total_ms",
                                                                       "input_ms")}
    compute_pct = _slower_pct(mine["compute_total_ms"], med["compute_total_ms"])
    input_pct = _slower_pct(mine["input_ms"], med["input_ms"])
    excess = {"compute": mine["compute_total_ms"] - med["compute_total_ms"],
              "input": mine["input_ms"] - med["input_ms"]}
    slow = [c for c, pct in (("compute", compute_pct), ("input", input_pct)) if pct >= straggler_pct and excess[c] > 0]
    cause = max(slow, key=excess.get) if slow else None
    return Straggler(rank, mine["exposed_wait_ms"], med["exposed_wait_ms"], mine["compute_total_ms"],
                     med["compute_total_ms"], mine["input_ms"], med["input_ms"], compute_pct, input_pct, cause)


def collectives_per_step(analysis: Mapping[str, Any], by_rank: Mapping[int, Mapping[str, float]]) -> Dict[str, Dict]:
    """Per collective, mean over ranks per step: exposed ms, communication ms and count."""
    totals: Dict[str, Dict[str, float]] = {}
    for rank, result in analysis["ranks"].items():
        steps = by_rank[int(rank)]["steps"]
        for name, values in (result.get("by_collective") or {}).items():
            entry = totals.setdefault(name, {"exposed_ms": 0.0, "comm_ms": 0.0, "count": 0.0})
            entry["exposed_ms"] += float(values.get("exposed_comm_us") or 0) * 1e-3 / steps
            entry["comm_ms"] += float(values.get("comm_us") or 0) * 1e-3 / steps
            entry["count"] += float(values.get("count") or 0) / steps
    n = max(1, len(analysis["ranks"]))
    return {name: {k: v / n for k, v in entry.items()} for name, entry in totals.items()}


def tp_exposed_per_step(analysis: Mapping[str, Any], by_rank: Mapping[int, Mapping[str, float]],
                        wrap: Optional[Mapping[str, Any]]) -> Optional[float]:
    """Mean over ranks of the exposed communication per step in tensor-parallel process groups, told apart by
    their ranks on the wrap report's mesh; None without TP or when the traces name no groups (gloo)."""
    tp = ((wrap or {}).get("mesh") or {}).get("tp") or 1
    if tp <= 1:
        return None
    totals = []
    for rank, result in analysis["ranks"].items():
        groups = result.get("by_group")
        if not groups:
            continue
        world = result.get("world_size")
        tp_groups = [g for g in groups.values() if mesh_role(g.get("ranks"), tp, world) == "tp"]
        exposed = sum(float(v.get("exposed_comm_us") or 0) for g in tp_groups for v in g["by_collective"].values())
        totals.append(exposed * 1e-3 / by_rank[int(rank)]["steps"])
    return sum(totals) / len(totals) if totals else None


def gather_facts(analysis: Mapping[str, Any], by_rank: Dict[int, Dict[str, float]], split: Dict[str, float],
                 shares: Dict[str, float], *, config: DiagnosisConfig, memory: Optional[Mapping] = None,
                 throughput: Optional[Mapping[str, Any]] = None, wrap: Optional[Mapping[str, Any]] = None,
                 alternatives: Optional[Sequence[Mapping[str, Any]]] = None, micro_batch_size: Optional[int] = None,
                 missing_ranks: Sequence[int] = ()) -> Facts:
    summary = analysis.get("summary") or {}
    mem = normalize_memory(memory)
    return Facts(
        split=split, by_rank=by_rank, shares=shares, config=config, memory=mem,
        throughput=dict(throughput) if throughput else None, wrap=dict(wrap) if wrap else None,
        alternatives=[dict(a) for a in alternatives or []], micro_batch_size=micro_batch_size,
        collectives=collectives_per_step(analysis, by_rank), bandwidth=dict(summary.get("bandwidth") or {}),
        straggler=find_straggler(by_rank, config.straggler_pct), fullest=fullest_rank(mem),
        missing_ranks=sorted(int(r) for r in missing_ranks),
        tp_exposed_ms=tp_exposed_per_step(analysis, by_rank, wrap),
    )
