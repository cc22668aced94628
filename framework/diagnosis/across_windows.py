"""The run's verdict across its profiled windows, and how sure it is.

One window is one sample of a noisy machine, and its steps are not independent samples: on the 2-core test host
the default recipe's exposed transfer varies by about 3.6 points of the step between a window's 3 steps, and
the window's mean by 3 points from window to window, where independent steps would give 2.1 (the host's noise
drifts over seconds). So a verdict read off one window, or off the first one during warm-up, flips between runs,
and the run's verdict is judged on several windows spread over the run (``callbacks.comm.judged_windows``):

* **Judged windows**: those starting ``diagnosis.warmup_steps`` or more after the run's first step (a resumed
  run's resume step). When there are none (a run too short for a second window) the early ones, and the
  verdict says it is provisional.
* **The verdict**: ``diagnose`` of the judged windows taken as one long window (each rank's times and steps
  summed over them: the step-weighted mean split), so its headline, bar, evidence and actions are one set of
  numbers.
* **How sure**: each class's share in every judged window gives the standard error of the run's share (a run
  with one judged window: its steps, which understate it); its uncertainty is that, never below
  ``diagnosis.noise_pct`` (5 points): what whole runs differ by beyond their windows' scatter, which no run
  sees in itself (on the test host, eight default runs judged on 4 windows each: exposed transfer 2.0 points
  apart, standard deviation, where the windows' scatter explains 1.25), and a margin so that a share near its
  threshold keeps its band across it from run to run. A larger floor names more classes in every verdict.
* **The label** names every class that cannot be told apart from the verdict, in the table's order: the
  leader (the largest share that could pass its threshold, raised by its uncertainty), every other class that
  could pass its own and reach the leader's lower edge, and compute-bound when the leader, lowered by its
  uncertainty, does not clear its threshold. One class: its name; several: "host-bound or compute-bound: idle
  21 ± 5%, compute 59 ± 5%". Each class is in or out by its own band, so the label changes between runs
  only when a share crosses the edge of its band (``benchmarks/verdict_stability.py`` measures how often).
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from shardlight.diagnosis.result import VERDICTS, Diagnosis
from shardlight.diagnosis.step_split import SPLIT_KEYS
from shardlight.diagnosis.verdicts import FALLBACK, MEASURES, RULES_BY_VERDICT, diagnose
from shardlight.errors import ShardlightError
from shardlight.recipe.instrument_sections import DiagnosisConfig

Window = Tuple[int, Mapping[str, Any]]  # (start step, the window's analysis combined across ranks)
_RANK_TOTALS = ("compute_us", "overlap_us")
_COLLECTIVE_TOTALS = ("comm_us", "exposed_comm_us", "overlap_us", "count")
_STEP_KEYS = tuple(k for k in SPLIT_KEYS if k != "steps")  # what each analysed step carries of the split


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


def _uncertainty(values: Sequence[float], floor: float) -> float:
    """How far the run's share may be from the share of another run of the same recipe: the standard error of
    the samples' mean, never below ``floor`` (what runs differ by beyond their own scatter)."""
    error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return max(error, floor)


def step_samples(analysis: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    """The window's analysed steps as one-step analyses (each rank's split, compute and overlap of that step),
    or the window itself when it has one step or its ranks do not carry per-step splits."""
    ranks = analysis.get("ranks") or {}
    per_rank = [result.get("steps") or {} for result in ranks.values()]
    common = set.intersection(*(set(s for s in steps if str(s).isdigit()) for steps in per_rank)) if per_rank else set()
    if len(common) < 2 or any(steps[s].get(k) is None for steps in per_rank for s in common for k in _STEP_KEYS):
        return [analysis]
    return [{"ranks": {rank: {"compute_us": result["steps"][step].get("compute_us"),
                              "overlap_us": result["steps"][step].get("overlap_us"),
                              "split": {**{k: result["steps"][step][k] for k in _STEP_KEYS}, "steps": 1}}
                       for rank, result in ranks.items()}}
            for step in sorted(common, key=int)]


def named_classes(primary: str, stats: Mapping[str, Tuple[float, float]], config: DiagnosisConfig) -> List[str]:
    """The classes the verdict cannot be told apart from, the verdict's own included, in the table's order.
    ``stats``: class -> (the run's share, its uncertainty) for the competing classes and compute-bound. The
    leader is the largest share that could pass its threshold; named with it: every class that could pass its
    own and reach the leader's lower edge, and compute-bound when the leader may not pass its threshold."""
    competing = [v for v in VERDICTS if v in stats and v != FALLBACK and RULES_BY_VERDICT[v].competes]
    if primary != FALLBACK and primary not in competing:
        return [primary]  # memory-bound does not compete on shares
    limit = {v: float(getattr(config, RULES_BY_VERDICT[v].threshold_key)) for v in competing}
    low = {v: stats[v][0] - stats[v][1] for v in competing}
    high = {v: stats[v][0] + stats[v][1] for v in competing}
    could = [v for v in competing if high[v] > limit[v]]
    if not could:
        return [FALLBACK]
    leader = max(could, key=lambda v: stats[v][0])
    named = {v for v in could if high[v] >= low[leader]} | {primary}
    if low[leader] <= limit[leader]:
        named.add(FALLBACK)
    return sorted(named, key=VERDICTS.index)


def diagnose_run(windows: Sequence[Window], *, run_start: int = 0, config: DiagnosisConfig = DiagnosisConfig(),
                 **inputs: Any) -> Diagnosis:
    """The run's verdict from its windows (``(start step, analysis)``, oldest first), ``inputs`` as ``diagnose``
    takes them (memory, throughput, wrap, alternatives, micro_batch_size, missing_ranks)."""
    if not windows:
        raise ShardlightError("no analysed window to judge")
    used, provisional = judged_windows(windows, run_start, config.warmup_steps)
    overall = diagnose(combined_analysis([a for _, a in used]), config=config, **inputs)
    # The samples of the run's scatter: its judged windows, or the one window's steps when it has one (they
    # move together, so their scatter is a lower bound: the floor covers the rest).
    samples = [a for _, a in used] if len(used) > 1 else step_samples(used[0][1])
    scores = [diagnose(sample, config=config).scores for sample in samples]
    stats: Dict[str, Tuple[float, float]] = {}  # the bar's own share, and how sure it is
    for verdict in MEASURES:
        values = [s[verdict] for s in scores if s.get(verdict) is not None]
        if values and overall.scores.get(verdict) is not None:
            stats[verdict] = (float(overall.scores[verdict]), _uncertainty(values, config.noise_pct))
    named = named_classes(overall.verdict, stats, config) if overall.verdict in stats else [overall.verdict]
    steps = [start for start, _ in used]
    overall.windows, overall.run_start, overall.provisional = steps, run_start, provisional
    overall.spread = {v: [m, s] for v, (m, s) in stats.items()}
    overall.label = " or ".join(named)
    if len(named) > 1:
        overall.headline = overall.label + ": " + ", ".join(
            f"{MEASURES[v]} {stats[v][0]:.0f} ± {stats[v][1]:.0f}%" for v in named)
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    counted = f"{len(steps)} window(s)" if len(used) > 1 else f"1 window of {len(samples)} step(s)"
    judged = (f"provisional: judged on {counted} of warm-up ({where}); a run of 30 steps or more gets a window "
              "after warm-up" if provisional else f"judged on {counted} after warm-up ({where})")
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
