"""Step-time calibration measured on the hardware at hand, instead of the table's bandwidths and peak × MFU.

A calibration comes from ``shardlight profile``'s runs: the 1-device baseline gives the achieved compute
rate of one device alone (model FLOPs per step ÷ the compute time its trace measured; the strategy runs give
the rate ranks achieve side by side, the one predictions use); the strategy runs' traces
give, per collective kind, ``time = latency + bus bytes / bus bandwidth`` fitted on their size buckets,
from transfer time (not wait time: waiting is the other rank's lateness, not the link), the fraction
of communication that was exposed (gloo on CPU shares the cores with compute, so little overlaps), and the
host time each collective adds (FSDP's Python hooks around it, the ranks meeting at it): the strategies'
host times (wall less compute less the exposed part of the collectives the model prices) against the number
of collectives they issue (with one strategy, its host time and nothing per collective).

A predicted step is then ``compute + host + host per collective × N + exposed fraction × Σ collectives``
over the N collectives the strategy issues per optimizer step (``collectives_per_step``).

Every number is a median over steps, not one sample: each run's profiled windows (``traces/step_*``; the
first is dropped when there are more, it carries the profiler's start-up) give one sample per analysed step
(the ranks' mean); steps whose compute took over ``QUIET_COMPUTE`` × the run's fastest are dropped (the
machine's other load slowed them: the FLOPs are the same every step), and a collective's time per size bucket
is the median over the windows. Several runs of one configuration (repeated sweeps) give the median of their
medians. The measured step time a prediction is checked against (``measured_step_s``) is the same statistic
of the same kind of steps: the median over the quiet analysed steps of the ranks' mean wall time.

The file is small and versioned (``VERSION``; version 1 files, without ``host_per_collective_s``, still
read); it is only valid for the world size, device kind and backend it was measured with, and says so
(``check_matches``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from shardlight.errors import ShardlightError
from shardlight.planner.inputs import Workload
from shardlight.planner.memory_estimate import shard_numels
from shardlight.planner.model_spec import ModelSpec
from shardlight.planner.runs import read_metrics
from shardlight.trace import analyze_traces

VERSION = 2
# Versions this reader understands: 1 lacks host_per_collective_s (read as 0, its host time is the strategy's).
READABLE_VERSIONS = (1, 2)
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


def window_dirs(run_dir: Path) -> List[Path]:
    """The run's profiled windows, oldest first."""
    return sorted((Path(run_dir) / "traces").glob("step_*"))


def trace_window(run_dir: Path) -> Dict[str, Any]:
    """The latest profiled window of one run, as ``shardlight.trace.analyze_traces`` reads it."""
    windows = window_dirs(run_dir)
    if not windows:
        raise ShardlightError(f"run {run_dir} has no traces/step_* window to calibrate from")
    return analyze_traces(windows[-1])


def trace_windows(run_dir: Path) -> List[Dict[str, Any]]:
    """Every profiled window of one run but the first when there are more: the first carries the profiler's
    one-time start-up (and sits nearest the first steps' allocations)."""
    windows = window_dirs(run_dir)
    if not windows:
        raise ShardlightError(f"run {run_dir} has no traces/step_* window to calibrate from")
    return [analyze_traces(w) for w in (windows[1:] if len(windows) > 1 else windows)]


# A step whose compute took longer than this × the run's fastest step's was slowed by other load (``quiet``).
QUIET_COMPUTE = 1.25
STEP_KEYS = ("wall_us", "compute_us", "transfer_us", "exposed_transfer_us")


def step_samples(windows: Iterable[Dict[str, Any]]) -> List[Dict[str, float]]:
    """One sample per analysed step of every window: seconds of wall, compute, transfer and exposed transfer,
    each the mean over the ranks that analysed that step. A window whose ranks carry no per-step split gives
    its whole-window average per step instead (one sample)."""
    samples = []
    for window in windows:
        ranks = list(window["ranks"].values())
        names = set.intersection(*({k for k in (r.get("steps") or {}) if k.isdigit()} for r in ranks)) \
            if ranks else set()
        steps = [[r["steps"][name] for r in ranks] for name in sorted(names, key=int)]
        steps = [per_rank for per_rank in steps if all(all(m.get(k) is not None for k in STEP_KEYS) for m in per_rank)]
        if steps:
            samples += [{k[:-3] + "_s": sum(m[k] for m in per_rank) * 1e-6 / len(per_rank) for k in STEP_KEYS}
                        for per_rank in steps]
        else:
            samples.append({k[:-3] + "_s": per_step(window["ranks"], k) for k in STEP_KEYS})
    return samples


def quiet(samples: List[Dict[str, float]]) -> List[Dict[str, float]]:
    """The steps the machine's other load did not slow: a step computes the same FLOPs every time, so one whose
    compute took over ``QUIET_COMPUTE`` × the run's fastest was sharing its cores (on a shared 2-core
    machine a load spike doubles a step); the rest are the run's steps."""
    fastest = min(s["compute_s"] for s in samples)
    return [s for s in samples if s["compute_s"] <= QUIET_COMPUTE * fastest] if fastest > 0 else samples


def run_samples(windows: Iterable[Dict[str, Any]]) -> List[Dict[str, float]]:
    """The quiet analysed steps of one run's windows: what every median here is taken over."""
    return quiet(step_samples(windows))


def median_of(samples: List[Dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def step_frame(run_dir: Path) -> Optional[Dict[str, float]]:
    """One run's step, the numbers ``shardlight profile`` prints, tabulates and plots (one frame, three views), in
    ms: ``step_ms`` (``measured_step_s``'s statistic: the median over the quiet analysed steps), ``compute_ms``
    and ``exposed_transfer_ms`` (medians over the same steps) and ``other_ms``, the rest of the step (host work,
    waits), so the three parts add up to it. None when the run has no traces."""
    try:
        samples = run_samples(trace_windows(run_dir))
    except ShardlightError:
        return None
    if not samples:
        return None
    step = median_of(samples, "wall_s")
    compute = min(median_of(samples, "compute_s"), step)
    exposed = min(median_of(samples, "exposed_transfer_s"), step - compute)
    return {"step_ms": 1e3 * step, "compute_ms": 1e3 * compute, "exposed_transfer_ms": 1e3 * exposed,
            "other_ms": 1e3 * (step - compute - exposed)}


def host_s(sample: Dict[str, float]) -> float:
    """Wall time that is neither compute nor exposed transfer: optimizer bookkeeping, FSDP's Python hooks, and
    waiting for the other rank (a skew a shared machine has whatever the strategy)."""
    return max(0.0, sample["wall_s"] - sample["compute_s"] - sample["exposed_transfer_s"])


def robust_buckets(windows: Iterable[Dict[str, Any]], world_size: int) -> Dict[str, List[Dict[str, Any]]]:
    """Per collective kind, its size buckets with each bucket's time per collective the median over the
    windows (one slow window does not move it) and its count the windows' total."""
    per: Dict[Tuple[str, str], List[Tuple[int, float, float]]] = {}
    for window in windows:
        for kind, stats in (window["summary"].get("bandwidth") or {}).items():
            if kind not in BUS_FACTOR or (stats.get("group_size") or 0) != world_size:
                continue
            for name, b in (stats.get("buckets") or {}).items():
                if b.get("count") and b.get("transfer_us"):
                    per.setdefault((kind, name), []).append((b["count"], b["bytes"] / b["count"],
                                                             b["transfer_us"] / b["count"]))
    pooled: Dict[str, List[Dict[str, Any]]] = {}
    for (kind, _), points in per.items():
        count = sum(c for c, _, _ in points)
        pooled.setdefault(kind, []).append({"count": count, "bytes": count * statistics.median(x for _, x, _ in points),
                                            "transfer_us": count * statistics.median(t for _, _, t in points)})
    return pooled


def fit_host(points: List[Tuple[float, float]]) -> Tuple[float, float]:
    """(host per step, host per collective) by least squares of host time on collectives issued; a negative
    slope (noise) or a single point gives the mean host time and nothing per collective."""
    mean_n = sum(n for n, _ in points) / len(points)
    mean_h = sum(h for _, h in points) / len(points)
    var = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (h - mean_h) for n, h in points) / var if var > 0 else 0.0
    if slope <= 0 or mean_h - slope * mean_n < 0:
        return mean_h, 0.0
    return mean_h - slope * mean_n, slope


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


RunDirs = Union[Path, Sequence[Path]]


def as_runs(dirs: RunDirs) -> List[Path]:
    """One run directory or several runs of the same configuration (repeated sweeps)."""
    return [Path(dirs)] if isinstance(dirs, (str, Path)) else [Path(d) for d in dirs]


def across_runs(per_run: List[List[Dict[str, float]]], value: Callable[[Dict[str, float]], float]) -> float:
    """The median over runs of each run's median over its steps: a step slow in one run, or a whole run slowed by
    the machine's other load while its siblings were not, does not move it."""
    return statistics.median(statistics.median(value(s) for s in samples) for samples in per_run)


def calibrate(baseline_dir: RunDirs, strategy_dirs: Dict[str, RunDirs], spec: ModelSpec, work: Workload,
              world_size: int, accelerator: str) -> Dict[str, Any]:
    """A calibration from the baseline run and one or more strategy runs (their run directories; each may be
    a list of repeated runs of the same configuration)."""
    if not strategy_dirs:
        raise ShardlightError("calibration needs at least one strategy run next to the baseline")
    base = [run_samples(trace_windows(run)) for run in as_runs(baseline_dir)]
    baseline_compute_s = across_runs(base, lambda s: s["compute_s"])
    windows: List[Dict[str, Any]] = []
    comm = exposed = compute_s = 0.0
    samples = {"baseline": sum(map(len, base))}
    strategy_samples = {}
    for strategy, run_dirs in strategy_dirs.items():
        per_run = []
        for run in as_runs(run_dirs):
            analysed = trace_windows(run)
            windows += analysed
            per_run.append(run_samples(analysed))
        samples[strategy] = sum(map(len, per_run))
        strategy_samples[strategy] = per_run
        comm += across_runs(per_run, lambda s: s["transfer_s"])
        exposed += across_runs(per_run, lambda s: s["exposed_transfer_s"])
        compute_s += across_runs(per_run, lambda s: s["compute_s"]) / len(strategy_dirs)
    collectives = {kind: fit for kind, buckets in robust_buckets(windows, world_size).items()
                   if (fit := fit_latency_bandwidth(buckets, BUS_FACTOR[kind](world_size))) is not None}
    exposed_fraction = exposed / comm if comm > 0 else 1.0
    priced = {"world_size": world_size, "collectives": collectives, "backend": backend_for(accelerator)[1]}
    # Host time: what the step's wall time leaves after compute and the exposed part of the collectives the
    # model prices (the trace's small extras, a gradient-norm all-reduce, metric syncs, fall in it too), fitted
    # on the collectives issued over the strategy runs only. Not the baseline at zero collectives: one process
    # alone on the machine has no rank to wait for and no sibling to share the cores with, and with it as the
    # intercept one strategy's 2-rank overhead became a per-collective cost, extrapolated (on 2 loaded CPU
    # ranks, NO_SHARD -> FULL_SHARD predicted +33% on average, at the measured run's compute rate, against
    # -2% without it). One strategy: its host time, nothing per collective.
    host_points = []
    for strategy, per_run in strategy_samples.items():
        issued = collectives_per_step(spec, work, strategy, world_size)
        try:
            modelled = exposed_fraction * sum(collective_time(priced, kind, size) for kind, size in issued)
        except ShardlightError:
            modelled = across_runs(per_run, lambda s: s["exposed_transfer_s"])
        host_points.append((float(len(issued)),
                            max(0.0, across_runs(per_run, lambda s: s["wall_s"] - s["compute_s"]) - modelled)))
    host, per_collective = fit_host(host_points)
    device, backend = backend_for(accelerator)
    return {
        "version": VERSION, "world_size": world_size, "device_kind": device, "backend": backend,
        # The rate ranks achieve side by side (they share memory bandwidth and, on CPU, cores); the
        # baseline's alone is the hardware's rate for one device.
        "achieved_tflops": flops_per_step(spec, work) / compute_s / 1e12,
        "baseline_tflops": flops_per_step(spec, work) / baseline_compute_s / 1e12,
        "host_overhead_s": host,
        "host_per_collective_s": per_collective,
        "baseline_host_s": across_runs(base, host_s),
        "exposed_fraction": exposed_fraction,
        "collectives": collectives,
        "calibrated_on": ["baseline", *strategy_dirs],
        "statistic": "median over analysed steps (then over runs)",
        "samples": samples,
    }


def check_matches(calibration: Dict[str, Any], world_size: int, accelerator: Optional[str] = None,
                  source: str = "calibration") -> None:
    """A ShardlightError unless ``calibration`` was measured for this world size (and device kind)."""
    if calibration.get("version") not in READABLE_VERSIONS:
        raise ShardlightError(f"{source}: calibration version {calibration.get('version')!r} is not one of "
                              f"{', '.join(map(str, READABLE_VERSIONS))}; re-run shardlight profile")
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
    issued = collectives_per_step(spec, work, strategy, calibration["world_size"])
    comm = sum(collective_time(calibration, kind, size) for kind, size in issued)
    exposed = comm * calibration["exposed_fraction"]
    host = calibration["host_overhead_s"] + (calibration.get("host_per_collective_s") or 0.0) * len(issued)
    return {"compute_time_s": compute, "comm_time_s": comm, "exposed_comm_s": exposed, "host_time_s": host,
            "step_time_s": compute + host + exposed}


def apply_to_rows(rows: List[Dict[str, Any]], calibration: Dict[str, Any], spec: ModelSpec, work: Workload) -> None:
    """Replace the table-default times of every row (CPU offload keeps its own host transfer time on top)."""
    for row in rows:
        times = predict(calibration, spec, work, row["sharding_strategy"], row["activation_checkpointing"])
        times["step_time_s"] += row.get("offload_time_s") or 0.0
        row.update(times, time_source="calibration")
        row["bound"] = "comm-bound" if times["comm_time_s"] > times["compute_time_s"] else "compute-bound"
        step = times["step_time_s"]
        row["tokens_per_sec_per_device"] = row["tokens_per_step_per_rank"] / step if step > 0 else None


def measured_step_s(run_dir: RunDirs, key: str = "wall_s") -> Optional[float]:
    """A run's measured step time, the statistic the calibration takes of its inputs: the median over the
    quiet analysed steps of its profiled windows (all but the first when there are more) of the ranks' mean
    wall time (of several runs: the median of theirs); without traces, the median logged ``step/time_ms``.
    ``key="compute_s"``: the same of its compute time."""
    runs = as_runs(run_dir)
    if all(window_dirs(run) for run in runs):
        return across_runs([run_samples(trace_windows(run)) for run in runs], lambda s: s[key])
    logged = [v for run in runs for v in read_metrics(run).get("step/time_ms", [])] if key == "wall_s" else []
    return statistics.median(logged) / 1e3 if logged else None


def step_time_check(calibration: Dict[str, Any], run_dirs: Dict[str, RunDirs], spec: ModelSpec,
                    work: Workload, checkpointing: bool = False) -> Dict[str, Dict[str, Optional[float]]]:
    """Per strategy: the calibrated step time, the measured one and the relative error; ``compute_ratio`` is the
    measured run's compute time over the calibrated one: far from 1, the machine computed at another rate
    while that run ran (other load), and the error is the machine's rather than the model's;
    ``error_at_measured_rate`` the error of the prediction scaled by it (a diagnostic of the model's form: on CPU
    every part of a step, host work and gloo transfers too, slows with the share of the cores it gets)."""
    check = {}
    for strategy, run_dir in run_dirs.items():
        times = predict(calibration, spec, work, strategy, checkpointing)
        predicted = times["step_time_s"]
        measured = measured_step_s(run_dir)
        compute = measured_step_s(run_dir, "compute_s") if measured else None
        ratio = compute / times["compute_time_s"] if compute else None
        check[strategy] = {"predicted_step_s": predicted, "measured_step_s": measured,
                           "error": (predicted - measured) / measured if measured else None,
                           "compute_ratio": ratio,
                           "error_at_measured_rate": (predicted * ratio - measured) / measured if ratio else None,
                           "calibrated_on": strategy in calibration["calibrated_on"]}
    return check
