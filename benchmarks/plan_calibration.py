"""Does a step-time calibration predict the strategies it was not measured on? One harness line.

``shardlight profile`` runs the 1-device baseline and NO_SHARD, SHARD_GRAD_OP, FULL_SHARD on the recipe's
ranks (default: the shipped tiny recipe, 2 CPU gloo ranks). For each strategy in turn this calibrates on the
baseline plus that one strategy (``shardlight.planner.calibration.calibrate``: achieved compute rate, host
time per step, per-collective-kind latency + bus bandwidth fitted on the trace's size buckets) and predicts
the other two strategies' step times; error = (predicted - measured) / measured. Both sides are the same
statistic: the median over the analysed steps of every profiled window but the first (the profiler's start-up)
of the ranks' mean step time, steps whose compute the machine's other load slowed by over 25% left out
(``calibration.measured_step_s``), so one slow step or window moves neither. The
goal on 2 CPU ranks is |error| <= 15%.

Each profile is evaluated on its own (``rows``: what one ``shardlight profile`` gives a user), and, with two
or more, all of them together (``pooled_rows``: each number the median over the profiles of each one's median,
so a run the machine's other load slowed while its siblings were not does not move it). ``errors`` and
``pooled_errors`` name each prediction ``<calibrated on> -> <predicted>``; ``load_avg`` is the machine's
1-minute load average before each profile (on 2 cores, above 2 means other work shared them), and each
prediction's ``compute_ratio`` (its run's measured compute time over the calibrated one) says whether its run
computed at the calibration's rate: ``comparable*`` are the figures of those within 10% of it, and
``adjusted_*`` (a diagnostic of the model's form, not the claim) the errors of predictions scaled by it.

The profiles run the strategies in alternating order (``profile_order``: forward, then reversed), so a machine
that drifts over a profile does not favour the same strategies in each.

The line goes through ``benchmarks/_harness.py``'s ``emit``. With 3 or more profiles (``claim: "pooled"``) ``ratio``
is the worst |error| of the pooled predictions -- the measurement repeated and its median taken, as a user
who wants a number they can rely on would profile; with fewer (``claim: "per_profile"``) the worst |error| over
all per-profile predictions. ``ci90`` is the point (the predictions are not pairs), ``target`` 0.15, ``bound``
upper, ``holds`` when every prediction of the claim is within it; the per-profile figures (``within_15pct`` of
``predictions``, ``mean_abs_error``, ``max_abs_error``, ``rows``) stand beside the pooled ones (``pooled_*``)
either way. Each prediction is also printed to stderr.

Run (shardlight installed): python benchmarks/plan_calibration.py [--repeats 5] [--steps 40] [--keep DIR]
[--profile DIR ...] (``--profile`` reuses finished ``shardlight profile`` output directories instead of running
new ones; ``--keep`` keeps the new ones there; 40 steps give each run three windows, two of them used, 12
analysed steps).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import emit, holds, machine  # noqa: E402

from shardlight.build import build_hf_config
from shardlight.planner import calibration as calibration_module
from shardlight.planner.calibration import calibrate, step_time_check
from shardlight.planner.plan import spec_from_recipe, workload_from_recipe
from shardlight.recipe import load_recipe

STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
GOAL = 0.15
MIN_POOLED = 3  # profiles from which the pooled errors are the claim (a median of 3 or more outvotes one bad profile)
COMPARABLE = 0.10  # |measured compute / calibrated compute - 1| of a prediction whose run the machine did not slow
# Every window is read by several calibrations and checks here; a finished window's traces do not change.
calibration_module.analyze_traces = functools.lru_cache(maxsize=None)(calibration_module.analyze_traces)


def run_profile(out: Path, steps: int, order: Sequence[str] = STRATEGIES) -> Path:
    subprocess.run([sys.executable, "-m", "shardlight.cli", "profile", "--out", str(out), "--steps", str(steps),
                    "--strategies", ",".join(order), "logging.wandb.enabled=false"],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def profile_order(index: int) -> Sequence[str]:
    """The strategies' order in profile ``index``: reversed every other profile, so that a machine slowing down
    or speeding up over a profile does not favour the same strategies in every one (the baseline always runs
    first: ``shardlight profile`` runs it before the strategies)."""
    return STRATEGIES if index % 2 == 0 else tuple(reversed(STRATEGIES))


def run_dirs(profile_dir: Path) -> Dict[str, Path]:
    """Run directory per sweep run, from the sweep's profile.json."""
    report = json.loads((profile_dir / "profile.json").read_text())
    return {name: Path(run["summary"]["run_dir"]) for name, run in report["runs"].items() if "summary" in run}


def predictions(dirs: Dict[str, Sequence[Path]], label: str) -> List[dict]:
    """Calibrate on the baseline plus each strategy in turn and predict the other two (``dirs``: run
    directories per sweep run, one per profile)."""
    cfg = load_recipe(str(dirs[STRATEGIES[0]][0] / "recipe.yaml"), [])  # the baseline's is the 1-device one
    spec, work = spec_from_recipe(cfg, build_hf_config(cfg.model)), workload_from_recipe(cfg)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    rows = []
    for calibrated_on in STRATEGIES:
        calibration = calibrate(dirs["baseline"], {calibrated_on: dirs[calibrated_on]}, spec, work, world,
                                cfg.trainer.accelerator)
        others = {s: dirs[s] for s in STRATEGIES if s != calibrated_on}
        for strategy, check in step_time_check(calibration, others, spec, work).items():
            rows.append({"profile": label, "calibrated_on": calibrated_on, "predicted": strategy,
                         "predicted_ms": round(check["predicted_step_s"] * 1e3, 2),
                         "measured_ms": round(check["measured_step_s"] * 1e3, 2),
                         "error": round(check["error"], 4), "compute_ratio": round(check["compute_ratio"], 3),
                         # Diagnostic only: the prediction at the rate its run computed at (every part of a CPU
                         # step, host and gloo transfers too, slows with the cores' share it gets).
                         "adjusted_error": round(check["error_at_measured_rate"], 4)})
    return rows


def evaluate(profile_dir: Path) -> List[dict]:
    return predictions({name: [run] for name, run in run_dirs(profile_dir).items()}, str(profile_dir))


def evaluate_pooled(profiles: Sequence[Path]) -> List[dict]:
    pooled: Dict[str, List[Path]] = {}
    for profile_dir in profiles:
        for name, run in run_dirs(profile_dir).items():
            pooled.setdefault(name, []).append(run)
    return predictions(pooled, f"{len(profiles)} profiles pooled")


def figures(rows: List[dict], prefix: str = "") -> dict:
    errors = [abs(r["error"]) for r in rows]
    named: Dict[str, List[float]] = {}
    for r in rows:
        named.setdefault(f"{r['calibrated_on']} -> {r['predicted']}", []).append(r["error"])
    # Predictions whose run computed at the calibration's rate (within COMPARABLE): the others ran while the
    # machine's other load took a different share of its cores, an error of the machine, not of the model.
    comparable = [abs(r["error"]) for r in rows if r["compute_ratio"] and abs(r["compute_ratio"] - 1) <= COMPARABLE]
    return {f"{prefix}predictions": len(errors), f"{prefix}within_15pct": sum(e <= GOAL for e in errors),
            f"{prefix}mean_abs_error": round(sum(errors) / len(errors), 4),
            f"{prefix}max_abs_error": round(max(errors), 4), f"{prefix}errors": named,
            f"{prefix}comparable": len(comparable),
            f"{prefix}comparable_within_15pct": sum(e <= GOAL for e in comparable),
            f"{prefix}comparable_max_abs_error": round(max(comparable), 4) if comparable else None,
            f"{prefix}adjusted_within_15pct": sum(abs(r["adjusted_error"]) <= GOAL for r in rows),
            f"{prefix}adjusted_max_abs_error": round(max(abs(r["adjusted_error"]) for r in rows), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", type=Path, help="a finished shardlight profile directory")
    parser.add_argument("--repeats", type=int, default=5, help="profiles to run when no --profile is given")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (40: three windows)")
    parser.add_argument("--keep", type=Path, help="write new profiles here instead of a temporary directory")
    args = parser.parse_args()
    load_avg: List[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        profiles = args.profile or []
        for i in range(0 if args.profile else args.repeats):
            load_avg.append(round(os.getloadavg()[0], 2))
            profiles.append(run_profile(root / f"profile{i}", args.steps, profile_order(i)))
        rows = [row for profile_dir in profiles for row in evaluate(profile_dir)]
        pooled = evaluate_pooled(profiles) if len(profiles) > 1 else []
    for row in rows + pooled:
        print(json.dumps(row), file=sys.stderr)
    per_profile = figures(rows)
    pooled_figures = figures(pooled, "pooled_") if pooled else {}
    # The claim: with MIN_POOLED profiles or more, each prediction's error over the profiles pooled (the median of
    # each one's median on both sides: one profile the machine slowed throughout cannot move it); with fewer,
    # the worst single-profile error. Either way the per-profile figures stand beside it.
    claim = "pooled" if len(profiles) >= MIN_POOLED else "per_profile"
    worst = pooled_figures["pooled_max_abs_error"] if claim == "pooled" else per_profile["max_abs_error"]
    emit({"benchmark": "plan_calibration", "metric": "max_abs_error", "claim": claim, "ratio": worst,
          "ci90": [worst, worst], "pairs": len(pooled if claim == "pooled" else rows), "target": GOAL,
          "bound": "upper", "holds": holds([worst, worst], GOAL, "upper"),
          **per_profile, "profiles": len(profiles), "orders": [list(profile_order(i)) for i in range(len(profiles))],
          "steps": args.steps, "load_avg": load_avg, **pooled_figures, "rows": rows, "pooled_rows": pooled,
          "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
