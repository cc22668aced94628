"""``shardlight profile``'s calibration step: after the sweep, calibrate step time on its own runs
(``shardlight.planner.calibration``), re-time the plan with it, and check every strategy's calibrated step
time against the measured one.

The sweep calibrates on the baseline and every strategy that ran, so its check is in-sample (how well the
model form fits); ``benchmarks/plan_calibration.py`` calibrates on the baseline and one strategy and
predicts the others, the out-of-sample check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from shardlight.errors import ShardlightError
from shardlight.files import write_json
from shardlight.planner.calibration import apply_to_rows, calibrate, step_time_check
from shardlight.planner.inputs import Cluster, Workload
from shardlight.planner.model_spec import ModelSpec
from shardlight.planner.recommend import recommend


def finished_run_dirs(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Path]:
    """Run directory per finished run (``baseline`` included)."""
    return {name: Path(run["summary"]["run_dir"]) for name, run in runs.items() if "summary" in run}


def calibrate_sweep(plan: Dict[str, Any], runs: Dict[str, Dict[str, Any]], spec: ModelSpec, work: Workload,
                    cluster: Cluster, accelerator: str, checkpointing: bool, out: Path) -> Dict[str, Any]:
    """``{"calibration", "step_time_check"}`` (``{"calibration_error"}`` when the runs cannot calibrate: a note, not a
    failed sweep); on success the plan's rows and recommendation are re-timed with it, each run's
    ``predicted`` times too, and the calibration is written to ``out/calibration.json``."""
    dirs = finished_run_dirs(runs)
    baseline = dirs.pop("baseline", None)
    if baseline is None or not dirs:
        return {"calibration_error": "calibration needs the 1-device baseline and at least one finished strategy run"}
    try:
        calibration = calibrate(baseline, dirs, spec, work, cluster.world_size, accelerator)
        check = step_time_check(calibration, dirs, spec, work, checkpointing)
    except ShardlightError as exc:
        return {"calibration_error": str(exc)}
    apply_to_rows(plan["strategies"], calibration, spec, work)
    plan["recommendation"] = recommend(plan["strategies"], cluster, plan["model"])
    plan["time_source"] = "calibration"
    for name, run in runs.items():
        row: Optional[Dict[str, Any]] = next(
            (r for r in plan["strategies"] if r["sharding_strategy"] == name
             and r["activation_checkpointing"] == checkpointing and not r["cpu_offload"]), None)
        if row is not None and run.get("predicted"):
            run["predicted"].update({k: row[k] for k in ("comm_time_s", "compute_time_s", "step_time_s", "bound",
                                                         "tokens_per_sec_per_device")})
    write_json(out / "calibration.json", calibration)
    return {"calibration": calibration, "step_time_check": check}
