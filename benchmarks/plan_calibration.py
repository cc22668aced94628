"""Does a step-time calibration predict the strategies it was not measured on? One line per prediction.

``shardlight profile`` runs the 1-device baseline and NO_SHARD, SHARD_GRAD_OP, FULL_SHARD on the recipe's
ranks (default: the shipped tiny recipe, 2 CPU gloo ranks). For each strategy in turn this calibrates on the
baseline plus that one strategy (``shardlight.planner.calibration.calibrate``: achieved compute rate, host
time per step, per-collective-kind latency + bus bandwidth fitted on the trace's size buckets) and predicts
the other two strategies' step times; error = (predicted - measured) / measured against the run's logged
step time. The goal on 2 CPU ranks is |error| <= 15%.

Run (shardlight installed): python benchmarks/plan_calibration.py [--repeats 3] [--profile DIR ...]
(``--profile`` reuses finished ``shardlight profile`` output directories instead of running new ones).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from shardlight.build import build_hf_config
from shardlight.planner.calibration import calibrate, step_time_check
from shardlight.planner.plan import spec_from_recipe, workload_from_recipe
from shardlight.recipe import load_recipe

STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
GOAL = 0.15


def run_profile(out: Path, steps: int) -> Path:
    subprocess.run([sys.executable, "-m", "shardlight.cli", "profile", "--out", str(out), "--steps", str(steps),
                    "logging.wandb.enabled=false"], check=True, stdout=subprocess.DEVNULL)
    return out


def run_dirs(profile_dir: Path) -> Dict[str, Path]:
    """Run directory per sweep run, from the sweep's profile.json."""
    report = json.loads((profile_dir / "profile.json").read_text())
    return {name: Path(run["summary"]["run_dir"]) for name, run in report["runs"].items() if "summary" in run}


def evaluate(profile_dir: Path) -> List[dict]:
    dirs = run_dirs(profile_dir)
    cfg = load_recipe(str(dirs[STRATEGIES[0]] / "recipe.yaml"), [])  # the baseline's is the 1-device one
    spec, work = spec_from_recipe(cfg, build_hf_config(cfg.model)), workload_from_recipe(cfg)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    rows = []
    for calibrated_on in STRATEGIES:
        calibration = calibrate(dirs["baseline"], {calibrated_on: dirs[calibrated_on]}, spec, work, world,
                                cfg.trainer.accelerator)
        others = {s: dirs[s] for s in STRATEGIES if s != calibrated_on}
        for strategy, check in step_time_check(calibration, others, spec, work).items():
            rows.append({"profile": str(profile_dir), "calibrated_on": calibrated_on, "predicted": strategy,
                         "predicted_ms": round(check["predicted_step_s"] * 1e3, 2),
                         "measured_ms": round(check["measured_step_s"] * 1e3, 2),
                         "error": round(check["error"], 4)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", type=Path, help="a finished shardlight profile directory")
    parser.add_argument("--repeats", type=int, default=3, help="profiles to run when no --profile is given")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        profiles = args.profile or [run_profile(Path(tmp) / f"profile{i}", args.steps) for i in range(args.repeats)]
        rows = [row for profile_dir in profiles for row in evaluate(profile_dir)]
    for row in rows:
        print(json.dumps(row))
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= GOAL for e in errors)
    print(json.dumps({"predictions": len(errors), "profiles": len(profiles), "within_15pct": within,
                      "mean_abs_error": round(sum(errors) / len(errors), 4), "max_abs_error": round(max(errors), 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
