"""``shardlight profile``: a measured sweep of sharding strategies next to ``plan``'s prediction.

Each run is its own ``python -m shardlight.cli train RECIPE overrides... --summary-json`` process (one
Lightning fit per process), for ``--steps`` optimizer steps with the comm/memory/throughput callbacks. The
1-device baseline runs first (when the plan says the model fits on one device); its tokens/s/device is
written to ``baseline.json``, the file ``callbacks.throughput.baseline_file`` reads, and handed to the
strategy runs. The report (``profile_report.md``, ``profile.json``, PNG plots, a W&B table) reads each
run's ``csv/metrics.csv``.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from shardlight.errors import ShardlightError
from shardlight.planner.estimate import GB, STRATEGIES

REPO = Path(__file__).resolve().parents[2]
COMPARED = ("params", "grads", "optim")


def read_metrics(run_dir: Path) -> Dict[str, List[float]]:
    """Every logged value per key, in order (empty cells skipped)."""
    values: Dict[str, List[float]] = {}
    path = Path(run_dir) / "csv" / "metrics.csv"
    if not path.exists():
        return values
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            for key, cell in row.items():
                if cell not in (None, ""):
                    try:
                        values.setdefault(key, []).append(float(cell))
                    except ValueError:
                        pass
    return values


def summarize(metrics: Dict[str, List[float]], world_size: int) -> Dict[str, Any]:
    """The numbers the report needs from one run's metrics."""
    def last(key: str) -> Optional[float]:
        return metrics[key][-1] if metrics.get(key) else None

    def median(key: str) -> Optional[float]:
        return statistics.median(metrics[key]) if metrics.get(key) else None

    out: Dict[str, Any] = {
        "tokens_per_sec_per_device": median("throughput/tokens_per_sec_per_device"),
        "comm_total_ms": median("comm/total_ms"),
        "comm_exposed_ms": median("comm/exposed_ms"),
        "compute_ms": median("comm/compute_ms"),
        "overlap_pct": median("comm/overlap_pct"),
        "peak_gb": last("memory/peak_gb"),
    }
    for name in COMPARED:
        value = last(f"memory/{name}_gb")
        out[f"{name}_bytes"] = None if value is None else round(value * GB)
    out["peak_gb_per_rank"] = [last(f"memory/rank{r}/peak_gb") for r in range(world_size)]
    if out["comm_total_ms"] is not None and out["comm_exposed_ms"] is not None:
        out["comm_overlapped_ms"] = max(0.0, out["comm_total_ms"] - out["comm_exposed_ms"])
    return out


def run_one(recipe: Optional[str], overrides: List[str], out_dir: Path, tag: str, timeout: float) -> Dict[str, Any]:
    """One ``shardlight train`` subprocess; returns its summary (or the error) and its log path."""
    summary_path = out_dir / f"{tag}.summary.json"
    log_path = out_dir / f"{tag}.log"
    command = [sys.executable, "-m", "shardlight.cli", "train", *([recipe] if recipe else []), *overrides,
               "--summary-json", str(summary_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("LOCAL_RANK", "SHARDLIGHT_RUN_DIR", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    env.setdefault("WANDB_SILENT", "true")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"shardlight profile: running {tag} ...", flush=True)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(command, cwd=os.getcwd(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    result: Dict[str, Any] = {"tag": tag, "log": str(log_path), "returncode": code, "command": command}
    if code == 0 and summary_path.exists():
        result["summary"] = json.loads(summary_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path.exists() else []
        result["error"] = " | ".join(tail) or f"exit {code}"
        print(f"shardlight profile: {tag} failed ({code}); see {log_path}", flush=True)
    return result


def _rel(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def _match(rows: List[Dict[str, Any]], strategy: str, ckpt: bool, offload: bool) -> Optional[Dict[str, Any]]:
    for row in rows:
        if (row["sharding_strategy"] == strategy and row["activation_checkpointing"] == ckpt
                and row["cpu_offload"] == offload):
            return row
    return None


def profile(args: Any) -> int:
    from shardlight.cli.common import parse_number as _number
    from shardlight.cli.common import split_recipe_and_overrides as _split_recipe_and_overrides
    from shardlight.cli.common import write_json
    from shardlight.cli.planner import build_plan_from_args
    from shardlight.recipe import load_recipe
    from shardlight.planner.estimate import make_cluster
    from shardlight.planner.plan import make_plan, spec_from_recipe, workload_from_recipe
    from shardlight.planner.recommend import choose, label
    from shardlight.planner import report

    steps = _number("--steps", args.steps)
    timeout = _number("--timeout", args.timeout, float)
    recipe, overrides = _split_recipe_and_overrides(list(args.items or []))
    cfg = load_recipe(recipe, overrides)
    strategies = [s.strip().upper() for s in str(args.strategies).split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            raise ShardlightError(f"--strategies: unknown strategy '{s}'; known: {', '.join(STRATEGIES)}")
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    if "HYBRID_SHARD" in strategies and cfg.trainer.num_nodes < 2 and not cfg.fsdp.mesh_shape:
        strategies.remove("HYBRID_SHARD")
        print("shardlight profile: HYBRID_SHARD skipped (one node and no fsdp.mesh_shape)")
    if not strategies:
        raise ShardlightError("--strategies: nothing to run")
    if steps < 6:
        raise ShardlightError("--steps must be at least 6 (warm-up, one comm profiling window, throughput)")
    plan, _ = build_plan_from_args(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt, offload = bool(cfg.fsdp.activation_checkpointing), bool(cfg.fsdp.cpu_offload or cfg.fsdp.offload_params)
    log_every = 2
    common = [f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={log_every}",
              f"trainer.val_every_n_steps={steps * 10}", "trainer.limit_val_batches=1", "trainer.progress_bar=false",
              "callbacks.comm.first_step=2", f"callbacks.comm.every_n_steps={steps * 10}",
              f"callbacks.memory.every_n_steps={log_every}", f"callbacks.throughput.every_n_steps={log_every}",
              f"output_dir={out / 'runs'}"]
    runs: Dict[str, Dict[str, Any]] = {}
    baseline_tps = None
    baseline_file = out / "baseline.json"
    if not args.no_baseline:
        single = make_plan(spec_from_recipe(cfg), make_cluster(
            nodes=1, gpus_per_node=1, gpu_memory=args.gpu_memory, peak_tflops=float(args.peak_tflops),
            mfu=float(args.mfu), overhead_gb=float(args.overhead_gb)), workload_from_recipe(cfg))
        one = _match(single["strategies"], "NO_SHARD", ckpt, False)
        if one is not None and not one["fits"]:
            print(f"shardlight profile: baseline skipped: the plan says the model does not fit on one device "
                  f"({one['peak_bytes'] / GB:.1f} GB > {one['usable_bytes'] / GB:.1f} GB)")
        else:
            threads = []
            if cfg.trainer.accelerator == "cpu" and cfg.trainer.num_threads is None:
                # A CPU "device" is one rank and its threads: give the baseline what one sweep rank gets.
                threads = [f"trainer.num_threads={max(1, (os.cpu_count() or 1) // cfg.trainer.devices)}"]
            result = run_one(recipe, overrides + common + threads + [
                "trainer.devices=1", "trainer.num_nodes=1", "fsdp.sharding_strategy=NO_SHARD", "fsdp.mesh_shape=null",
                "name=profile-baseline"], out, "baseline", timeout)
            result["world_size"] = 1
            if "summary" in result:
                result["measured"] = summarize(read_metrics(Path(result["summary"]["run_dir"])), 1)
                baseline_tps = result["measured"]["tokens_per_sec_per_device"]
            runs["baseline"] = result
            if baseline_tps:
                write_json(str(baseline_file), {"tokens_per_sec_per_device": baseline_tps, "world_size": 1,
                                                "recipe": cfg.name, "steps": steps, "source": "shardlight profile"})
    for strategy in strategies:
        extra = [f"fsdp.sharding_strategy={strategy}", f"name=profile-{strategy.lower()}"]
        if baseline_tps:
            extra.append(f"callbacks.throughput.baseline_file={baseline_file}")
        result = run_one(recipe, overrides + common + extra, out, strategy.lower(), timeout)
        result["world_size"] = world
        if "summary" in result:
            result["measured"] = summarize(read_metrics(Path(result["summary"]["run_dir"])), world)
            tps = result["measured"]["tokens_per_sec_per_device"]
            result["measured"]["scaling_efficiency"] = tps / baseline_tps if tps and baseline_tps else None
        row = _match(plan["strategies"], strategy, ckpt, offload)
        if row is not None:
            result["predicted"] = {k: row[k] for k in ("params_bytes", "grads_bytes", "optim_bytes", "peak_bytes",
                                                       "activation_bytes", "logits_bytes", "comm_time_s",
                                                       "compute_time_s", "step_time_s", "bound", "fits",
                                                       "tokens_per_sec_per_device")}
            measured = result.get("measured", {})
            result["relative_error"] = {k: _rel(row[f"{k}_bytes"], measured.get(f"{k}_bytes")) for k in COMPARED}
        runs[strategy] = result

    measured_ok = {s: r for s, r in runs.items() if s != "baseline" and (r.get("measured") or {}).get(
        "tokens_per_sec_per_device")}
    best = max(measured_ok, key=lambda s: measured_ok[s]["measured"]["tokens_per_sec_per_device"]) \
        if measured_ok else None
    swept = [r for r in plan["strategies"] if r["sharding_strategy"] in strategies
             and r["activation_checkpointing"] == ckpt and r["cpu_offload"] == offload]
    predicted_row = choose(swept)
    predicted = predicted_row["sharding_strategy"] if predicted_row else None
    notes: List[str] = []
    if best and predicted and best != predicted:
        notes.append(f"measured best {best} differs from the plan's {predicted}: the plan's times assume "
                     f"{plan['cluster']['peak_tflops']:g} TFLOP/s at {plan['cluster']['mfu']:.0%} MFU and its "
                     f"interconnect; on this hardware measured communication/compute decide.")
    for s, r in runs.items():
        for k, err in (r.get("relative_error") or {}).items():
            if err is not None and abs(err) > 0.01:
                notes.append(f"{s}: predicted {k} bytes differ from the measured local shard by {err:+.1%}")
        pred, meas = r.get("predicted"), r.get("measured")
        if pred and meas and not pred["fits"]:
            notes.append(f"{s}: the plan says it does not fit in {args.gpu_memory}, yet it ran here")
    result = {
        "recipe": cfg.name, "steps": steps, "world_size": world, "out_dir": str(out),
        "measured_best": best, "plan_prediction": predicted,
        "plan_recommendation": plan["recommendation"], "agree": best == predicted if best and predicted else None,
        "notes": notes, "baseline_file": str(baseline_file) if baseline_tps else None, "runs": runs,
        "plan": plan,
    }
    write_json(str(out / "profile.json"), result)
    report.write_report(result, out, wandb_enabled=bool(cfg.logging.wandb.enabled), wandb_mode=cfg.logging.wandb.mode)
    print(f"measured best: {best or 'none (no run succeeded)'}"
          + (f" ({measured_ok[best]['measured']['tokens_per_sec_per_device']:.0f} tokens/s/device)" if best else ""))
    print(f"plan predicted: {predicted} among {', '.join(strategies)}; overall recommendation "
          f"{plan['recommendation']['label']}")
    print("agree" if result["agree"] else "disagree" if result["agree"] is False else "no comparison")
    for note in notes:
        print(f"  - {note}")
    print(f"report: {out / 'profile_report.md'}")
    failed = [s for s, r in runs.items() if "summary" not in r]
    return 1 if failed and not measured_ok else 0
