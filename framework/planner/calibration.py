"""Step-time calibration measured on the hardware at hand, instead of the table's bandwidths and peak × MFU.

A calibration comes from ``shardlight profile``'s runs: the 1-device baseline gives the achieved compute
rate (model FLOPs per step ÷ the compute time its trace measured) and the per-step host time that is
neither compute nor communication (optimizer bookkeeping, Python, the dataloader); the strategy runs' traces
give, per collective kind, ``time = latency + bus bytes / bus bandwidth`` fitted on their size buckets,
from transfer time (not wait time: waiting is the other rank's lateness, not the link), and the fraction
of communication that was exposed (gloo on CPU shares the cores with compute, so little overlaps).

A predicted step is then ``compute + host + exposed fraction × Σ collectives`` over the collectives the
strategy issues per optimizer step (``collectives_per_step``). The file is small and versioned; it is only
valid for the world size, device kind and backend it was measured with, and says so (``check_matches``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from shardlight.errors import ShardlightError
from shardlight.planner.estimate import Workload, shard_numels
from shardlight.planner.model_spec import ModelSpec
from shardlight.planner.runs import read_metrics
from shardlight.trace import analyze_traces

VERSION = 1
# Bytes each rank moves on the bus per byte of message (the convention of nccl-tests and shardlight.trace):
# a ring all-gather/reduce-scatter moves (n-1)/n of the full buffer, an all-reduce twice that.
BUS_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_reduce": lambda n: 2 * (n - 1) / n}
# Smaller messages time the collective's fixed cost only (64 KiB: about a microsecond at 50 GB/s).
LATENCY_ONLY_BYTES = 64 * 1024


def backend_for(accelerator: str) -> Tuple[str, str]:
    """(device kind, collective backend) the way shardlight trains: gloo on CPU, nccl on GPUs."""
    return ("cpu", "gloo") if accelerator == "cpu" else ("gpu", "nccl")


def fit_latency_bandwidth(buckets: Iterable[Dict[str, Any]], bus_factor: float) -> Optional[Dict[str, float]]:
    """Least squares of per-collective ``time = latency + bus bytes / busbw`` over size buckets, weighted by
    their counts. Messages under ``LATENCY_ONLY_BYTES`` carry no bandwidth information (a 4-byte gradient-norm
    all-reduce is all latency), so alone they give a latency and no bandwidth; with one larger message size
    latency and bandwidth cannot be told apart, and all of it is bandwidth."""
    points = [(b["count"], b["bytes"] * bus_factor / b["count"], b["transfer_us"] * 1e-6 / b["count"])
              for b in buckets if b.get("count") and b.get("transfer_us")]
    large = [p for p in points if p[1] >= LATENCY_ONLY_BYTES * bus_factor]
    if not large:
        if not points:
            return None
        count = sum(c for c, _, _ in points)
        return {"latency_s": sum(c * t for c, _, t in points) / count, "busbw_gbps": None, "samples": count,
                "sizes": len(points)}
    if len(large) < 2:
        points = large
    weight = sum(c for c, _, _ in points)
    mean_x = sum(c * x for c, x, _ in points) / weight
    mean_t = sum(c * t for c, _, t in points) / weight
    var = sum(c * (x - mean_x) ** 2 for c, x, _ in points)
    slope = sum(c * (x - mean_x) * (t - mean_t) for c, x, t in points) / var if var > 0 else 0.0
    latency = mean_t - slope * mean_x
    if var <= 0 or slope <= 0 or latency < 0:
        # A negative latency or slope is noise of a shared machine, not physics: fall back to bandwidth only.
        latency, slope = 0.0, mean_t / mean_x
    return {"latency_s": latency, "busbw_gbps": 1 / slope / 1e9, "samples": int(weight), "sizes": len(points)}


def trace_window(run_dir: Path) -> Dict[str, Any]:
    """The latest profiled window of one run, as ``shardlight.trace.analyze_traces`` reads it."""
    windows = sorted((Path(run_dir) / "traces").glob("step_*"))
    if not windows:
        raise ShardlightError(f"run {run_dir} has no traces/step_* window to calibrate from")
    return analyze_traces(windows[-1])


def per_step(ranks: Dict[str, Dict[str, Any]], key: str) -> float:
    """Seconds per step of ``key`` (a rank field or a ``split`` field), averaged over ranks."""
    values = []
    for rank in ranks.values():
        steps = max(1, (rank.get("split") or {}).get("steps") or rank.get("steps") or 1)
        value = rank.get(key, (rank.get("split") or {}).get(key))
        if value is not None:
            values.append(value * 1e-6 / steps)
    if not values:
        raise ShardlightError(f"the trace window has no '{key}' to calibrate from")
    return sum(values) / len(values)


def flops_per_step(spec: ModelSpec, work: Workload) -> float:
    """Model FLOPs one rank computes per optimizer step (as ``estimate`` counts them)."""
    flops = spec.flops_per_token(work.seq_len) * work.tokens_per_micro_batch * work.accumulate_grad_batches
    return flops * (4 / 6 if work.peft else 1)


def calibrate(baseline_dir: Path, strategy_dirs: Dict[str, Path], spec: ModelSpec, work: Workload,
              world_size: int, accelerator: str) -> Dict[str, Any]:
    """A calibration from the baseline run and one or more strategy runs (their run directories)."""
    if not strategy_dirs:
        raise ShardlightError("calibration needs at least one strategy run next to the baseline")
    base = trace_window(baseline_dir)["ranks"]
    baseline_compute_s = per_step(base, "compute_us")
    pooled: Dict[str, List[Dict[str, Any]]] = {}
    comm = exposed = compute_s = host_s = 0.0
    for run_dir in strategy_dirs.values():
        window = trace_window(run_dir)
        ranks = window["ranks"]
        comm += per_step(ranks, "transfer_us")
        exposed += per_step(ranks, "exposed_transfer_us")
        compute_s += per_step(ranks, "compute_us") / len(strategy_dirs)
        # Wall time that is neither compute nor transfer: optimizer bookkeeping, FSDP's Python hooks, and
        # waiting for the other rank (a skew a shared machine has whatever the strategy).
        host_s += max(0.0, per_step(ranks, "wall_us") - per_step(ranks, "compute_us")
                      - per_step(ranks, "exposed_transfer_us")) / len(strategy_dirs)
        for kind, stats in (window["summary"].get("bandwidth") or {}).items():
            if kind in BUS_FACTOR and (stats.get("group_size") or 0) == world_size:
                pooled.setdefault(kind, []).extend((stats.get("buckets") or {}).values())
    collectives = {kind: fit for kind, buckets in pooled.items()
                   if (fit := fit_latency_bandwidth(buckets, BUS_FACTOR[kind](world_size))) is not None}
    device, backend = backend_for(accelerator)
    return {
        "version": VERSION, "world_size": world_size, "device_kind": device, "backend": backend,
        # The rate ranks achieve side by side (they share memory bandwidth and, on CPU, cores); the
        # baseline's alone is the hardware's rate for one device.
        "achieved_tflops": flops_per_step(spec, work) / compute_s / 1e12,
        "baseline_tflops": flops_per_step(spec, work) / baseline_compute_s / 1e12,
        "host_overhead_s": host_s,
        "exposed_fraction": exposed / comm if comm > 0 else 1.0,
        "collectives": collectives,
        "calibrated_on": ["baseline", *strategy_dirs],
    }


def check_matches(calibration: Dict[str, Any], world_size: int, accelerator: Optional[str] = None,
                  source: str = "calibration") -> None:
    """A ShardlightError unless ``calibration`` was measured for this world size (and device kind)."""
    if calibration.get("version") != VERSION:
        raise ShardlightError(f"{source}: calibration version {calibration.get('version')!r} is not {VERSION}; "
                              f"re-run shardlight profile")
    if calibration.get("world_size") != world_size:
        raise ShardlightError(f"{source}: calibrated on {calibration.get('world_size')} ranks, the plan has "
                              f"{world_size}; profile on {world_size} ranks to calibrate for it")
    if accelerator is not None and calibration.get("device_kind") != backend_for(accelerator)[0]:
        raise ShardlightError(f"{source}: calibrated on {calibration.get('device_kind')}, the recipe trains on "
                              f"{backend_for(accelerator)[0]}")


def load_calibration(path: str) -> Dict[str, Any]:
    """The calibration in a ``profile.json`` (its ``calibration`` entry) or a standalone calibration file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ShardlightError(f"--calibration: cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ShardlightError(f"--calibration: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    calibration = data.get("calibration", data) if isinstance(data, dict) else None
    if not isinstance(calibration, dict) or "collectives" not in calibration or "achieved_tflops" not in calibration:
        raise ShardlightError(f"--calibration: {path} holds no calibration (run shardlight profile to make one)")
    return calibration


def unit_message_bytes(spec: ModelSpec, work: Workload, world_size: int) -> List[float]:
    """Each FSDP unit's flat parameter as FSDP communicates it (padded, compute dtype); the root unit last."""
    c = work.compute_bytes
    return [shard_numels(dataclasses.replace(spec, unit_numels=[unit]), world_size, c, False) * c
            for unit in spec.unit_numels]


def collectives_per_step(spec: ModelSpec, work: Workload, strategy: str, world_size: int) -> List[Tuple[str, float]]:
    """(kind, message bytes) of every gradient/parameter collective one optimizer step issues."""
    if world_size <= 1:
        return []
    units, steps = unit_message_bytes(spec, work, world_size), work.accumulate_grad_batches
    if strategy == "NO_SHARD":
        return [("all_reduce", b) for b in units]
    gathers = [("all_gather", b) for b in units] * steps
    if strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        gathers += [("all_gather", b) for b in units[:-1]] * steps  # the root stays gathered through backward
    return gathers + [("reduce_scatter", b) for b in units]


def collective_time(calibration: Dict[str, Any], kind: str, message_bytes: float) -> float:
    """Seconds for one collective; a kind the calibration did not see is priced from those it did (a ring
    all-reduce is a reduce-scatter then an all-gather; the two halves cost alike)."""
    fits, world = calibration["collectives"], calibration["world_size"]

    def priced(name: str) -> Optional[float]:
        fit = fits.get(name)
        if not fit or not fit.get("busbw_gbps"):
            return None
        return fit["latency_s"] + message_bytes * BUS_FACTOR[name](world) / (fit["busbw_gbps"] * 1e9)

    direct = priced(kind)
    if direct is not None:
        return direct
    halves = [priced(k) for k in ("reduce_scatter", "all_gather")]
    known = [h for h in halves if h is not None]
    if kind == "all_reduce" and known:
        return 2 * sum(known) / len(known)
    if kind in ("all_gather", "reduce_scatter"):
        if known:
            return known[0]
        whole = priced("all_reduce")
        if whole is not None:
            return whole / 2
    raise ShardlightError(f"the calibration measured no collective to price {kind} with; profile a sharded strategy")


def predict(calibration: Dict[str, Any], spec: ModelSpec, work: Workload, strategy: str,
            checkpointing: bool = False) -> Dict[str, float]:
    """Calibrated compute, communication, exposed communication and step time (seconds) of one strategy."""
    compute = flops_per_step(spec, work) / (calibration["achieved_tflops"] * 1e12) * (4 / 3 if checkpointing else 1)
    comm = sum(collective_time(calibration, kind, size)
               for kind, size in collectives_per_step(spec, work, strategy, calibration["world_size"]))
    exposed = comm * calibration["exposed_fraction"]
    return {"compute_time_s": compute, "comm_time_s": comm, "exposed_comm_s": exposed,
            "step_time_s": compute + calibration["host_overhead_s"] + exposed}


def apply_to_rows(rows: List[Dict[str, Any]], calibration: Dict[str, Any], spec: ModelSpec, work: Workload) -> None:
    """Replace the table-default times of every row (CPU offload keeps its own host transfer time on top)."""
    for row in rows:
        times = predict(calibration, spec, work, row["sharding_strategy"], row["activation_checkpointing"])
        times["step_time_s"] += row.get("offload_time_s") or 0.0
        row.update(times, time_source="calibration")
        row["bound"] = "comm-bound" if times["comm_time_s"] > times["compute_time_s"] else "compute-bound"
        step = times["step_time_s"]
        row["tokens_per_sec_per_device"] = row["tokens_per_step_per_rank"] / step if step > 0 else None


def measured_step_s(run_dir: Path) -> Optional[float]:
    """A run's measured step time: the median logged ``step/time_ms``, else its trace window's wall time
    (the slowest rank's: a step ends when every rank has finished it)."""
    logged = read_metrics(run_dir).get("step/time_ms")
    if logged:
        return sorted(logged)[len(logged) // 2] / 1e3
    ranks = trace_window(run_dir)["ranks"]
    walls = [r["split"]["wall_us"] * 1e-6 / max(1, r["split"].get("steps") or 1) for r in ranks.values()
             if (r.get("split") or {}).get("wall_us")]
    return max(walls) if walls else None


def step_time_check(calibration: Dict[str, Any], run_dirs: Dict[str, Path], spec: ModelSpec,
                    work: Workload, checkpointing: bool = False) -> Dict[str, Dict[str, Optional[float]]]:
    """Per strategy: the calibrated step time, the measured one and the relative error."""
    check = {}
    for strategy, run_dir in run_dirs.items():
        predicted = predict(calibration, spec, work, strategy, checkpointing)["step_time_s"]
        measured = measured_step_s(run_dir)
        check[strategy] = {"predicted_step_s": predicted, "measured_step_s": measured,
                           "error": (predicted - measured) / measured if measured else None,
                           "calibrated_on": strategy in calibration["calibrated_on"]}
    return check
