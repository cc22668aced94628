"""Step-time calibration: the latency/bandwidth fit, the collectives a strategy issues against a real trace,
the round trip ``shardlight profile`` → ``profile.json`` → ``shardlight plan --calibration`` on 2 gloo ranks,
and a calibration from another world size refused in one line."""

import json
from pathlib import Path

import pytest

from shardlight.build import build_hf_config
from shardlight.cli.main import main
from shardlight.planner.calibration import (
    BUS_FACTOR,
    LATENCY_ONLY_BYTES,
    VERSION,
    collective_time,
    collectives_per_step,
    fit_latency_bandwidth,
    predict,
    trace_window,
)
from shardlight.planner.inputs import Workload
from shardlight.planner.model_spec import ModelSpec
from shardlight.planner.plan import spec_from_recipe, workload_from_recipe
from shardlight.recipe import load_recipe


def synthetic_buckets(latency_s, busbw_gbps, sizes, count=4, world=2):
    """Size buckets as ``shardlight.trace`` reports them, for collectives that take latency + bus bytes / bw."""
    factor = BUS_FACTOR["all_gather"](world)
    return [{"count": count, "bytes": size * count,
             "transfer_us": count * (latency_s + size * factor / (busbw_gbps * 1e9)) * 1e6} for size in sizes]


def test_fit_recovers_latency_and_bandwidth_from_two_sizes():
    fit = fit_latency_bandwidth(synthetic_buckets(120e-6, 0.8, [256 * 1024, 4 * 2**20]), BUS_FACTOR["all_gather"](2))
    assert fit["latency_s"] == pytest.approx(120e-6, rel=1e-6)
    assert fit["busbw_gbps"] == pytest.approx(0.8, rel=1e-6)


def test_tiny_messages_are_latency_and_one_size_is_bandwidth():
    factor = BUS_FACTOR["all_reduce"](2)
    tiny = fit_latency_bandwidth([{"count": 2, "bytes": 8, "transfer_us": 300.0}], factor)
    assert tiny["latency_s"] == pytest.approx(150e-6) and tiny["busbw_gbps"] is None
    one = fit_latency_bandwidth([{"count": 3, "bytes": 3e6, "transfer_us": 3000.0}], factor)
    assert one["latency_s"] == 0 and one["busbw_gbps"] == pytest.approx(1.0)  # 1 MB per 1 ms


def test_unmeasured_kinds_priced_from_the_ring_halves():
    calibration = {"world_size": 2, "collectives": {
        "reduce_scatter": {"latency_s": 1e-4, "busbw_gbps": 0.5}, "all_gather": {"latency_s": 1e-4, "busbw_gbps": 0.5}}}
    half = collective_time(calibration, "reduce_scatter", 1e6)
    assert half == pytest.approx(1e-4 + 0.5e6 / 0.5e9)
    assert collective_time(calibration, "all_reduce", 1e6) == pytest.approx(2 * half)


def test_predicted_step_adds_compute_host_and_exposed_transfers():
    spec = ModelSpec(name="t", model_type="llama", total_params=3000, block_class="B", num_blocks=2,
                     block_params=1000, root_params=1000, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                     head_dim=4, intermediate_size=16, vocab_size=16, max_positions=128, tied_embeddings=False,
                     unit_numels=[[1000], [1000], [1000]])
    work = Workload(micro_batch_size=1, seq_len=8, precision="32-true")
    calibration = {"world_size": 2, "achieved_tflops": 1e-3, "host_overhead_s": 0.01, "exposed_fraction": 0.5,
                   "collectives": {"all_reduce": {"latency_s": 0.0, "busbw_gbps": 1.0}}}
    kinds = [kind for kind, _ in collectives_per_step(spec, work, "FULL_SHARD", 2)]
    assert kinds.count("all_gather") == 5 and kinds.count("reduce_scatter") == 3  # the root is not re-gathered
    times = predict(calibration, spec, work, "NO_SHARD")
    flops = spec.flops_per_token(8) * 8
    assert times["compute_time_s"] == pytest.approx(flops / 1e9)
    assert times["comm_time_s"] == pytest.approx(3 * 4000 / 1e9)  # 3 units x 4000 B x 2(n-1)/n at 1 GB/s
    assert times["step_time_s"] == pytest.approx(times["compute_time_s"] + 0.01 + 0.5 * times["comm_time_s"])


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not JSON"),
    (json.dumps({"runs": {}}), "holds no calibration"),
    (json.dumps({"version": VERSION, "world_size": 4, "device_kind": "cpu", "backend": "gloo",
                 "achieved_tflops": 1e-3, "host_overhead_s": 0.0, "exposed_fraction": 1.0, "collectives": {},
                 "calibrated_on": ["baseline", "FULL_SHARD"]}), "calibrated on 4 ranks, the plan has 2"),
    (json.dumps({"version": VERSION, "world_size": 2, "device_kind": "gpu", "backend": "nccl",
                 "achieved_tflops": 1e-3, "host_overhead_s": 0.0, "exposed_fraction": 1.0, "collectives": {},
                 "calibrated_on": ["baseline", "FULL_SHARD"]}), "calibrated on gpu, the recipe trains on cpu"),
])
def test_bad_calibration_file_is_one_line_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    code = main(["plan", "--analytic", "--calibration", str(path)])  # the default recipe: 2 CPU ranks
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.slow
def test_profile_calibrates_and_plan_reads_it_back(profile_sweep, tmp_path, capsys):
    """A real sweep on 2 gloo ranks (the baseline and three strategies): the calibration in profile.json, its
    collectives the ones the traces show, and ``shardlight plan --calibration`` giving the same step times."""
    out, _ = profile_sweep
    report = json.loads((out / "profile.json").read_text())
    calibration = report["calibration"]
    assert calibration == json.loads((out / "calibration.json").read_text())
    assert (calibration["version"], calibration["world_size"], calibration["device_kind"],
            calibration["backend"]) == (VERSION, 2, "cpu", "gloo")
    assert calibration["achieved_tflops"] > 0 and calibration["baseline_tflops"] > 0
    assert 0 <= calibration["exposed_fraction"] <= 1 and calibration["host_overhead_s"] >= 0
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        assert calibration["collectives"][kind]["busbw_gbps"] > 0, kind

    # The collectives the prediction prices are the ones each run's trace recorded, count and bytes.
    plan_json = tmp_path / "plan.json"
    assert main(["plan", "--analytic", "--calibration", str(out / "profile.json"), "--json", str(plan_json),
                 "logging.wandb.enabled=false"]) == 0
    text = capsys.readouterr().out
    assert "time: calibrated by shardlight profile on 2 cpu ranks" in text
    planned = json.loads(plan_json.read_text())
    assert planned["time_source"] == "calibration"
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
        run_dir = Path(report["runs"][strategy]["summary"]["run_dir"])
        cfg = load_recipe(str(run_dir / "recipe.yaml"), [])
        spec, work = spec_from_recipe(cfg, build_hf_config(cfg.model)), workload_from_recipe(cfg)
        window = trace_window(run_dir)
        traced = window["summary"]["bandwidth"]
        steps = {r["split"]["steps"] for r in window["ranks"].values()}  # analysed steps of the window
        assert len(steps) == 1 and steps.pop() == 2  # 6 steps: one window, its steps 3 and 4 analysed
        issued = collectives_per_step(spec, work, strategy, 2)
        for kind in {k for k, _ in issued}:
            sizes = [size for k, size in issued if k == kind]
            # The parameter/gradient collectives; the step that logs metrics syncs a few bytes besides them.
            large = [b for b in traced[kind]["buckets"].values() if b["bytes"] / b["count"] >= LATENCY_ONLY_BYTES]
            assert sum(b["count"] for b in large) == 2 * len(sizes), (strategy, kind)
            assert sum(b["bytes"] for b in large) == pytest.approx(2 * sum(sizes), rel=1e-6), (strategy, kind)
        # Round trip: the plan's calibrated step time is the one the profile predicted from the same file.
        check = report["step_time_check"][strategy]
        row = next(r for r in planned["strategies"] if r["sharding_strategy"] == strategy
                   and not r["activation_checkpointing"] and not r["cpu_offload"])
        assert row["step_time_s"] == pytest.approx(check["predicted_step_s"], rel=1e-9)
        assert check["measured_step_s"] > 0
        assert check["error"] == pytest.approx((check["predicted_step_s"] - check["measured_step_s"])
                                               / check["measured_step_s"])
    markdown = (out / "profile_report.md").read_text()
    assert "## Step time: calibrated prediction vs measured" in markdown
    assert "| NO_SHARD |" in markdown and "| SHARD_GRAD_OP |" in markdown and "| FULL_SHARD |" in markdown

    # The same file planned for 4 ranks is refused in one line, exit 2.
    code = main(["plan", "--analytic", "--calibration", str(out / "calibration.json"), "--gpus-per-node", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "calibrated on 2 ranks, the plan has 4" in err, err
