"""The verdict table and ``diagnose``. The table: one row per verdict, what share it reads, which
``DiagnosisConfig`` threshold decides it, and how its evidence, its one-line lead and its actions are built. A new
verdict is one row and its builders. ``diagnose``: a trace analysis (and what else is known of the run) → one
``Diagnosis``: the primary verdict is the firing rule with the largest share; memory-bound does not compete on
share and is listed as secondary when a time finding fires; compute-bound when nothing fires.

Shares are % of the step (memory-bound: free memory, % of capacity, firing *below* its threshold).
``competes=False`` (memory-bound): never outranks a time finding; it is primary only when no other fires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from shardlight.diagnosis.facts import GB, TINY_UNIT_PARAMS, Facts, gather_facts
from shardlight.diagnosis.result import Action, Diagnosis
from shardlight.diagnosis.step_split import overall_split, shares, split_by_rank
from shardlight.recipe.instrument_sections import DiagnosisConfig


@dataclass(frozen=True)
class Rule:
    verdict: str
    share: Callable[[Facts], Optional[float]]
    threshold_key: Optional[str]               # a DiagnosisConfig field; None: the fallback verdict
    evidence: Callable[[Facts], Dict[str, Any]]
    lead: Callable[[Facts], str]
    actions: Callable[[Facts], List[Action]]
    fires_below: bool = False
    competes: bool = True

    def threshold(self, facts: Facts) -> Optional[float]:
        return None if self.threshold_key is None else float(getattr(facts.config, self.threshold_key))

    def fires(self, facts: Facts) -> bool:
        value, limit = self.share(facts), self.threshold(facts)
        if value is None or limit is None:
            return False
        return value < limit if self.fires_below else value > limit


def _ms(value: float) -> str:
    return f"{value:.1f} ms"


def _minus(ms: float) -> str:
    return f"about −{abs(ms):.1f} ms"


def _params(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _common(facts: Facts, part: str, rule_key: str) -> Dict[str, Any]:
    return {"step_ms": facts.split["step_ms"], f"{part}_ms": facts.split[f"{part}_ms"],
            f"{part}_pct": facts.shares[f"{part}_pct"], "threshold_pct": getattr(facts.config, rule_key),
            "ranks": len(facts.by_rank)}


# --- alternatives (planner rows as plain data) ----------------------------------------------------------------
def _alternative_actions(facts: Facts, ms_at_stake: float, what_ms: str) -> List[Action]:
    """Fitting planner alternatives that cut communication, costed on the measured ``ms_at_stake``."""
    actions = []
    for alt in facts.alternatives:
        change = alt.get("comm_change_fraction")
        if alt.get("current") or not alt.get("fits") or change is None or change >= 0:
            continue
        saved = ms_at_stake * min(1.0, -change)
        headroom = alt.get("headroom_bytes")
        room = f" (plan: {headroom / GB:.1f} GB headroom)" if headroom is not None else ""
        actions.append(Action(f"{alt['label']} fits{room} and {alt['what']}",
                              f"{_minus(saved)} of {what_ms} per step", saved, change=alt.get("override")))
    return actions


# --- communication-bound --------------------------------------------------------------------------------------
def _comm_evidence(facts: Facts) -> Dict[str, Any]:
    evidence = _common(facts, "exposed_transfer", "exposed_transfer_pct")
    if facts.tp_exposed_ms is not None:
        evidence["tp_exposed_ms"] = facts.tp_exposed_ms
    evidence.update(dominant_collective=facts.dominant_collective,
                    dominant_collective_pct=facts.dominant_collective_pct(),
                    collectives_per_step=sum(c["count"] for c in facts.collectives.values()))
    for kind, values in facts.bandwidth.items():
        if values.get("busbw_gbps") is not None:
            evidence[f"{kind}_busbw_gbps"] = values["busbw_gbps"]
    return evidence


def _comm_lead(facts: Facts) -> str:
    name, pct = facts.dominant_collective, facts.dominant_collective_pct()
    of_it = f" ({name.replace('_', '-')} {pct:.0f}% of it)" if name and pct is not None else ""
    return (f"exposed transfer {facts.shares['exposed_transfer_pct']:.0f}% of step{of_it}, "
            f"wait {facts.shares['exposed_wait_pct']:.0f}%")


def _batch_action(facts: Facts, why: str, ms_at_stake: Optional[float]) -> List[Action]:
    factor, mbs = facts.batch_factor(), facts.micro_batch_size
    if factor is None:
        return [Action(f"raise trainer.micro_batch_size if memory allows: {why}",
                       "not costed: no memory numbers for this run")] if facts.fullest is None else []
    if factor < 2:
        return []
    now = f" from {mbs} to {mbs * factor}" if mbs else ""
    saved = None if ms_at_stake is None else ms_at_stake * (1 - 1 / factor)
    effect = (f"the same gathers serve {factor}× the samples: {_minus(saved)} of exposed transfer per "
              f"today's step worth of samples" if saved is not None else f"{factor}× the work per launch")
    change = f"trainer.micro_batch_size={mbs * factor}" if mbs else None
    return [Action(f"raise trainer.micro_batch_size{now} (headroom allows about {factor}×): {why}", effect, saved,
                   change=change)]


def _wrap_actions(facts: Facts) -> List[Action]:
    wrap = facts.wrap or {}
    per_step = sum(c["count"] for c in facts.collectives.values())
    if wrap.get("units") == 1:
        return [Action("a single FSDP unit: wrap transformer blocks (fsdp.auto_wrap_policy: TRANSFORMER_BASED_WRAP)",
                       "per-block gathers overlap the previous block's compute instead of one exposed gather",
                       change="fsdp.auto_wrap_policy=TRANSFORMER_BASED_WRAP")]
    median = (wrap.get("params_per_unit") or {}).get("median")
    if median is not None and 0 < median < TINY_UNIT_PARAMS:
        return [Action(f"units are tiny (median {_params(median)} params): coarser wrapping "
                       "(larger blocks, or SIZE_BASED_WRAP with a higher fsdp.min_num_params)",
                       f"fewer than today's {per_step:.0f} collectives per step, each paying its latency")]
    return []


def _link_actions(facts: Facts) -> List[Action]:
    peak, name = facts.config.link_peak_gbps, facts.dominant_collective
    measured = (facts.bandwidth.get(name or "") or {}).get("busbw_gbps")
    if not peak or measured is None or measured >= 0.5 * peak:
        return []
    saved = facts.split["exposed_transfer_ms"] * (1 - measured / peak)
    return [Action(f"{name.replace('_', '-')} reaches {measured:.1f} GB/s of the {peak:g} GB/s link: check the "
                   "interconnect and NCCL settings (NCCL_* in launch.env)",
                   f"{_minus(saved)} of exposed transfer per step at the link's peak", saved)]


def _tp_actions(facts: Facts) -> List[Action]:
    """Exposed tensor-parallel collectives (all-reduces every layer, on the critical path by design): a smaller
    TP degree, or TP kept on the fast intra-node links."""
    exposed, tp = facts.tp_exposed_ms, ((facts.wrap or {}).get("mesh") or {}).get("tp")
    if not exposed or exposed <= 0 or not tp:
        return []
    step = facts.split["step_ms"]
    share = f" ({100.0 * exposed / step:.0f}% of the step)" if step else ""
    return [Action(f"tensor-parallel communication is {_ms(exposed)} exposed per step{share}: lower "
                   f"parallelism.tp_size (now {tp}) and shard more with FSDP instead, and keep TP inside a node "
                   "(tp_size <= trainer.devices)",
                   f"up to {_minus(exposed)} of exposed TP communication per step", exposed,
                   change=f"parallelism.tp_size={tp // 2}" if tp >= 2 else None)]


def _comm_actions(facts: Facts) -> List[Action]:
    transfer = facts.split["exposed_transfer_ms"]
    return (_alternative_actions(facts, transfer, "exposed transfer") + _tp_actions(facts)
            + _batch_action(facts, "more compute per gather", transfer) + _link_actions(facts) + _wrap_actions(facts))


# --- straggler-bound ------------------------------------------------------------------------------------------
def _straggler_evidence(facts: Facts) -> Dict[str, Any]:
    evidence = _common(facts, "exposed_wait", "exposed_wait_pct")
    s = facts.straggler
    if s is not None:
        evidence["straggler_wait_pct"] = facts.straggler_wait_pct
        evidence.update(straggler_rank=s.rank, straggler_wait_ms=s.wait_ms, median_wait_ms=s.median_wait_ms,
                        straggler_compute_ms=s.compute_ms, median_compute_ms=s.median_compute_ms,
                        compute_slower_pct=s.compute_slower_pct, straggler_input_ms=s.input_ms,
                        median_input_ms=s.median_input_ms, input_slower_pct=s.input_slower_pct, cause=s.cause)
    return evidence


def _straggler_lead(facts: Facts) -> str:
    s = facts.straggler
    who = ""
    if s is not None:
        slower = {"compute": s.compute_slower_pct, "input": s.input_slower_pct}.get(s.cause or "")
        who = (f" (everyone waits for rank {s.rank}: its {s.cause} is {slower:.0f}% slower)" if s.cause
               else f" (everyone waits for rank {s.rank})")
    share = facts.straggler_wait_pct
    wait = facts.shares["exposed_wait_pct"] if share is None else share
    return f"exposed wait {wait:.0f}% of step{who}, transfer {facts.shares['exposed_transfer_pct']:.0f}%"


def _straggler_actions(facts: Facts) -> List[Action]:
    s = facts.straggler
    if s is None:
        return []
    wait = max(0.0, facts.split["exposed_wait_ms"] - s.wait_ms)  # the wait for this rank, not everyone's jitter
    if s.cause == "compute":
        excess = min(wait, s.compute_ms - s.median_compute_ms)
        return [Action(f"rank {s.rank}'s compute is {s.compute_slower_pct:.0f}% slower than the median: check that "
                       "device (clocks, thermals, other jobs) or its data shard (longer sequences)",
                       f"{_minus(excess)} of exposed wait per step if it ran at the median", excess)]
    if s.cause == "input":
        excess = min(wait, s.input_ms - s.median_input_ms)
        return [Action(f"rank {s.rank}'s input is {s.input_slower_pct:.0f}% slower than the median: raise "
                       "data.num_workers or check its data shard and storage",
                       f"{_minus(excess)} of exposed wait per step if it loaded at the median", excess)]
    return [Action(f"rank {s.rank} is the one the others wait for, yet neither its compute nor its input is "
                   f"{facts.config.straggler_pct:g}% slower than the median: check its host (CPU load, NUMA) "
                   "and network path", f"up to −{wait:.1f} ms of exposed wait per step")]


# --- input-bound ----------------------------------------------------------------------------------------------
def _input_evidence(facts: Facts) -> Dict[str, Any]:
    evidence = _common(facts, "input_wait", "input_wait_pct")
    worst = max(facts.by_rank, key=lambda r: facts.by_rank[r]["input_wait_ms"])
    evidence.update(input_ms=facts.split["input_ms"], worst_input_rank=worst,
                    worst_input_wait_ms=facts.by_rank[worst]["input_wait_ms"])
    return evidence


def _input_lead(facts: Facts) -> str:
    return (f"input wait {facts.shares['input_wait_pct']:.0f}% of step, "
            f"transfer {facts.shares['exposed_transfer_pct']:.0f}%, wait {facts.shares['exposed_wait_pct']:.0f}%")


def _input_actions(facts: Facts) -> List[Action]:
    wait = facts.split["input_wait_ms"]
    return [Action("raise data.num_workers / pin memory: batches are prepared while the step runs",
                   f"up to −{wait:.1f} ms of input wait per step", wait),
            Action("tokenize and pack the data once (data.packing) so workers only slice tensors",
                   "cheaper batches: less work per worker")]


# --- host-bound -----------------------------------------------------------------------------------------------
def _host_evidence(facts: Facts) -> Dict[str, Any]:
    return _common(facts, "idle", "host_idle_pct")


def _host_lead(facts: Facts) -> str:
    return (f"device idle {facts.shares['idle_pct']:.0f}% of step without communication or input, "
            f"transfer {facts.shares['exposed_transfer_pct']:.0f}%")


def _host_actions(facts: Facts) -> List[Action]:
    idle = facts.split["idle_ms"]
    return [Action("cut host overhead between kernels: larger micro-batches, fewer per-step callbacks and logs "
                   "(raise trainer.log_every_n_steps)", f"up to −{idle:.1f} ms per step", idle),
            _compile_action("fewer, fused kernels per block: less host work between them"),
            Action("check the host's CPU load: other processes, or too many threads per rank (trainer.num_threads)",
                   "steadier launches")] + _batch_action(facts, "more device work per host step", None)


# --- memory-bound ---------------------------------------------------------------------------------------------
def _headroom_pct(facts: Facts) -> Optional[float]:
    return None if facts.fullest is None else facts.fullest.headroom_pct


def _memory_evidence(facts: Facts) -> Dict[str, Any]:
    f = facts.fullest
    if f is None:
        return {}
    return {"min_headroom_gb": f.headroom_bytes / GB, "min_headroom_rank": f.rank,
            "capacity_gb": None if f.capacity_bytes is None else f.capacity_bytes / GB,
            "peak_gb": None if f.peak_bytes is None else f.peak_bytes / GB, "headroom_pct": f.headroom_pct,
            "threshold_pct": facts.config.min_headroom_pct}


def _memory_lead(facts: Facts) -> str:
    return (f"free memory {_headroom_pct(facts):.1f}% of capacity (below {facts.config.min_headroom_pct:g}%), "
            f"transfer {facts.shares['exposed_transfer_pct']:.0f}%, wait {facts.shares['exposed_wait_pct']:.0f}%")


def _memory_actions(facts: Facts) -> List[Action]:
    current = facts.current_alternative() or {}
    now = current.get("headroom_bytes")
    actions = []
    for alt in facts.alternatives:
        room = alt.get("headroom_bytes")
        if alt.get("current") or not alt.get("fits") or room is None or (now is not None and room <= now):
            continue
        gain = (room - now) / GB if now is not None else None
        effect = f"+{gain:.1f} GB of headroom (plan)" if gain is not None else f"{room / GB:.1f} GB headroom (plan)"
        actions.append(Action(f"{alt['label']} fits (plan: {room / GB:.1f} GB headroom) and {alt['what']}",
                              effect, gain, change=alt.get("override")))
    actions.append(Action("enable fsdp.activation_checkpointing or lower trainer.micro_batch_size",
                          "activations are the part of the peak that scales with the batch",
                          change="fsdp.activation_checkpointing=true"))
    actions.append(Action("checkpoint selectively (fsdp.activation_checkpointing: true, "
                          "fsdp.activation_checkpointing_mode: selective): blocks keep their matmul outputs and "
                          "recompute only the cheap ops",
                          "about half of full checkpointing's saving, at a fraction of its recompute",
                          change="fsdp.activation_checkpointing=true fsdp.activation_checkpointing_mode=selective"))
    return actions


# --- compute-bound (the fallback) -----------------------------------------------------------------------------
def _compute_evidence(facts: Facts) -> Dict[str, Any]:
    evidence = {"step_ms": facts.split["step_ms"], "compute_ms": facts.split["compute_total_ms"],
                "compute_pct": facts.shares["compute_pct"] + facts.shares["overlapped_pct"],
                "ranks": len(facts.by_rank)}
    for key in ("tokens_per_sec_per_device", "scaling_efficiency", "mfu"):
        if (facts.throughput or {}).get(key) is not None:
            evidence[key] = facts.throughput[key]
    return evidence


def _compute_lead(facts: Facts) -> str:
    compute = facts.shares["compute_pct"] + facts.shares["overlapped_pct"]
    return (f"compute {compute:.0f}% of step, exposed transfer {facts.shares['exposed_transfer_pct']:.0f}%, "
            f"wait {facts.shares['exposed_wait_pct']:.0f}%")


# Below this share of the step, exposed communication (transfer + wait) is "hidden"; the words say so only then.
HIDDEN_COMM_PCT = 5.0


def _compute_actions(facts: Facts) -> List[Action]:
    exposed = facts.shares["exposed_transfer_pct"] + facts.shares["exposed_wait_pct"]
    comm = ("communication is hidden" if exposed < HIDDEN_COMM_PCT else
            f"exposed communication is {exposed:.0f}% of the step, below what makes it the bottleneck")
    return _batch_action(facts, "better device utilization", None) + [
        Action(f"{comm}: more throughput needs faster compute (trainer.precision: bf16-mixed, "
               "model.attn_implementation: sdpa)", "raises tokens/s per device; the split stays compute-bound",
               change="trainer.precision=bf16-mixed"),
        _compile_action("fused elementwise kernels per block: less memory traffic per token")]


def _compile_action(effect: str) -> Action:
    return Action("torch.compile each transformer block (compile: true), unless the run already does; the first "
                  "steps pay the compile time", effect, change="compile=true")


RULES = (
    Rule("communication-bound", lambda f: f.shares["exposed_transfer_pct"], "exposed_transfer_pct",
         _comm_evidence, _comm_lead, _comm_actions),
    Rule("straggler-bound", lambda f: f.straggler_wait_pct, "exposed_wait_pct",
         _straggler_evidence, _straggler_lead, _straggler_actions),
    Rule("input-bound", lambda f: f.shares["input_wait_pct"], "input_wait_pct",
         _input_evidence, _input_lead, _input_actions),
    Rule("host-bound", lambda f: f.shares["idle_pct"], "host_idle_pct", _host_evidence, _host_lead, _host_actions),
    Rule("memory-bound", _headroom_pct, "min_headroom_pct", _memory_evidence, _memory_lead, _memory_actions,
         fires_below=True, competes=False),
    Rule("compute-bound", lambda f: f.shares["compute_pct"] + f.shares["overlapped_pct"], None,
         _compute_evidence, _compute_lead, _compute_actions),
)
RULES_BY_VERDICT = {rule.verdict: rule for rule in RULES}
# What each class's share measures, as the verdict names it ("idle 20 ± 3%"); the classes that compete on shares.
MEASURES = {"communication-bound": "exposed transfer", "straggler-bound": "wait", "input-bound": "input wait",
            "host-bound": "idle", "compute-bound": "compute"}


# ---------------------------------------------------------------- diagnose
FALLBACK = "compute-bound"


def _ranked(rule: Rule, facts) -> list:
    # Costed actions first, biggest expected saving first; uncosted ones keep the table's order after them.
    actions = rule.actions(facts)
    costed = sorted((a for a in actions if a.score is not None), key=lambda a: -a.score)
    return costed + [a for a in actions if a.score is None]


def missing_from(analysis: Mapping[str, Any]) -> list:
    """Ranks the trace analysis says are missing (its collectives summary), plus gaps in the rank numbers."""
    summary = analysis.get("summary") or {}
    said = (summary.get("collectives") or {}).get("missing_ranks") or []
    present = sorted(int(r) for r in analysis.get("ranks", {}))
    gaps = [r for r in range(present[-1] + 1) if r not in present] if present else []
    return sorted({int(r) for r in said} | set(gaps))


def diagnose(analysis: Mapping[str, Any], *, memory: Optional[Mapping] = None,
             throughput: Optional[Mapping[str, Any]] = None, wrap: Optional[Mapping[str, Any]] = None,
             alternatives: Optional[Sequence[Mapping[str, Any]]] = None, config: DiagnosisConfig = DiagnosisConfig(),
             micro_batch_size: Optional[int] = None,
             missing_ranks: Sequence[int] = ()) -> Diagnosis:
    """Classify one profiled window. ``analysis``: ``shardlight.trace.analyze_traces``' dict with each rank's
    ``split``; the rest are optional plain data (see ``shardlight.diagnosis.facts``). ``missing_ranks``: ranks
    known to be absent beyond what the analysis itself says (e.g. the run's world size is larger)."""
    by_rank = split_by_rank(analysis)
    split = overall_split(by_rank)
    pct = shares(split)
    missing = sorted(set(missing_from(analysis)) | {int(r) for r in missing_ranks})
    facts = gather_facts(analysis, by_rank, split, pct, config=config, memory=memory, throughput=throughput,
                         wrap=wrap, alternatives=alternatives, micro_batch_size=micro_batch_size,
                         missing_ranks=missing)
    firing = [rule for rule in RULES if rule.threshold_key is not None and rule.fires(facts)]
    competing = sorted((r for r in firing if r.competes), key=lambda r: -r.share(facts))
    others = [r for r in firing if not r.competes]
    ordered = competing + others
    primary = ordered[0] if ordered else RULES_BY_VERDICT[FALLBACK]
    straggler = facts.straggler if RULES_BY_VERDICT["straggler-bound"] in firing else None
    lead = primary.lead(facts)
    fullest = facts.fullest
    return Diagnosis(
        verdict=primary.verdict, headline=f"{primary.verdict}: {lead}", lead=lead,
        split=dict(split), split_by_rank=by_rank, shares=pct,
        evidence=primary.evidence(facts), actions=_ranked(primary, facts),
        secondary=[r.verdict for r in ordered[1:]],
        straggler_rank=None if straggler is None else straggler.rank,
        straggler_cause=None if straggler is None else straggler.cause,
        missing_ranks=missing,
        min_headroom_bytes=None if fullest is None else fullest.headroom_bytes,
        min_headroom_rank=None if fullest is None else fullest.rank,
        steps=int(min(s["steps"] for s in by_rank.values())),
        scores={verdict: RULES_BY_VERDICT[verdict].share(facts) for verdict in MEASURES},
    )
