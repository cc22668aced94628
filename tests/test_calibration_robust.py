"""Calibration that one slow step or window does not move: truth by construction.

Synthetic trace analyses (the dicts ``shardlight.trace.analyze_traces`` returns) are built from a known compute
rate, host time per step, host time per collective and collective latency + bandwidth, with outliers injected
(a start-up window everything in is slow, one step whose compute is tripled, one whose host time is 50 ms
longer, one window whose collectives are slow); the calibration must recover the known numbers exactly and predict the left-out strategy's step time,
and the measured step time must be the clean one. Plus: the sweep's profiling windows (several, the first after
step 1), and a version 1 calibration file still read while an unknown version is one line, exit 2.
"""

import json
from pathlib import Path

import pytest

from shardlight.callbacks.comm import CommTimeCallback
from shardlight.cli.main import main
from shardlight.planner import calibration as cal
from shardlight.planner.inputs import Workload
from shardlight.planner.model_spec import ModelSpec
from shardlight.planner.sweep import sweep_overrides, window_schedule
from shardlight.recipe import load_recipe

WORLD = 2
RATE_TFLOPS = 2e-3          # the ranks' achieved compute rate
BASE_RATE_TFLOPS = 3e-3     # the baseline's, alone on the machine
HOST_S = 0.010              # host time per step of a step with no collective
HOST_PER_COLLECTIVE_S = 0.0015
EXPOSED = 0.8               # fraction of transfer time exposed
LATENCY_S, BUSBW_GBPS = 200e-6, 0.5
STEPS_PER_WINDOW = 3

SPEC = ModelSpec(name="t", model_type="llama", total_params=500_000, block_class="B", num_blocks=2,
                 block_params=100_000, root_params=300_000, hidden_size=64, num_layers=2, num_heads=2,
                 num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=1000, max_positions=128,
                 tied_embeddings=False, unit_numels=[[100_000], [100_000], [300_000]])
WORK = Workload(micro_batch_size=2, seq_len=16, precision="32-true")


def truth_collective_s(kind, size):
    """A ring: an all-reduce is a reduce-scatter then an all-gather (two latencies, its bus bytes at one bw)."""
    return LATENCY_S * (2 if kind == "all_reduce" else 1) + size * cal.BUS_FACTOR[kind](WORLD) / (BUSBW_GBPS * 1e9)


def truth_step(strategy, world=WORLD, rate=RATE_TFLOPS):
    """(compute, transfer, step seconds) of one clean step, by the model the calibration fits."""
    compute = cal.flops_per_step(SPEC, WORK) / (rate * 1e12)
    issued = cal.collectives_per_step(SPEC, WORK, strategy, world)
    transfer = sum(truth_collective_s(kind, size) for kind, size in issued)
    host = HOST_S + HOST_PER_COLLECTIVE_S * len(issued)
    return compute, transfer, compute + host + EXPOSED * transfer


def window(strategy, first_step, world=WORLD, rate=RATE_TFLOPS, slow=1.0, slow_compute_step=None,
           slow_host_step=None, slow_collectives=1.0):
    """One window's analysis: ``STEPS_PER_WINDOW`` analysed steps per rank and the bandwidth buckets."""
    compute, transfer, step = truth_step(strategy, world, rate)
    steps = {}
    for i in range(STEPS_PER_WINDOW):
        extra = 2 * compute if i == slow_compute_step else 0.0
        host_extra = 0.05 if i == slow_host_step else 0.0
        steps[str(first_step + i)] = {"wall_us": (step * slow + extra + host_extra) * 1e6, "compute_us": (compute * slow + extra) * 1e6,
                                      "transfer_us": transfer * slow * 1e6,
                                      "exposed_transfer_us": EXPOSED * transfer * slow * 1e6}
    ranks = {str(r): {"steps": {k: dict(v) for k, v in steps.items()}} for r in range(world)}
    bandwidth = {}
    if world > 1:
        for kind, size in cal.collectives_per_step(SPEC, WORK, strategy, world):
            stats = bandwidth.setdefault(kind, {"group_size": world, "buckets": {}})
            bucket = stats["buckets"].setdefault(f"{size:.0f}B", {"count": 0, "bytes": 0.0, "transfer_us": 0.0})
            bucket["count"] += STEPS_PER_WINDOW
            bucket["bytes"] += STEPS_PER_WINDOW * size
            bucket["transfer_us"] += STEPS_PER_WINDOW * truth_collective_s(kind, size) * slow * slow_collectives * 1e6
    return {"ranks": ranks, "summary": {"bandwidth": bandwidth}}


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Run directories with four windows each: a slow start-up window, then three with one outlier each."""
    analyses = {}

    def make(name, strategy, world=WORLD, rate=RATE_TFLOPS):
        run = tmp_path / name
        plan = [dict(slow=3.0), dict(slow_host_step=2), dict(slow_compute_step=1), dict(slow_collectives=4.0)]
        for n, kwargs in enumerate(plan):
            first = 2 + 10 * n
            directory = run / "traces" / f"step_{first:06d}"
            directory.mkdir(parents=True)
            analyses[str(directory)] = window(strategy, first + 1, world, rate, **kwargs)
        return run

    dirs = {"baseline": make("baseline", "NO_SHARD", world=1, rate=BASE_RATE_TFLOPS),
            **{s: make(s.lower(), s) for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")}}
    monkeypatch.setattr(cal, "analyze_traces", lambda path: analyses[str(path)])
    return dirs


TWO = ("SHARD_GRAD_OP", "FULL_SHARD")


def test_calibration_recovers_the_known_rates_despite_outliers(runs):
    calibration = cal.calibrate(runs["baseline"], {s: runs[s] for s in TWO}, SPEC, WORK, WORLD, "cpu")
    assert calibration["version"] == cal.VERSION
    assert calibration["achieved_tflops"] == pytest.approx(RATE_TFLOPS, rel=1e-9)
    assert calibration["baseline_tflops"] == pytest.approx(BASE_RATE_TFLOPS, rel=1e-9)
    assert calibration["host_overhead_s"] == pytest.approx(HOST_S, rel=1e-9)
    assert calibration["host_per_collective_s"] == pytest.approx(HOST_PER_COLLECTIVE_S, rel=1e-9)
    assert calibration["exposed_fraction"] == pytest.approx(EXPOSED, rel=1e-9)
    for kind in ("all_gather", "reduce_scatter"):
        fit = calibration["collectives"][kind]
        assert fit["latency_s"] == pytest.approx(LATENCY_S, rel=1e-6), kind
        assert fit["busbw_gbps"] == pytest.approx(BUSBW_GBPS, rel=1e-6), kind
    # The start-up window is left out (three windows of three analysed steps), and the step whose compute
    # took three times as long as the others (other load on the machine) too.
    assert calibration["samples"] == {"baseline": 8, "SHARD_GRAD_OP": 8, "FULL_SHARD": 8}
    assert calibration["baseline_host_s"] == pytest.approx(HOST_S, rel=1e-9)


def test_left_out_strategy_predicted_and_measured_on_clean_steps(runs):
    calibration = cal.calibrate(runs["baseline"], {s: runs[s] for s in TWO}, SPEC, WORK, WORLD, "cpu")
    check = cal.step_time_check(calibration, {s: runs[s] for s in ("NO_SHARD", "FULL_SHARD")}, SPEC, WORK)
    for strategy, row in check.items():
        assert row["measured_step_s"] == pytest.approx(truth_step(strategy)[2], rel=1e-9), strategy
        assert row["predicted_step_s"] == pytest.approx(truth_step(strategy)[2], rel=1e-9), strategy
        assert abs(row["error"]) < 1e-9 and row["compute_ratio"] == pytest.approx(1.0)
    assert check["FULL_SHARD"]["calibrated_on"] and not check["NO_SHARD"]["calibrated_on"]


def test_one_strategy_keeps_its_host_time_and_prices_nothing_per_collective(runs):
    """The baseline (one process alone) is not the zero-collective point of the host fit: with one strategy
    the host time is that strategy's, the rest recovered as with two."""
    calibration = cal.calibrate(runs["baseline"], {"FULL_SHARD": runs["FULL_SHARD"]}, SPEC, WORK, WORLD, "cpu")
    issued = len(cal.collectives_per_step(SPEC, WORK, "FULL_SHARD", WORLD))
    assert calibration["host_per_collective_s"] == 0
    assert calibration["host_overhead_s"] == pytest.approx(HOST_S + HOST_PER_COLLECTIVE_S * issued, rel=1e-9)
    assert calibration["achieved_tflops"] == pytest.approx(RATE_TFLOPS, rel=1e-9)
    check = cal.step_time_check(calibration, {"FULL_SHARD": runs["FULL_SHARD"]}, SPEC, WORK)
    assert abs(check["FULL_SHARD"]["error"]) < 1e-9


def test_one_window_is_used_whole_and_the_latest_window_still_reads(tmp_path, monkeypatch):
    """A short run has one window: it is the calibration's (nothing to drop), median over its steps."""
    directory = tmp_path / "run" / "traces" / "step_000002"
    directory.mkdir(parents=True)
    analysis = window("FULL_SHARD", 3, slow_compute_step=0)
    monkeypatch.setattr(cal, "analyze_traces", lambda path: analysis)
    assert cal.trace_window(tmp_path / "run") is analysis
    samples = cal.step_samples(cal.trace_windows(tmp_path / "run"))
    assert len(samples) == STEPS_PER_WINDOW
    assert cal.median_of(samples, "compute_s") == pytest.approx(truth_step("FULL_SHARD")[0], rel=1e-9)
    assert cal.measured_step_s(tmp_path / "run") == pytest.approx(truth_step("FULL_SHARD")[2], rel=1e-9)


def test_host_fit_ignores_a_negative_slope():
    assert cal.fit_host([(3.0, 0.0145), (8.0, 0.022)]) == pytest.approx((0.01, 0.0015))
    assert cal.fit_host([(3.0, 0.02), (8.0, 0.01)]) == pytest.approx((0.015, 0.0))
    assert cal.fit_host([(8.0, 0.022)]) == pytest.approx((0.022, 0.0))


def sweep_windows(steps):
    """The windows a sweep run of ``steps`` steps records, the way ``CommTimeCallback`` schedules them: no window
    starts before the previous one's results are gathered, ``gather_delay`` steps after its last step."""
    schedule = window_schedule(steps)
    callback = CommTimeCallback(Path("unused"), every_n_steps=schedule["every_n_steps"],
                                first_step=schedule["first_step"], warmup=schedule["warmup"],
                                active=schedule["active"])
    starts, end = [], -1
    for step in range(steps):
        if step >= end and callback.is_window_start(step, steps):
            starts.append(step)
            end = step + callback.length + callback.gather_delay
    return starts, schedule["active"] - 1


@pytest.mark.parametrize("steps,starts,analysed", [(6, [2], 2), (8, [2], 4), (40, [2, 15, 30], 6)])
def test_sweep_records_several_windows_after_the_first_step(steps, starts, analysed):
    assert sweep_windows(steps) == (starts, analysed)
    cfg = load_recipe(None, sweep_overrides(steps, Path("/tmp/out")))
    assert cfg.callbacks.comm.first_step == 2 and cfg.callbacks.comm.keep_windows is None
    assert cfg.callbacks.comm.judged_windows == 1  # the schedule above is the whole of it: no window added


def test_version_1_file_reads_and_an_unknown_version_is_one_line(tmp_path, capsys):
    v1 = {"version": 1, "world_size": 2, "device_kind": "cpu", "backend": "gloo", "achieved_tflops": 1e-3,
          "host_overhead_s": 0.01, "exposed_fraction": 1.0,
          "collectives": {"all_reduce": {"latency_s": 0.0, "busbw_gbps": 1.0}}, "calibrated_on": ["baseline"]}
    cal.check_matches(v1, 2, "cpu")
    times = cal.predict(v1, SPEC, WORK, "NO_SHARD")
    assert times["host_time_s"] == 0.01  # version 1: the host time is the whole of it
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(v1))
    assert main(["plan", "--analytic", "--calibration", str(path)]) == 0
    capsys.readouterr()
    path.write_text(json.dumps(dict(v1, version=99)))
    assert main(["plan", "--analytic", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "calibration version 99" in err, err
