"""The run's verdict across its profiled windows, and how sure it is.

One window is one sample of a noisy machine: on a shared host the same recipe's windows differ by several
points of the step, so a verdict read off one window (or the first, during warm-up) flips between runs. The
run's verdict is therefore judged on every analysed window after warm-up:

* **Judged windows**: those starting ``diagnosis.warmup_steps`` or more after the run's first step (a resumed
  run's resume step). When there are none (a run too short for a second window) the early ones, and the
  verdict says it is provisional.
* **The verdict**: ``diagnose`` of the judged windows taken as one long window (each rank's times and steps
  summed over them: the step-weighted mean split), so its headline, bar, evidence and actions are one set of
  numbers.
* **How sure**: each class's share in every judged window, as mean ± spread (the windows' standard
  deviation, never below ``diagnosis.noise_pct``: a few alike windows say little about the next run). Two
  classes are named, "host-bound or straggler-bound: idle 20 ± 3%, wait 17 ± 4%", when the winner's share is
  within its spread of its threshold (with the class that wins without it), or another class that could fire
  is within their spreads of it. The pair is written in the table's order, so runs that differ by noise only
  print the same words.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from shardlight.diagnosis.result import VERDICTS, Diagnosis
from shardlight.diagnosis.step_split import SPLIT_KEYS
from shardlight.diagnosis.verdicts import FALLBACK, MEASURES, RULES_BY_VERDICT, diagnose
from shardlight.errors import ShardlightError
from shardlight.recipe.instrument_sections import DiagnosisConfig

Window = Tuple[int, Mapping[str, Any]]  # (start step, the window's analysis combined across ranks)
_RANK_TOTALS = ("compute_us", "overlap_us")
_COLLECTIVE_TOTALS = ("comm_us", "exposed_comm_us", "overlap_us", "count")


def judged_windows(windows: Sequence[Window], run_start: int, warmup_steps: int) -> Tuple[List[Window], bool]:
    """(the windows the verdict is judged on, whether they are warm-up windows only: a provisional verdict)."""
    after = [w for w in windows if w[0] - run_start >= warmup_steps]
    return (after, False) if after else (list(windows), True)


def _sum_into(total: Dict[str, Any], part: Mapping[str, Any], keys: Sequence[str]) -> None:
    for key in keys:
        if part.get(key) is not None:
            total[key] = float(total.get(key) or 0) + float(part[key])


def _collectives(results: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    merged: Dict[str, Dict[str, Any]] = {}
    for result in results:
        for name, values in (result or {}).items():
            entry = merged.setdefault(name, {k: v for k, v in values.items() if k not in _COLLECTIVE_TOTALS})
            _sum_into(entry, values, _COLLECTIVE_TOTALS)
    return merged


def combined_analysis(analyses: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The windows as one long window: per rank, the split's times and steps, compute and overlap, and the
    per-collective (and per-group) totals summed over the windows the rank is in; everything else (timeline,
    summary, bandwidth) as the latest window has it."""
    if len(analyses) == 1:
        return dict(analyses[0])
    latest = analyses[-1]
    ranks: Dict[str, Any] = {}
    for rank, result in latest["ranks"].items():
        mine = [a["ranks"][rank] for a in analyses if rank in a.get("ranks", {}) and "split" in a["ranks"][rank]]
        merged = dict(result)
        merged["split"] = dict(result["split"], **{k: 0.0 for k in SPLIT_KEYS})
        for part in mine:
            _sum_into(merged["split"], part["split"], SPLIT_KEYS)
        for key in _RANK_TOTALS:
            merged[key] = sum(float(part.get(key) or 0) for part in mine)
        merged["by_collective"] = _collectives([part.get("by_collective") for part in mine])
        groups: Dict[str, Any] = {}
        for part in mine:
            for group, values in (part.get("by_group") or {}).items():
                groups.setdefault(group, {"ranks": values.get("ranks"), "parts": []})["parts"].append(
                    values.get("by_collective"))
        merged["by_group"] = {g: {"ranks": v["ranks"], "by_collective": _collectives(v["parts"])}
                              for g, v in groups.items()}
        ranks[rank] = merged
    return {**latest, "ranks": ranks}


def _stats(values: Sequence[float], floor: float) -> Tuple[float, float]:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, max(spread, floor)


def rival(primary: str, stats: Mapping[str, Tuple[float, float]], config: DiagnosisConfig) -> Optional[str]:
    """The class the verdict cannot be told apart from, or None. ``stats``: class -> (mean, spread) of its share
    over the judged windows (the competing classes, and compute-bound)."""
    competing = [v for v in stats if v != FALLBACK and RULES_BY_VERDICT[v].competes]
    limit = {v: float(getattr(config, RULES_BY_VERDICT[v].threshold_key)) for v in competing}

    def mean(v: str) -> float:
        return stats[v][0]

    def could_fire(v: str) -> bool:
        return mean(v) + stats[v][1] > limit[v]

    if primary == FALLBACK:
        near = [v for v in competing if could_fire(v)]
        return max(near, key=mean) if near else None
    if primary not in competing:
        return None  # memory-bound does not compete on shares
    if mean(primary) - stats[primary][1] <= limit[primary]:  # within its noise of its own threshold
        others = [v for v in competing if v != primary and mean(v) > limit[v]]
        return max(others, key=mean) if others else FALLBACK
    close = [v for v in competing if v != primary and could_fire(v)
             and mean(primary) - mean(v) <= stats[primary][1] + stats[v][1]]
    return max(close, key=mean) if close else None


def diagnose_run(windows: Sequence[Window], *, run_start: int = 0, config: DiagnosisConfig = DiagnosisConfig(),
                 **inputs: Any) -> Diagnosis:
    """The run's verdict from its windows (``(start step, analysis)``, oldest first), ``inputs`` as ``diagnose``
    takes them (memory, throughput, wrap, alternatives, micro_batch_size, missing_ranks)."""
    if not windows:
        raise ShardlightError("no analysed window to judge")
    used, provisional = judged_windows(windows, run_start, config.warmup_steps)
    overall = diagnose(combined_analysis([a for _, a in used]), config=config, **inputs)
    per_window = [diagnose(a, config=config, **inputs).scores for _, a in used]
    stats: Dict[str, Tuple[float, float]] = {}
    for verdict in MEASURES:
        values = [s[verdict] for s in per_window if s.get(verdict) is not None]
        if values:
            stats[verdict] = _stats(values, config.noise_pct)
    other = rival(overall.verdict, stats, config) if overall.verdict in stats else None
    steps = [start for start, _ in used]
    overall.windows, overall.run_start, overall.provisional = steps, run_start, provisional
    overall.spread = {v: [m, s] for v, (m, s) in stats.items()}
    if other is not None:
        pair = sorted((overall.verdict, other), key=VERDICTS.index)
        overall.label = " or ".join(pair)
        overall.headline = overall.label + ": " + ", ".join(
            f"{MEASURES[v]} {stats[v][0]:.0f} ± {stats[v][1]:.0f}%" for v in pair)
    else:
        overall.label = overall.verdict
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    judged = (f"provisional: judged on {len(steps)} warm-up window(s) ({where}); a run of 30 steps or more gets "
              "one after warm-up" if provisional else f"judged on {len(steps)} window(s) after warm-up ({where})")
    shown = [v for v in (overall.label.split(" or ")) if v in stats]
    if shown:
        judged += ": " + ", ".join(_measure_line(v, stats[v], config) for v in shown)
    overall.certainty = judged
    return overall


def _measure_line(verdict: str, stat: Tuple[float, float], config: DiagnosisConfig) -> str:
    rule = RULES_BY_VERDICT[verdict]
    line = f"{MEASURES[verdict]} {stat[0]:.0f} ± {stat[1]:.0f}% of the step"
    if rule.threshold_key is not None:
        line += f" (threshold {float(getattr(config, rule.threshold_key)):g}%)"
    return line
