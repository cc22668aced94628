"""The live path equals the file path: a window analysed from the profiler's memory (``shardlight.trace.live``)
gives exactly what exporting its chrome trace and reading it back (``analyze_trace_file``) gives.

A real 2-rank gloo run (FSDP: all-gathers and gloo's reduce-scatter-as-all-reduce, plus an explicit
all_reduce and all_gather, a DataLoader, ``record_shapes``) records one window per rank; each rank exports
its trace *and* builds the record and the ``payload=True`` analysis from memory. The records, the per-rank
analyses and the combined cross-rank analyses must be equal, value for value (no tolerance: every time goes
through the same rounding of the same microsecond values).
"""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import free_port

torch = pytest.importorskip("torch")

from shardlight.errors import ShardlightError  # noqa: E402
from shardlight.trace import analyze_profile, analyze_trace_file, combine  # noqa: E402
from shardlight.trace.live import kineto_base_ns, profile_record  # noqa: E402
from shardlight.trace.reader import read_trace  # noqa: E402

# torch 2.13 keeps a stopped window's trace activities in memory; 2.11 does not (the comm callback then
# exports the window and reads it back: the callback tests below run on both).
needs_live_events = pytest.mark.skipif(
    not hasattr(torch._C._autograd._ProfilerResult, "trace_activities"),
    reason=f"torch {torch.__version__} keeps no trace activities in memory (trace_activities)")

RECORD_SCRIPT = textwrap.dedent(
    """
    import json, os, pickle, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.fsdp import FullyShardedDataParallel

    from shardlight.trace.live import analyze_profile, profile_record


    def worker(rank, world_size, out_dir, port):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(3)]
        model = FullyShardedDataParallel(torch.nn.Sequential(*blocks), device_id=torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(96, 64)), batch_size=16)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                      record_shapes=True, on_trace_ready=lambda p: None)
        prof.start()
        for (x,) in data:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            stat = torch.full((8,), float(rank))
            dist.all_reduce(stat)
            gathered = [torch.zeros(4, 2) for _ in range(world_size)]
            dist.all_gather(gathered, stat.view(4, 2))
            prof.step()
            if prof.step_num >= 4:
                break
        prof.stop()
        trace = os.path.join(out_dir, f"rank{rank}.pt.trace.json")
        prof.export_chrome_trace(trace)
        record = profile_record(prof, path=trace)
        with open(os.path.join(out_dir, f"rank{rank}.record.pkl"), "wb") as handle:
            pickle.dump(record, handle)
        with open(os.path.join(out_dir, f"rank{rank}.live.json"), "w") as handle:
            json.dump(analyze_profile(prof, payload=True, path=trace), handle)
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
    """
)


def _plain(value):
    """As JSON holds it (tuples become lists), to compare a result computed here with one a rank wrote."""
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module")
def window(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("live_gloo")
    script = work / "record.py"
    script.write_text(RECORD_SCRIPT)
    out = work / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, str(script), str(out), str(free_port())],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@needs_live_events
def test_live_record_equals_the_read_trace(window):
    for rank in (0, 1):
        trace = window / f"rank{rank}.pt.trace.json"
        live = pickle.loads((window / f"rank{rank}.record.pkl").read_bytes())
        read = read_trace(trace)
        assert read.rank == live.rank == rank
        assert live.world_size == read.world_size == 2 and live.process_groups == read.process_groups
        # every field: step rows, kept CPU rows (gloo work with its args, aten ops, c10d calls, DataLoader)
        assert live == read
        assert live.rows("gloo:") and all(row.args and row.args.get("Input Dims") for row in live.rows("gloo:"))
        assert live.rows("enumerate(DataLoader)")


@needs_live_events
def test_live_analysis_equals_the_file_analysis(window):
    files, lives = {}, {}
    for rank in (0, 1):
        trace = window / f"rank{rank}.pt.trace.json"
        files[str(rank)] = analyze_trace_file(trace, payload=True)
        lives[str(rank)] = json.loads((window / f"rank{rank}.live.json").read_text())
        file_result, live_result = _plain(files[str(rank)]), lives[str(rank)]
        assert live_result["mode"] == "gloo" and live_result["file"] == str(trace)
        steps = [step for step in file_result["steps"] if step.isdigit()]
        assert len(steps) == 2  # 3 recorded, the last dropped (HTA's rule)
        for step in steps:  # per-step compute / comm / exposed, exactly
            for key in ("compute_us", "comm_us", "exposed_comm_us", "overlap_us", "idle_us", "span_us", "comm_count"):
                assert live_result["steps"][step][key] == file_result["steps"][step][key], (rank, step, key)
        for collective in ("all_gather", "all_reduce"):
            assert live_result["by_collective"][collective] == file_result["by_collective"][collective]
        payload, file_payload = live_result["payload"], file_result["payload"]
        assert payload["instances"] == file_payload["instances"]  # each collective, its times and bytes
        assert all(size and size > 0 for size in payload["instances"]["bytes"])
        assert payload["input"] == file_payload["input"] and payload["input"]["input_us"]["all"] > 0
        assert live_result == file_result  # and everything else
    # the cross-rank analysis (wait/transfer split, bandwidth, stragglers) of either is the same
    assert _plain(combine(lives)) == _plain(combine(files))


@needs_live_events
def test_live_clock_base_is_the_files(window):
    """The file's ts are microseconds since Kineto's base; the live record computes that base itself."""
    data = json.loads((window / "rank0.pt.trace.json").read_text())
    base = data["baseTimeNanoseconds"]
    assert kineto_base_ns(base) == base
    first = min(row.ts for row in read_trace(window / "rank0.pt.trace.json").step_rows)
    assert kineto_base_ns(base + int(first * 1000)) == base


def _one_process_window(record_shapes=True):
    model = torch.nn.Linear(32, 32)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=record_shapes,
                                  schedule=torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1),
                                  on_trace_ready=lambda p: None)
    prof.start()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32)), batch_size=8)
    for step, (x,) in enumerate(data):
        model(x).sum().backward()
        prof.step()
        if step == 3:
            break
    prof.stop()
    return prof


@needs_live_events
def test_without_a_process_group_the_record_is_rank_zero(tmp_path):
    prof = _one_process_window()
    trace = tmp_path / "rank0.json"
    prof.export_chrome_trace(str(trace))
    live = profile_record(prof, path=trace)
    assert live == read_trace(trace)
    assert live.rank == 0 and live.world_size is None and len(live.step_names) == 3
    # no gloo work: no source claims it, with the file's message
    with pytest.raises(ShardlightError, match="no .* to analyse"):
        analyze_profile(prof, path=trace)
    with pytest.raises(ShardlightError, match="no .* to analyse"):
        analyze_trace_file(trace)


def test_a_profiler_without_a_finished_window_is_an_error():
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with pytest.raises(ShardlightError, match="no finished Kineto window"):
        profile_record(prof, dist_info=None)


def test_kineto_base_floors_to_its_period():
    period = 7889238 * 10**9
    assert kineto_base_ns(3 * period + 5) == 3 * period
    assert kineto_base_ns(3 * period - 1) == 2 * period
    assert not math.isnan(kineto_base_ns(0))


# --- the comm callback on the live path (one gloo rank, driven hook by hook) -----------------------------------

class _Logger:
    def __init__(self) -> None:
        self.logged: list = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, metrics))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _drive(callback, steps: int = 9):
    """Lightning's order of the hooks the callback uses, over ``steps`` optimizer steps of a small gloo workload."""
    from types import SimpleNamespace

    import torch.distributed as dist

    logger = _Logger()
    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=1, max_steps=steps, is_global_zero=True, loggers=[logger],
                              strategy=SimpleNamespace(root_device=torch.device("cpu")), progress_bar_callback=None)
    model = torch.nn.Linear(32, 32)
    data = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * steps, 32)), batch_size=8))
    callback.on_fit_start(trainer, None)
    for index in range(steps):
        callback.on_train_batch_start(trainer, None, None, index)
        (x,) = next(data)
        model(x).sum().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, None, None, None, index)
    callback.on_train_end(trainer, None)
    return logger.logged


def _comm_rows(logged):
    return [(step, metrics) for step, metrics in logged if "comm/total_ms" in metrics]


def test_callback_window_is_analysed_live_and_its_trace_written_after(one_rank_group, tmp_path):
    from shardlight.callbacks.comm import CommTimeCallback

    callback = CommTimeCallback(tmp_path, every_n_steps=50, first_step=2, warmup=1, active=3, gather_delay=1,
                                print_windows=False)
    rows = _comm_rows(_drive(callback))
    # the window's steps 2..5 (warm-up, two analysed), logged at its end step; the last active step only begun
    assert [step for step, _ in rows] == [5]
    metrics = rows[0][1]
    assert metrics["comm/all_reduce_ms"] > 0 and metrics["comm/compute_ms"] > 0
    trace = tmp_path / "traces" / "step_000002" / "rank0.pt.trace.json"
    # Beside the trace, the collectives the flight recorder saw the window issue (their process groups).
    assert sorted(p.name for p in trace.parent.iterdir()) == ["rank0.collectives.json", trace.name]
    # The trace holds the active steps, the last (dropped by the analysis) stopped as it began: no work in it.
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted((e for e in events if e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    stub = steps[-1]
    in_stub = [e["name"] for e in events if e.get("ph") == "X" and e is not stub
               and stub["ts"] <= e["ts"] <= stub["ts"] + stub["dur"]]
    assert not [name for name in in_stub if "all_reduce" in name or name.startswith("aten::")], in_stub
    assert [e["name"] for e in events if e.get("ph") == "X" and "all_reduce" in e["name"]
            and steps[1]["ts"] <= e["ts"] <= steps[1]["ts"] + steps[1]["dur"]]  # the analysed steps hold work
    # the file written after the live analysis holds the same window: its offline analysis is the live one
    offline = combine({"0": analyze_trace_file(trace, payload=True)})
    assert _plain(offline) == _plain(callback.findings.analysis)
    assert metrics["comm/total_ms"] == pytest.approx(offline["ranks"]["0"]["comm_us"] / 2 / 1000)


def test_callback_without_saved_traces_writes_no_file(one_rank_group, tmp_path):
    from shardlight.callbacks.comm import CommTimeCallback

    callback = CommTimeCallback(tmp_path, every_n_steps=50, first_step=2, warmup=1, active=3, gather_delay=1,
                                print_windows=False, save_traces=False)
    rows = _comm_rows(_drive(callback))
    assert [step for step, _ in rows] == [5] and rows[0][1]["comm/all_reduce_ms"] > 0
    assert not (tmp_path / "traces").exists()
    assert callback.findings.analysis["ranks"]["0"]["mode"] == "gloo"
