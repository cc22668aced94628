"""``diagnose``: a trace analysis (and what else is known of the run) → one ``Diagnosis``.

The primary verdict is the firing rule (``verdicts.RULES``) with the largest share; memory-bound does not
compete on share and is listed as secondary when a time finding fires; compute-bound when nothing fires.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from shardlight.diagnosis.facts import gather_facts
from shardlight.diagnosis.model import Diagnosis
from shardlight.diagnosis.split import overall_split, shares, split_by_rank
from shardlight.diagnosis.verdicts import RULES, RULES_BY_VERDICT, Rule
from shardlight.recipe.instrument_sections import DiagnosisConfig

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
    )
