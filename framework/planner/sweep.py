"""``shardlight profile`` as a library: a measured sweep of sharding strategies next to the plan's prediction.

``profile(ProfileRequest(recipe, overrides, ...))`` runs each
configuration as its own ``shardlight train`` process (``runs.run_one``) for ``steps`` optimizer steps with
the comm/memory/throughput callbacks. The 1-device baseline runs first (when the plan says the model fits
on one device); its tokens/s/device is written to ``baseline.json``, the file
``callbacks.throughput.baseline_file`` reads, and handed to the strategy runs. The report
(``profile_report.md``, ``profile.json``, PNG plots, a W&B table; ``report``) reads each run's
``csv/metrics.csv``. Every strategy run's latest profiling window gets the same verdict ``shardlight diagnose``
gives (``shardlight.diagnosis``, with the plan's alternatives for that strategy), its report in
``diagnosis/<strategy>/``. Parsing the command line is ``shardlight.cli.planner_command``'s job, not this module's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shardlight.build.training_model import build_hf_config
from shardlight.diagnosis import write_report
from shardlight.diagnosis.run_inputs import load_run_inputs
from shardlight.errors import ShardlightError
from shardlight.files import write_json
from shardlight.planner import sweep_report
from shardlight.planner.alternatives import alternatives_from_plan
from shardlight.planner.calibration import step_frame
from shardlight.planner.estimate import STRATEGIES
from shardlight.planner.inputs import GB, make_cluster
from shardlight.planner.model_spec import ModelSpec
from shardlight.planner.plan import (
    ClusterOptions,
    WorkloadOptions,
    cluster_for,
    make_plan,
    plan_for,
    spec_from_recipe,
    workload_for,
    workload_from_recipe,
)
from shardlight.planner.recommend import choose, find_row
from shardlight.planner.runs import COMPARED, measure, read_metrics, run_one
from shardlight.planner.sweep_calibration import calibrate_sweep
from shardlight.recipe import RecipeConfig, load_recipe

DEFAULT_STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
MIN_STEPS = 6
# The comm profiling windows of every sweep run (``window_schedule``): where the first starts, how far apart
# they start (room for the previous window's analysis between them), warm-up and recorded steps of each.
# A window stays open until its results are gathered, ``gather_delay`` (5) steps after its last: with 7 recorded
# steps every 15, 40 steps give windows at 2, 15 and 30, so 12 analysed steps after the first window (every 10
# with 4 recorded gave 6: the window at 10 never started, the first not gathered yet; 6 steps of a 2-rank CPU
# run moved its median by up to a third between profiles).
FIRST_WINDOW, WINDOW_EVERY, WINDOW_WARMUP, WINDOW_ACTIVE = 2, 15, 1, 7
LOG_EVERY = 2
PREDICTED_KEYS = ("params_bytes", "grads_bytes", "optim_bytes", "peak_bytes", "activation_bytes", "logits_bytes",
                  "comm_time_s", "compute_time_s", "step_time_s", "bound", "fits", "tokens_per_sec_per_device")


@dataclass(frozen=True)
class ProfileRequest:
    """What to sweep. ``cluster``/``workload``/``restrict_*`` shape the plan the measurements are compared
    with (as for ``shardlight plan``); the runs themselves are the recipe with ``overrides``."""

    recipe: Optional[str] = None                  # recipe file; None: the default recipe
    overrides: Sequence[str] = ()                 # key.path=value
    out_dir: str = "profile"                      # report directory
    steps: int = 8                                # optimizer steps per run, at least MIN_STEPS
    strategies: Sequence[str] = DEFAULT_STRATEGIES
    baseline: bool = True                         # the 1-device baseline run first
    timeout: float = 900.0                        # seconds per run before it is stopped
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    restrict_ckpt: Optional[bool] = None          # plan only with (True) / without (False) activation checkpointing
    restrict_offload: Optional[bool] = None       # plan only with / without CPU offload


def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def sweep_strategies(names: Sequence[str], cfg: RecipeConfig) -> List[str]:
    """The strategies to run, upper-cased and checked; HYBRID_SHARD is dropped (with a line) on one node
    without ``fsdp.mesh_shape``."""
    strategies = [s.strip().upper() for s in names if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise ShardlightError(f"--strategies: unknown strategy '{s}'; known: {', '.join(STRATEGIES)}")
    if "HYBRID_SHARD" in strategies and cfg.trainer.num_nodes < 2 and not cfg.fsdp.mesh_shape:
        strategies.remove("HYBRID_SHARD")
        print("shardlight profile: HYBRID_SHARD skipped (one node and no fsdp.mesh_shape)")
    if not strategies:
        raise ShardlightError("--strategies: nothing to run")
    return strategies


def window_schedule(steps: int) -> Dict[str, int]:
    """The comm profiling windows of a sweep run of ``steps`` steps: the first at ``FIRST_WINDOW`` (after the
    first step's allocations), then one every ``WINDOW_EVERY`` steps while it fits, each ``WINDOW_WARMUP``
    traced step and up to ``WINDOW_ACTIVE`` recorded ones (the last dropped by the analysis). The calibration
    takes medians over every analysed step of every window but the first, so a longer run (``--steps 40``:
    windows at 2, 15 and 30, 6 analysed steps each) calibrates on more steps; a short one still gets its one
    window."""
    active = max(2, min(WINDOW_ACTIVE, steps - FIRST_WINDOW - WINDOW_WARMUP))
    return {"first_step": FIRST_WINDOW, "every_n_steps": WINDOW_EVERY, "warmup": WINDOW_WARMUP, "active": active}


def sweep_overrides(steps: int, out: Path, on_cpu: bool = True) -> List[str]:
    """The overrides every run of the sweep gets: its length, logging and profiling windows, its output.

    Every window runs, whatever it costs (no ``overhead_budget``), and on CPU records op shapes (the gloo
    collectives' bytes, which the calibration's bandwidth fit needs in every window it reads)."""
    windows = [f"callbacks.comm.{key}={value}" for key, value in window_schedule(steps).items()]
    windows += ["callbacks.comm.overhead_budget=null", f"callbacks.comm.record_shapes={str(on_cpu).lower()}",
                "callbacks.comm.judged_windows=1"]  # the schedule above is the whole schedule
    return [f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={LOG_EVERY}",
            f"trainer.val_every_n_steps={steps * 10}", "trainer.limit_val_batches=1", "trainer.progress_bar=false",
            # The calibration reads every window's trace files.
            *windows, "callbacks.comm.wait=0", "callbacks.comm.keep_windows=null", "callbacks.comm.save_traces=true",
            f"callbacks.memory.every_n_steps={LOG_EVERY}", f"callbacks.throughput.every_n_steps={LOG_EVERY}",
            f"output_dir={out / 'runs'}"]


def run_baseline(request: ProfileRequest, cfg: RecipeConfig, spec: ModelSpec, ckpt: bool, common: List[str],
                 out: Path) -> Optional[Dict[str, Any]]:
    """The 1-device NO_SHARD run, or None (with a line) when the plan says the model does not fit there."""
    c = request.cluster
    single = make_plan(spec, make_cluster(nodes=1, gpus_per_node=1, gpu_memory=c.gpu_memory,
                                          peak_tflops=float(c.peak_tflops), mfu=float(c.mfu),
                                          overhead_gb=float(c.overhead_gb)), workload_from_recipe(cfg))
    one = find_row(single["strategies"], "NO_SHARD", ckpt, False)
    if one is not None and not one["fits"]:
        print(f"shardlight profile: baseline skipped: the plan says the model does not fit on one device "
              f"({one['peak_bytes'] / GB:.1f} GB > {one['usable_bytes'] / GB:.1f} GB)")
        return None
    threads = []
    if cfg.trainer.accelerator == "cpu" and cfg.trainer.num_threads is None:
        # A CPU "device" is one rank and its threads: give the baseline what one sweep rank gets.
        threads = [f"trainer.num_threads={max(1, (os.cpu_count() or 1) // cfg.trainer.devices)}"]
    result = run_one(request.recipe, [*request.overrides, *common, *threads,
                                      "trainer.devices=1", "trainer.num_nodes=1", "fsdp.sharding_strategy=NO_SHARD",
                                      "fsdp.mesh_shape=null", "name=profile-baseline"], out, "baseline",
                     request.timeout)
    result["world_size"] = 1
    measured = measure(result, 1)
    if measured is not None:
        result["measured"] = with_frame(result, measured)
    return result


def diagnose_run(result: Dict[str, Any], alternatives: List[Dict[str, Any]], out: Path) -> Optional[Dict[str, Any]]:
    """The run's latest profiled window diagnosed as ``shardlight diagnose`` does, its report in ``out``; None when
    the run did not finish, ``{"error"}`` when its window cannot be diagnosed (a note, not a failed sweep)."""
    if "summary" not in result:
        return None
    run_dir = Path(result["summary"]["run_dir"])
    try:
        inputs = load_run_inputs(run_dir, metrics=read_metrics(run_dir))
        diagnosis = inputs.diagnosis(alternatives=alternatives)
        path = write_report(out, diagnosis, inputs.analysis, memory=inputs.memory, throughput=inputs.throughput)
    except ShardlightError as exc:
        return {"error": str(exc)}
    return {**diagnosis.to_dict(), "report": str(path), "window_step": inputs.window_step}


def run_strategy(request: ProfileRequest, strategy: str, world: int, plan_row: Optional[Dict[str, Any]],
                 common: List[str], out: Path, baseline_file: Optional[Path],
                 baseline_tps: Optional[float], alternatives: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """One strategy's run, its measured numbers next to the plan's row for it (``plan_row``)."""
    extra = [f"fsdp.sharding_strategy={strategy}", f"name=profile-{strategy.lower()}"]
    if baseline_file is not None:
        extra.append(f"callbacks.throughput.baseline_file={baseline_file}")
    result = run_one(request.recipe, [*request.overrides, *common, *extra], out, strategy.lower(), request.timeout)
    result["world_size"] = world
    measured = measure(result, world)
    if measured is not None:
        result["measured"] = with_frame(result, measured)
    if plan_row is not None:
        result["predicted"] = {k: plan_row[k] for k in PREDICTED_KEYS}
        got = result.get("measured", {})
        result["relative_error"] = {k: relative_error(plan_row[f"{k}_bytes"], got.get(f"{k}_bytes"))
                                    for k in COMPARED}
    diagnosis = diagnose_run(result, alternatives or [], out / "diagnosis" / strategy.lower())
    if diagnosis is not None:
        result["diagnosis"] = diagnosis
    return result


def with_frame(result: Dict[str, Any], measured: Dict[str, Any]) -> Dict[str, Any]:
    """``measured`` with the run's step frame (``calibration.step_frame``): the one set of step times the
    printed best, the table and the plots all show."""
    return {**measured, **(step_frame(Path(result["summary"]["run_dir"])) or {})}


def scale_against_baseline(runs: Dict[str, Dict[str, Any]]) -> None:
    """Each strategy run's scaling efficiency from the frame: the 1-device baseline's step time over its own (every
    rank processes the baseline's micro-batch per step, so equal step times are perfect scaling)."""
    base = ((runs.get("baseline") or {}).get("measured") or {}).get("step_ms")
    for name, run in runs.items():
        step = (run.get("measured") or {}).get("step_ms")
        if name != "baseline" and run.get("measured") is not None:
            run["measured"]["scaling_efficiency"] = base / step if base and step else None


def compare(plan: Dict[str, Any], runs: Dict[str, Dict[str, Any]], strategies: List[str], ckpt: bool,
            offload: bool, gpu_memory: str) -> Tuple[Optional[str], Optional[str], List[str]]:
    """(measured best, the plan's pick among the swept configurations, notes where they disagree)."""
    measured_ok = successful(runs)
    best = min(measured_ok, key=lambda s: measured_ok[s]["measured"]["step_ms"]) if measured_ok else None
    swept = [r for r in plan["strategies"] if r["sharding_strategy"] in strategies
             and r["activation_checkpointing"] == ckpt and r["cpu_offload"] == offload]
    predicted_row = choose(swept)
    predicted = predicted_row["sharding_strategy"] if predicted_row else None
    notes: List[str] = []
    if best and predicted and best != predicted and plan.get("time_source") == "calibration":
        notes.append(f"measured best {best} differs from the calibrated plan's {predicted}: see the step-time "
                     f"errors below; calibrated predictions that close are within this machine's run-to-run noise")
    elif best and predicted and best != predicted:
        notes.append(f"measured best {best} differs from the plan's {predicted}: the plan's times assume "
                     f"{plan['cluster']['peak_tflops']:g} TFLOP/s at {plan['cluster']['mfu']:.0%} MFU and its "
                     f"interconnect; on this hardware measured communication/compute decide.")
    for s, r in runs.items():
        for k, err in (r.get("relative_error") or {}).items():
            if err is not None and abs(err) > 0.01:
                notes.append(f"{s}: predicted {k} bytes differ from the measured local shard by {err:+.1%}")
        pred, meas = r.get("predicted"), r.get("measured")
        if pred and meas and not pred["fits"]:
            notes.append(f"{s}: the plan says it does not fit in {gpu_memory}, yet it ran here")
    return best, predicted, notes


def successful(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The strategy runs (not the baseline) that measured a step time (the frame's)."""
    return {s: r for s, r in runs.items() if s != "baseline" and (r.get("measured") or {}).get("step_ms")}


def profile(request: ProfileRequest) -> int:
    """Run the sweep, write the report into ``request.out_dir``; 1 when every run failed, else 0."""
    steps = request.steps
    if not request.timeout > 0:
        raise ShardlightError(f"--timeout must be positive, got {request.timeout}")
    cfg = load_recipe(request.recipe, list(request.overrides))
    strategies = sweep_strategies(request.strategies, cfg)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if steps < MIN_STEPS:
        raise ShardlightError("--steps must be at least 6 (warm-up, one comm profiling window, throughput)")
    spec = spec_from_recipe(cfg, build_hf_config(cfg.model))
    plan = plan_for(spec, cluster_for(request.cluster, cfg), workload_for(request.workload, cfg),
                    request.restrict_ckpt, request.restrict_offload)
    out = Path(request.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt, offload = bool(cfg.fsdp.activation_checkpointing), bool(cfg.fsdp.cpu_offload or cfg.fsdp.offload_params)
    common = sweep_overrides(steps, out, on_cpu=cfg.trainer.accelerator == "cpu")
    runs: Dict[str, Dict[str, Any]] = {}
    baseline_tps = None
    baseline_file = out / "baseline.json"
    if request.baseline:
        baseline = run_baseline(request, cfg, spec, ckpt, common, out)
        if baseline is not None:
            baseline_tps = (baseline.get("measured") or {}).get("tokens_per_sec_per_device")
            runs["baseline"] = baseline
            if baseline_tps:
                write_json(baseline_file, {"tokens_per_sec_per_device": baseline_tps, "world_size": 1,
                                                  "recipe": cfg.name, "steps": steps, "source": "shardlight profile"})
    for strategy in strategies:
        alternatives = alternatives_from_plan(plan, strategy=strategy, activation_checkpointing=ckpt,
                                              cpu_offload=offload)
        runs[strategy] = run_strategy(request, strategy, world, find_row(plan["strategies"], strategy, ckpt, offload),
                                      common, out, baseline_file if baseline_tps else None, baseline_tps, alternatives)

    scale_against_baseline(runs)
    # Step times measured here replace the table's bandwidths and peak x MFU before plan and measurement meet.
    calibrated = calibrate_sweep(plan, runs, spec, workload_for(request.workload, cfg),
                                 cluster_for(request.cluster, cfg), cfg.trainer.accelerator, ckpt, out)
    best, predicted, notes = compare(plan, runs, strategies, ckpt, offload, request.cluster.gpu_memory)
    if "calibration_error" in calibrated:
        notes.append(f"no step-time calibration: {calibrated['calibration_error']}")
    result = {
        "recipe": cfg.name, "steps": steps, "world_size": world, "out_dir": str(out),
        "measured_best": best, "plan_prediction": predicted,
        "plan_recommendation": plan["recommendation"], "agree": best == predicted if best and predicted else None,
        "notes": notes, "baseline_file": str(baseline_file) if baseline_tps else None, "runs": runs,
        "plan": plan, **calibrated,
    }
    write_json(out / "profile.json", result)
    sweep_report.write_report(result, out, wandb_enabled=bool(cfg.logging.wandb.enabled),
                              wandb_mode=cfg.logging.wandb.mode)
    measured_ok = successful(runs)
    print(f"measured best: {best or 'none (no run succeeded)'}"
          + (f" ({measured_ok[best]['measured']['step_ms']:.1f} ms per step, the fastest row of the report's "
             "table)" if best else ""))
    print(f"plan predicted: {predicted} among {', '.join(strategies)}; overall recommendation "
          f"{plan['recommendation']['label']}")
    print("agree" if result["agree"] else "disagree" if result["agree"] is False else "no comparison")
    for note in notes:
        print(f"  - {note}")
    for strategy, check in (calibrated.get("step_time_check") or {}).items():
        print(f"  {strategy}: calibrated step {check['predicted_step_s'] * 1e3:.1f} ms, measured "
              + (f"{check['measured_step_s'] * 1e3:.1f} ms ({check['error']:+.1%})" if check["measured_step_s"]
                 else "nothing"))
    print(f"report: {out / 'profile_report.md'}")
    failed = [s for s, r in runs.items() if "summary" not in r]
    return 1 if failed and not measured_ok else 0
