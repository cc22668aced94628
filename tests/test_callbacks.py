"""Observability callbacks: real 2-rank gloo fits of the default recipe (FULL_SHARD, NO_SHARD, faults),
checked through metrics.csv, the offline W&B run's records and ``shardlight analyze``; plus unit checks."""

from __future__ import annotations

import builtins
import csv
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from shardlight.callbacks._comm_schedule import WindowSchedule
from shardlight.callbacks._common import Shared, aggregate, interval, per_rank_key, storage_bytes
from shardlight.callbacks.comm import CommTimeCallback, window_metrics
from shardlight.callbacks.hang import HangWatchdog
from shardlight.callbacks.memory import MemoryHeadroomCallback
from shardlight.callbacks.peer_failure import PeerFailureCallback, peer_failure
from shardlight.callbacks.progress import LatestMetrics, StepProgressBar, bar_metrics
from shardlight.callbacks.rank_table import RankTableCallback
from shardlight.callbacks.registry import NAMES, build_enabled
from shardlight.callbacks.throughput import ThroughputCallback, lookup_peak_tflops, read_baseline

COMM_KEYS = ["comm/all_gather_ms", "comm/reduce_scatter_ms", "comm/all_reduce_ms", "comm/total_ms",
             "comm/exposed_ms", "comm/overlap_pct", "comm/compute_ms", "comm/ratio", "step/time_ms",
             "comm/total_ms_max", "comm/slowest_rank"]
MEMORY_KEYS = ["memory/headroom_gb", "memory/peak_gb", "memory/params_gb", "memory/grads_gb", "memory/optim_gb",
               "memory/fullest_rank"]
THROUGHPUT_KEYS = ["throughput/tokens_per_sec_per_device", "throughput/mfu", "throughput/scaling_efficiency"]


# --- helpers --------------------------------------------------------------------------------------------

def read_wandb_records(path: Path) -> list:
    """The records of an offline W&B run's ``.wandb`` file, parsed with wandb's own protobuf ``Record``.

    The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then 32 KiB blocks
    of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); a block
    tail shorter than a chunk header is zero padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a .wandb file"
    block, header = 32768, 7
    records, pending, pos = [], b"", 7
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path):
    """(history rows as {key: value}, metric definitions) of the run's single offline W&B run."""
    files = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert len(files) == 1, files
    rows, metrics = [], {}
    for record in read_wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json) if item.value_json else None
            rows.append(row)
        elif kind == "metric":
            metrics[record.metric.glob_name or record.metric.name] = record.metric
    return rows, metrics


def read_csv(run_dir: Path) -> list:
    with open(run_dir / "csv" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def values(rows: list, key: str) -> list:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def model_param_bytes() -> int:
    """Total parameter bytes of the default recipe's model, counted from the model itself."""
    from shardlight.build import build_hf_model
    from shardlight.recipe import load_recipe

    cfg = load_recipe(None, [])
    model = build_hf_model(cfg.model)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def train(cli, tmp: Path, *overrides, env=None):
    summary = tmp / "summary.json"
    result = cli(["train", f"output_dir={tmp / 'runs'}", "trainer.progress_bar=false", "--summary-json",
                  str(summary), *overrides], env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(summary.read_text()), result


# --- real runs ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_shard_run(tmp_path_factory):
    from conftest import run_cli

    tmp = tmp_path_factory.mktemp("full_shard")
    baseline = tmp / "baseline.json"
    baseline.write_text(json.dumps({"tokens_per_sec_per_device": 1000.0}))
    summary, result = train(
        run_cli, tmp, "trainer.max_steps=40", "callbacks.comm.every_n_steps=20", "callbacks.comm.overhead_budget=null",
        "callbacks.comm.judged_windows=1",
        "logging.wandb.mode=offline",
        "callbacks.throughput.peak_tflops=100", f"callbacks.throughput.baseline_file={baseline}",
    )
    return Path(summary["run_dir"]), result


slow = pytest.mark.slow


@slow
def test_full_shard_metrics_in_csv_are_sane(full_shard_run):
    run_dir, _ = full_shard_run
    rows = read_csv(run_dir)
    for key in COMM_KEYS + MEMORY_KEYS + THROUGHPUT_KEYS:
        assert values(rows, key), f"{key} missing from metrics.csv"
    windows = values(rows, "comm/window_start_step")
    assert windows == [5.0, 20.0], windows  # once early, then every 20 steps (20 is the one judged window)
    for row in rows:
        if not row.get("comm/total_ms"):
            continue
        total, exposed = float(row["comm/total_ms"]), float(row["comm/exposed_ms"])
        assert total > 0 and float(row["comm/all_gather_ms"]) > 0 and float(row["comm/compute_ms"]) > 0
        assert 0 <= exposed <= total + 1e-9
        assert 0 <= float(row["comm/overlap_pct"]) <= 100
        assert float(row["step/time_ms"]) > 0 and float(row["comm/slowest_rank"]) in (0.0, 1.0)
        for r in (0, 1):
            assert float(row[per_rank_key("comm/total_ms", r)]) > 0
            assert float(row[per_rank_key("comm/exposed_ms", r)]) <= float(row[per_rank_key("comm/total_ms", r)])
    assert all(v > 0 for v in values(rows, "memory/headroom_gb"))
    assert all(v > 0 for v in values(rows, "memory/peak_gb"))
    assert all(v > 0 for v in values(rows, "throughput/tokens_per_sec_per_device"))
    assert all(0 < v < 1 for v in values(rows, "throughput/mfu"))
    tps, eff = values(rows, "throughput/tokens_per_sec_per_device"), values(rows, "throughput/scaling_efficiency")
    assert eff == pytest.approx([v / 1000.0 for v in tps], rel=1e-6)


@slow
def test_full_shard_local_shard_bytes_are_half_the_model(full_shard_run):
    run_dir, _ = full_shard_run
    rows = read_csv(run_dir)
    total = model_param_bytes()
    for r in (0, 1):
        params = values(rows, per_rank_key("memory/params_gb", r))[-1] * 1e9
        grads = values(rows, per_rank_key("memory/grads_gb", r))[-1] * 1e9
        optim = values(rows, per_rank_key("memory/optim_gb", r))[-1] * 1e9
        # FULL_SHARD on 2 ranks: half the parameters (+ FSDP's alignment padding of the flat shards)
        assert params == pytest.approx(total / 2, rel=0.01), (r, params, total)
        assert grads == pytest.approx(params, rel=0.01)
        assert optim == pytest.approx(2 * params, rel=0.02)  # AdamW: exp_avg + exp_avg_sq
    table = list(csv.DictReader(open(run_dir / "ranks.csv")))
    assert [row["rank"] for row in table] == ["0", "1"]
    assert int(table[0]["memory/params_bytes"]) == pytest.approx(total / 2, rel=0.01)


@slow
def test_full_shard_wandb_run_holds_the_same_keys(full_shard_run):
    run_dir, result = full_shard_run
    history, metrics = wandb_history(run_dir)
    logged = set().union(*history)
    csv_keys = {k for k in read_csv(run_dir)[0] if k.startswith(("comm/", "memory/", "throughput/", "step/"))}
    assert csv_keys and csv_keys <= logged, sorted(csv_keys - logged)
    for group in ("comm/*", "memory/*", "throughput/*", "step/*"):
        assert metrics[group].step_metric == "trainer/global_step", group
    assert metrics["memory/headroom_gb"].summary.min
    # a logged Table is a history item with nested keys (ranks/table → _type, nrows, ...)
    table_rows = [row for row in history if row.get("ranks/table/_type") == "table-file"]
    assert len(table_rows) == 1 and table_rows[0]["ranks/table/nrows"] == 2, [r for r in history if "ranks" in str(r)]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1, "only rank 0 starts a W&B run"


@slow
def test_full_shard_live_comm_time_matches_shardlight_analyze(full_shard_run, tmp_path, cli):
    run_dir, _ = full_shard_run
    rows = read_csv(run_dir)
    for start in (5, 20):
        window = run_dir / "traces" / f"step_{start:06d}"
        assert sorted(p.name for p in window.iterdir()) == ["rank0.collectives.json", "rank0.pt.trace.json",
                                                           "rank1.collectives.json", "rank1.pt.trace.json"]
        out = tmp_path / f"analysis_{start}.json"
        result = cli(["analyze", str(window), "--json", str(out)])
        assert result.returncode == 0, result.stderr[-3000:]
        analysis = json.loads(out.read_text())
        row = next(r for r in rows if r.get("comm/window_start_step") and float(r["comm/window_start_step"]) == start)
        for r in ("0", "1"):
            ranked = analysis["ranks"][r]
            assert ranked["mode"] == "gloo"
            steps = [s for s in ranked["steps"] if s != "unassigned"]
            offline_ms = ranked["comm_us"] / len(steps) / 1000
            live_ms = float(row[per_rank_key("comm/total_ms", int(r))])
            assert live_ms == pytest.approx(offline_ms, rel=0.05), (start, r, live_ms, offline_ms)


@slow
def test_no_shard_holds_the_whole_model_per_rank(tmp_path, cli):
    summary, _ = train(cli, tmp_path, "fsdp.sharding_strategy=NO_SHARD", "trainer.max_steps=12",
                       "trainer.val_every_n_steps=12", "logging.wandb.enabled=false")
    rows = read_csv(Path(summary["run_dir"]))
    total = model_param_bytes()
    for r in (0, 1):
        params = values(rows, per_rank_key("memory/params_gb", r))[-1] * 1e9
        assert params == pytest.approx(total, rel=0.01), (r, params, total)
    comm_rows = [r for r in rows if r.get("comm/total_ms")]
    assert len(comm_rows) == 1  # the early window at step 5
    assert float(comm_rows[0]["comm/all_reduce_ms"]) > 0  # NO_SHARD reduces gradients with all-reduce
    assert float(comm_rows[0]["comm/all_gather_ms"]) == 0


@slow
def test_wandb_and_profiler_failures_are_warnings(tmp_path, cli):
    """W&B's directory and the traces directory are files: W&B cannot start and the profiler window
    cannot be written; both are warnings, training finishes and the CSV twin has the other metrics."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("not a directory")
    (run_dir / "traces").write_text("not a directory")
    summary, result = train(cli, tmp_path, "trainer.max_steps=12", "trainer.val_every_n_steps=12",
                            "logging.wandb.mode=offline", env={"SHARDLIGHT_RUN_DIR": str(run_dir)})
    assert summary["steps"] == 12
    assert "shardlight: W&B start failed" in result.stderr
    assert "comm window at step 5 skipped" in result.stderr
    rows = read_csv(run_dir)
    assert not values(rows, "comm/total_ms")
    for key in MEMORY_KEYS + ["throughput/tokens_per_sec_per_device"]:
        assert values(rows, key), key
    assert values(rows, "train/loss")


# --- unit checks ----------------------------------------------------------------------------------------

def test_window_metrics_are_per_analysed_step():
    result = {
        "comm_us": 4000, "exposed_comm_us": 3000, "compute_us": 8000, "overlap_pct": 25.0, "comm_to_compute": 0.5,
        "by_collective": {"all_gather": {"comm_us": 3000}, "reduce_scatter": {"comm_us": 1000}},
        "steps": {"1": {}, "2": {}, "unassigned": {}},
    }
    metrics = window_metrics(result, {1: 0.010, 2: 0.012, 3: 0.5})
    assert metrics["comm/total_ms"] == pytest.approx(2.0)
    assert metrics["comm/exposed_ms"] == pytest.approx(1.5)
    assert metrics["comm/all_gather_ms"] == pytest.approx(1.5)
    assert metrics["comm/all_reduce_ms"] == 0.0
    assert metrics["comm/compute_ms"] == pytest.approx(4.0)
    assert metrics["step/time_ms"] == pytest.approx(11.0)
    assert metrics["comm/ratio"] == 0.5 and metrics["comm/overlap_pct"] == 25.0


def test_window_schedule_once_early_then_every_n():
    callback = CommTimeCallback(Path("/nonexistent"), every_n_steps=50, first_step=5, warmup=1, active=2)
    starts = [s for s in range(0, 200) if callback.is_window_start(s, max_steps=200)]
    assert starts == [5, 50, 100, 150]  # 197 + 3 > 200: no window that cannot finish


def test_window_schedule_spaces_windows_by_their_measured_cost():
    """A known cost (each window's steps 100 ms slower, its gather 20 ms) on 80 ms steps: the schedule measures
    exactly that and spaces the windows so that they cost the budget; without a budget, every every_n_steps."""
    schedule, starts, clock = simulate_schedule(0.01)
    assert all(cost == pytest.approx(0.320) for cost in schedule.costs.values()), schedule.costs
    # 0.32 s / (0.01 x 0.08 s) = 400 steps after each start, then the next multiple of 50
    assert starts == [5, 450, 850, 1250, 1650, 2050, 2450, 2850]
    assert schedule.overhead_share(clock) == pytest.approx(0.01, rel=0.1)
    schedule, starts, _ = simulate_schedule(None)
    assert starts == [5] + list(range(50, 3000, 50))  # no budget: every 50 steps, as before
    # Steps that slow down over the run (80 ms to 110 ms, as a loaded host drifts): the typical step is taken on
    # both sides of each window, so the drift cancels and every window after the early one (which has no normal
    # steps before it) is measured exactly; the steps after the window alone read the typical step too high.
    schedule, starts, _ = simulate_schedule(0.01, drift_s=1e-5)
    assert all(cost == pytest.approx(0.320, abs=1e-9) for start, cost in schedule.costs.items() if start > 5)


def test_every_run_of_30_steps_gets_a_window_after_warm_up_counted_from_its_own_start():
    """The run's verdict is judged after warm-up (10 steps): a run of 30 steps or more gets a window there
    whatever the budget (at its last chance, when none came earlier), and a resumed run counts its windows from
    its resume step, as a fresh run does from 0."""
    _, starts, _ = simulate_schedule(0.01, end=30, planned=True)
    assert starts == [5, 22]  # 30 - 3 (its length) - 5 (the gather's delay)
    _, starts, _ = simulate_schedule(0.01, begin=50, end=130, planned=True)
    assert starts == [55, 122]  # the budget spaces 100 out (400 steps after 55); 122 is the last chance
    _, starts, _ = simulate_schedule(None, begin=50, end=210, planned=True)
    assert starts == [55, 100, 150, 200]  # multiples of 50 into the run; 100 is past warm-up: no extra window
    _, starts, _ = simulate_schedule(0.01, end=29, planned=True)
    assert starts == [5]  # shorter than 30 steps: the early window alone (a provisional verdict)


def test_a_run_gets_its_judged_windows_spread_over_it_and_the_budget_s_own_count():
    """Four windows after warm-up: a 200-step run, whose budget would give none, gets them due at even steps up
    to its last chance (192 = 200 - 3 - 5); a long run's budget gives four on its own, so nothing is added; a
    run too short for four spaced windows takes them back to back, each once the last one's cost is agreed."""
    schedule, starts, _ = simulate_schedule(0.01, end=200, planned=True, judged=4)
    assert schedule.judged_due == [56, 101, 146, 192] and starts == [5, 56, 101, 146, 192]
    schedule, starts, _ = simulate_schedule(0.01, end=3000, planned=True, judged=4)
    assert starts == [5, 450, 850, 1250, 1650, 2050, 2450, 2850]  # the budget's windows, as without judged ones
    _, starts, _ = simulate_schedule(0.01, begin=100, end=160, planned=True, judged=4)
    assert starts == [105, 121, 137, 153]  # due at 120, 131, 142, 152: each once the last one's cost is agreed
    # Validation (1 s) after every 51st step: no window records across a pass (the one due at 101 would record
    # 101-103 around the pass after step 102: it starts at 102), and a pass is no cost of a window, whether it
    # runs just before the window's first step (102) or before its gather (153, the window at 146).
    schedule, starts, _ = simulate_schedule(0.01, end=200, planned=True, judged=4, val_every=51)
    assert starts == [5, 56, 102, 146, 192]
    _, starts, _ = simulate_schedule(0.01, end=200, planned=True, judged=4, val_every=2)
    # Passes closer together than a window's length: windows record across them rather than never run (the
    # passes slow every other step, so the budget's own windows come at 50 and 100 and count as judged).
    assert starts == [5, 50, 100, 146, 192]
    assert all(cost == pytest.approx(0.320) for start, cost in schedule.costs.items() if start > 5), schedule.costs


def simulate_schedule(budget, drift_s=0.0, begin=0, end=3000, planned=False, judged=1, val_every=None):
    """A known cost (each window's steps 100 ms slower, its gather 20 ms) on 80 ms steps, steps begin..end; a
    validation pass of 1 s after every ``val_every`` steps."""
    schedule = WindowSchedule(every_n_steps=50, first_step=5, length=3, budget=budget)
    if planned:
        schedule.plan_run(begin, end, warmup_steps=10, gather_delay=5, judged_windows=judged, val_every=val_every)
    clock, starts = 0.0, []
    for step in range(begin + 1, end):
        if schedule.is_start(step - 1, max_steps=end):
            starts.append(step - 1)
            schedule.window_opened(step - 1, clock)
        recording = schedule.open_window is not None and step <= starts[-1] + 3
        clock += 0.080 + drift_s * step + (0.100 if recording else 0.0)
        schedule.step_done(step, clock)
        if schedule.open_window is not None and schedule.agree_step is None and step == starts[-1] + 8:
            clock += 0.020  # the gather, 5 steps after the window
            schedule.window_gathered(clock)
        if schedule.agree_due(step):  # what CommTimeCallback._agree does, without the all-reduce
            schedule.close(starts[-1], *schedule.local_cost())
        if val_every and step % val_every == 0:  # after the step's hooks, as Lightning validates
            clock += 1.0
            schedule.set_aside(1.0)
    return schedule, starts, clock


def test_gc_freeze_takes_the_start_up_heap_out_of_full_collections():
    import gc
    import time

    from shardlight.callbacks.gc_freeze import GcFreezeCallback

    heap = [[i] for i in range(400_000)]  # what a rank holds at train start: many long-lived objects

    def full_collection_s():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - start)
        return min(times)

    callback = GcFreezeCallback()
    before = full_collection_s()
    callback.on_train_start(None, None)
    try:
        assert callback.frozen >= len(heap) and gc.get_freeze_count() == callback.frozen
        after = full_collection_s()
        assert after < before / 4, (before, after)  # the frozen objects are not scanned any more
    finally:
        callback.on_train_end(None, None)
    assert gc.get_freeze_count() == 0


def test_peak_table_and_overrides():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == pytest.approx(989.4)
    assert lookup_peak_tflops("NVIDIA H100 PCIe", "bf16-mixed") == pytest.approx(756.5)
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "32-true") == pytest.approx(19.5)
    assert lookup_peak_tflops("NVIDIA H200", "bf16-true") == pytest.approx(989.4)
    assert lookup_peak_tflops("NVIDIA B200", "bf16-mixed") is None
    assert lookup_peak_tflops("NVIDIA B200", "bf16-mixed", {"B200": 2250}) == 2250
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed", {"H100": 900}) == 900


def test_baseline_file(tmp_path):
    assert read_baseline(None) is None
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"tokens_per_sec_per_device": 123.0}))
    assert read_baseline(str(path)) == 123.0
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert read_baseline(str(tmp_path / "missing.json")) is None


def test_storage_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:30].view(5, 6), flat[30:100]]
    assert storage_bytes(views) == 400
    assert storage_bytes([torch.zeros(3), None, torch.zeros(0)]) == 12


def test_aggregate_worst_min_max_mean():
    per_rank = [{"memory/headroom_gb": 3.0}, None, {"memory/headroom_gb": 1.0}]
    out = aggregate(["memory/headroom_gb"], per_rank, worst="min")
    assert out == {"memory/headroom_gb": 1.0, "memory/headroom_gb_min": 1.0, "memory/headroom_gb_max": 3.0,
                   "memory/headroom_gb_mean": 2.0}


def test_registry_is_the_recipe_callbacks_section():
    """Each field of the recipe's ``callbacks:`` section names a callback module with ``build``; each section
    starts with ``enabled``."""
    import dataclasses
    import importlib

    from shardlight.recipe import CallbacksConfig

    assert NAMES == [f.name for f in dataclasses.fields(CallbacksConfig)] == ["comm", "memory", "throughput", "hang"]
    for name in NAMES:
        assert callable(importlib.import_module(f"shardlight.callbacks.{name}").build), name
        assert dataclasses.fields(getattr(CallbacksConfig(), name))[0].name == "enabled"


def test_build_enabled_in_registry_order_then_the_rank_table(tmp_path):
    from shardlight.recipe import CallbacksConfig
    from shardlight.run_context import RunContext

    ctx = RunContext(run_dir=tmp_path)
    shared = Shared(trust_remote_code=True)
    built = build_enabled(CallbacksConfig(), ctx, shared)
    assert [type(c) for c in built] == [CommTimeCallback, MemoryHeadroomCallback, ThroughputCallback,
                                        HangWatchdog, RankTableCallback]
    comm, memory, throughput, hang, table = built
    assert comm.table is memory.table is table.table is shared.table
    assert comm.trace_root == tmp_path / "traces" and table.run_dir == tmp_path
    assert throughput.trust_remote_code is True
    assert hang.folder == tmp_path / "flight_recorder"
    off = CallbacksConfig()
    for name in NAMES:
        getattr(off, name).enabled = False
    assert build_enabled(off, ctx) == []
    off.throughput.enabled = True
    assert [type(c) for c in build_enabled(off, ctx)] == [ThroughputCallback, RankTableCallback]


def test_callback_settings_are_checked_by_the_recipe_schema():
    from shardlight.errors import ShardlightError
    from shardlight.recipe import load_recipe

    for override, message in (("callbacks.comm.every_n_steps=0", "callbacks.comm.every_n_steps must be positive, got 0"),
                              ("callbacks.comm.active=0", "callbacks.comm.active must be positive, got 0"),
                              ("callbacks.comm.wait=-1", "callbacks.comm.wait must not be negative, got -1"),
                              ("callbacks.memory.every_n_steps=0", "callbacks.memory.every_n_steps must be positive"),
                              ("callbacks.throughput.every_n_steps=-1", "callbacks.throughput.every_n_steps must be"),
                              ("callbacks.comm.every_n_step=3", "did you mean 'callbacks.comm.every_n_steps'")):
        with pytest.raises(ShardlightError, match=message):
            load_recipe(None, [override])
    cfg = load_recipe(None, ["callbacks.memory.every_n_steps=null", "callbacks.comm.first_step=2"])
    assert cfg.callbacks.memory.every_n_steps is None and cfg.callbacks.comm.first_step == 2


def test_null_every_n_steps_is_the_trainers_log_interval():
    from types import SimpleNamespace

    trainer = SimpleNamespace(log_every_n_steps=7)
    assert interval(trainer, None) == 7 and interval(trainer, 3) == 3


def test_every_overridden_hook_is_marked_override():
    import inspect

    from lightning.pytorch.callbacks import Callback

    from shardlight.callbacks.preemption import PreemptionCallback

    hooks = {name for name, _ in inspect.getmembers(Callback, inspect.isfunction) if not name.startswith("_")}
    for cls in (CommTimeCallback, MemoryHeadroomCallback, ThroughputCallback, RankTableCallback, PreemptionCallback,
                PeerFailureCallback, StepProgressBar):
        overridden = [name for name in hooks if name in vars(cls)]
        assert overridden, cls
        for name in overridden:
            assert getattr(vars(cls)[name], "__override__", False), f"{cls.__name__}.{name} lacks @override"


# --- a dead or stopped peer ------------------------------------------------------------------------------

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
ADVICE = ". This is typically caused by a remote worker crashing. Check the logs of the remote worker. GLHF!"
# (the exception a surviving rank sees, the detail its one line quotes): each form a dead or stopped peer takes.
PEER_FAILURES = [
    (RuntimeError(GLOO + "unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete"),
     "RuntimeError: Timed out waiting 15000ms for recv operation to complete"),
    (RuntimeError(GLOO + "unbound_buffer.cc:129] Timed out waiting 15000ms for send operation to complete"),
     "RuntimeError: Timed out waiting 15000ms for send operation to complete"),
    (RuntimeError("Application timeout caused pair closure"), "RuntimeError: Application timeout caused pair closure"),
    (RuntimeError(GLOO + "pair.cc:537] Read error [127.0.0.1]:33452: Connection reset by peer" + ADVICE),
     "RuntimeError: Read error [127.0.0.1]:33452: Connection reset by peer"),
    (RuntimeError(GLOO + "pair.cc:553] Connection closed by peer [127.0.0.1]:925" + ADVICE),
     "RuntimeError: Connection closed by peer [127.0.0.1]:925"),
    (ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: [Errno 111] Connection refused"),
    (BrokenPipeError(32, "Broken pipe"), "BrokenPipeError: [Errno 32] Broken pipe"),
    (RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
                  "Timeout(ms)=600000) ran for 600071 milliseconds before timing out."),
     "RuntimeError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
     "Timeout(ms)=600000) ran for 600071 milliseconds before timing out."),
    (RuntimeError("Process group watchdog thread terminated with exception: NCCL error: remote process exited or "
                  "there was a network error"),
     "RuntimeError: Process group watchdog thread terminated with exception: NCCL error: remote process exited "
     "or there was a network error"),
    (RuntimeError("NCCL communicator was aborted on rank 0."), "RuntimeError: NCCL communicator was aborted on rank 0."),
    (RuntimeError("[PG ID 0 PG GUID 0 Rank 1] Heartbeat monitor timed out! Process will be terminated."),
     "RuntimeError: [PG ID 0 PG GUID 0 Rank 1] Heartbeat monitor timed out! Process will be terminated."),
    (torch.distributed.DistNetworkError("anything at all"), "DistNetworkError: anything at all"),
    (torch.distributed.DistStoreError("wait timeout after 30000ms, keys: /x"),
     "DistStoreError: wait timeout after 30000ms, keys: /x"),
    (torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970"),
     "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970"),
]
ORDINARY = [
    ValueError("Expected input batch_size (8) to match target batch_size (16)"),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("Expected all tensors to be on the same device, but found at least two devices"),
    KeyError("model.layers.0.self_attn.q_proj.weight"),
    OSError("HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. (read timeout=10)"),
    TimeoutError("reading the data file timed out"),
    RuntimeError(""),
]


@pytest.mark.parametrize("exc,detail", PEER_FAILURES, ids=[f"{type(e).__name__}:{str(e)[:40]}" for e, _ in PEER_FAILURES])
def test_every_form_of_a_dead_or_stopped_peer_is_recognized(exc, detail):
    assert peer_failure(exc) == detail


@pytest.mark.parametrize("exc", ORDINARY, ids=[f"{type(e).__name__}:{str(e)[:40]}" for e in ORDINARY])
def test_ordinary_errors_are_not_peer_failures(exc):
    assert peer_failure(exc) is None


def test_peer_failure_found_anywhere_in_the_exception_chain():
    closure = RuntimeError("Application timeout caused pair closure")

    def raised(outer, inner, explicit):
        try:
            try:
                raise inner
            except Exception as exc:
                if explicit:
                    raise outer from exc
                raise outer  # noqa: B904 - the implicit __context__ is the case under test
        except Exception as exc:
            return exc

    for explicit in (True, False):  # __cause__ (raise ... from) and __context__ (raised while handling)
        wrapped = raised(RuntimeError("the training step failed"), closure, explicit)
        assert peer_failure(wrapped) == "RuntimeError: Application timeout caused pair closure", explicit
        assert peer_failure(raised(ValueError("outer"), ValueError("inner"), explicit)) is None
    group_type = getattr(builtins, "BaseExceptionGroup", None)  # Python >= 3.11
    if group_type is not None:
        group = group_type("two ranks", [ValueError("x"), closure])
        assert peer_failure(group) == "RuntimeError: Application timeout caused pair closure"
    cyclic_a, cyclic_b = ValueError("a"), ValueError("b")
    cyclic_a.__context__, cyclic_b.__context__ = cyclic_b, cyclic_a
    assert peer_failure(cyclic_a) is None  # terminates


def test_peer_failure_is_one_line_and_the_traceback_is_dropped(monkeypatch, capsys):
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    callback = PeerFailureCallback()
    ordinary = ValueError("a bug")
    callback.on_exception(SimpleNamespace(global_rank=1), None, ordinary)
    assert capsys.readouterr().err == "" and sys.excepthook is not None
    failure = RuntimeError("Application timeout caused pair closure")
    callback.on_exception(SimpleNamespace(global_rank=1), None, failure)
    err = capsys.readouterr().err
    assert err == ("error: rank 1: a collective failed, another rank probably died or hung (RuntimeError: "
                   "Application timeout caused pair closure); stopping this rank\n")
    try:  # Lightning's teardown failing in turn: the exception that escapes wraps the reported one
        raise RuntimeError("teardown failed") from failure
    except RuntimeError as escaped:
        sys.excepthook(type(escaped), escaped, escaped.__traceback__)
    assert seen == [] and capsys.readouterr().err == ""  # nothing more than the one line
    sys.excepthook(ValueError, ordinary, None)
    assert seen == [ordinary]  # any other uncaught exception still gets its traceback


def test_a_ranks_own_exception_is_the_one_line_and_its_peers_stay_quiet(monkeypatch, capsys, tmp_path):
    """Rank 1 raises in its step: its line names it, its traceback goes to a file; rank 0's dead-peer failure
    that follows prints nothing. The exceptions with a line of their own are left alone."""
    from types import SimpleNamespace

    from shardlight.causal_lm import NonFiniteStop

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    rank1, rank0 = PeerFailureCallback(tmp_path), PeerFailureCallback(tmp_path)
    rank1.on_exception(SimpleNamespace(global_rank=1, world_size=2), None, NonFiniteStop(3, "loss", "rank 1", 1e9))
    assert capsys.readouterr().err == "" and not list(tmp_path.iterdir())
    try:
        raise ValueError("bad batch on this rank")
    except ValueError as bug:
        rank1.on_exception(SimpleNamespace(global_rank=1, world_size=2), None, bug)
        line = f"error: rank 1: ValueError: bad batch on this rank (at {__file__}:"
        assert capsys.readouterr().err.startswith(line)
        assert "ValueError: bad batch on this rank" in (tmp_path / "exception_rank_1.txt").read_text()
        sys.excepthook(ValueError, bug, None)
        assert seen == []  # its traceback is in the file, not on the console
    rank0.on_exception(SimpleNamespace(global_rank=0, world_size=2), None,
                       RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert capsys.readouterr().err == ""  # rank 1's line explains it


# --- the progress bar --------------------------------------------------------------------------------------

def test_bar_shows_loss_tokens_and_exposed_comm_once_known():
    import math

    latest = LatestMetrics()
    assert bar_metrics({}, latest.values) == {}
    latest.log_metrics({"throughput/tokens_per_sec_per_device": torch.tensor(15272.4), "comm/exposed_ms": 3.0,
                        "step/time_ms": 12.0, "memory/peak_gb": 0.5, "table": "not a number"})
    assert bar_metrics({"train/loss": torch.tensor(2.22541), "val/loss": math.nan}, latest.values) == {
        "loss": "2.2254", "tokens/s/device": "15,272", "exposed comm": "25%"}
    latest.log_metrics({"step/time_ms": 0.0})
    assert "exposed comm" not in bar_metrics({}, latest.values)
    latest.log_metrics({"memory/headroom_gb": 22.149})
    assert bar_metrics({}, latest.values)["headroom"] == "22.1 GB"
