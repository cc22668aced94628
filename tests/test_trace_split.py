"""Wait vs transfer across ranks: clock offsets, matching, input time and bus bandwidth.

Truth by construction: synthetic 2-rank traces with known arrivals, a real 2-rank gloo run of
collectives of known sizes timed with perf_counter, and the shared real NCCL traces.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import free_port

from shardlight.cli.main import main
from shardlight.errors import ShardlightError
from shardlight.trace import analyze_trace_file, analyze_traces, combine, reader
from shardlight.trace.bandwidth import bucket_of

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDLIGHT_SHARED_TRACES") or REPO.parent / "shared" / "traces")
needs_shared = pytest.mark.skipif(not (SHARED / "reference.json").is_file(),
                                  reason=f"shared reference traces not found at {SHARED} (set SHARDLIGHT_SHARED_TRACES)")

SPLIT_KEYS = {"wall_us", "wait_us", "transfer_us", "exposed_wait_us", "exposed_transfer_us", "input_us",
              "input_wait_us"}


# --- synthetic traces -------------------------------------------------------------------------
# Kineto's key order, so the fast scanner reads these with its regexes (the full reader too).

def _kernel(name, ts, dur, correlation, stream=7, **comm):
    args = {"stream": stream, "correlation": correlation}
    args.update(comm)
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": args}


def _launch(ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0, "tid": 1, "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}


def _cpu(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur}


def _comm_args(collective, in_elems, out_elems, seq, world):
    """torch's record_param_comms args of a collective of the default group of ``world`` ranks."""
    args = {"Collective name": collective, "In msg nelems": in_elems, "Out msg nelems": out_elems,
            "Group size": world, "dtype": "Float", "Process Group Name": "0",
            "Process Group Ranks": str(list(range(world)))}
    if seq is not None:
        args["Seq"] = seq
    return args


_LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
# Per rank: (all_reduce start, all_gather start), both end at 300 and 600; and its compute kernels.
_ARRIVALS = {0: (100, 500), 1: (160, 450)}
_COMPUTE = {0: [(50, 80), (720, 80)], 1: [(400, 70)]}


def _trace(rank, world=2, shift=0, seq=True):
    """One step [0, 1000): all_reduce (4e6 bytes) and all_gather (8e6 bytes), arrivals as above."""
    reduce_at, gather_at = _ARRIVALS[rank]
    events = [_cpu("ProfilerStep#1", 0, 1000)]
    if rank == 0:  # the input pipeline on the main thread: [10, 40] uncovered, [700, 760] 20 us uncovered
        events += [_cpu(_LOADER, 10, 30), _cpu(_LOADER, 700, 60)]
    correlation = 1
    for ts, dur in _COMPUTE[rank]:
        events += [_launch(ts - 5, correlation), _kernel("gemm_kernel", ts, dur, correlation)]
        correlation += 1
    for collective, start, end, size, seq_no in (("allreduce", reduce_at, 300, (1_000_000, 1_000_000), 1),
                                                 ("_allgather_base", gather_at, 600, (1_000_000, 2_000_000), 2)):
        token = "AllReduce" if collective == "allreduce" else "AllGather"
        args = _comm_args(collective, *size, seq_no if seq else None, world)
        events += [_launch(start - 5, correlation),
                   _kernel(f"ncclDevKernel_{token}_RING_LL(x)", start, end - start, correlation, stream=20, **args)]
        correlation += 1
    for event in events:
        event["ts"] += shift
    info = {"backend": "nccl", "rank": rank, "world_size": world}
    return {"schemaVersion": 1, "distributedInfo": info, "traceEvents": events}


def _write_run(directory: Path, world=2, shifts=(0, 0), seq=True, ranks=(0, 1)) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        trace = _trace(rank, world, shifts[rank], seq)
        (directory / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace))
    return directory


def test_synthetic_wait_and_transfer_are_exact(tmp_path):
    analysis = analyze_traces(_write_run(tmp_path / "run"))
    r0, r1 = analysis["ranks"]["0"], analysis["ranks"]["1"]
    # all_reduce: rank 1 arrives last at 160, so rank 0 waits 60 and both transfer 140;
    # all_gather: rank 0 arrives last at 500, so rank 1 waits 50 and both transfer 100.
    assert (r0["split"]["wait_us"], r0["split"]["transfer_us"]) == (60, 240)
    assert (r1["split"]["wait_us"], r1["split"]["transfer_us"]) == (50, 240)
    # rank 0's compute [50, 130] covers 30 of its wait [100, 160]; rank 1's [400, 470] 20 of [450, 500]
    assert (r0["split"]["exposed_wait_us"], r0["split"]["exposed_transfer_us"]) == (30, 240)
    assert (r1["split"]["exposed_wait_us"], r1["split"]["exposed_transfer_us"]) == (30, 240)
    for result in (r0, r1):
        split = result["split"]
        assert split["wait_us"] + split["transfer_us"] == result["comm_us"]
        assert split["exposed_wait_us"] + split["exposed_transfer_us"] == result["exposed_comm_us"]
        assert (split["steps"], split["wall_us"], split["matched"], split["unmatched"]) == (1, 1000, 2, 0)
        assert SPLIT_KEYS <= set(result["steps"]["1"])
        assert result["steps"]["1"]["wait_us"] == split["wait_us"]
    # input: rank 0's loader rows are 30 + 60 us; [10, 40] and 40 of [700, 760] are not covered
    assert (r0["split"]["input_us"], r0["split"]["input_wait_us"]) == (90, 50)
    assert (r1["split"]["input_us"], r1["split"]["input_wait_us"]) == (0, 0)
    summary = analysis["summary"]
    assert summary["collectives"] == {"match": "seq", "matched": 2, "unmatched": {"0": 0, "1": 0},
                                      "world_size": 2, "missing_ranks": []}
    assert summary["clock"]["offsets_us"] == {"0": 0.0, "1": 0.0} and summary["clock"]["matched"] == 2
    bandwidth = summary["bandwidth"]
    # 4e6 bytes in 140 us: 28.57 GB/s, bus factor 2(n-1)/n = 1; 8e6 bytes in 100 us: 80 GB/s, factor 1/2
    assert bandwidth["all_reduce"]["algbw_gbps"] == pytest.approx(4e6 / 140e-6 / 1e9)
    assert bandwidth["all_reduce"]["busbw_gbps"] == pytest.approx(4e6 / 140e-6 / 1e9)
    assert bandwidth["all_gather"]["busbw_gbps"] == pytest.approx(0.5 * 8e6 / 100e-6 / 1e9)
    assert bandwidth["all_gather"]["bytes"] == 8e6 and bandwidth["all_gather"]["group_size"] == 2
    assert bandwidth["all_gather"]["buckets"] == {"4MiB-16MiB": {
        "count": 1, "bytes": 8e6, "transfer_us": 100, "algbw_gbps": pytest.approx(80.0),
        "busbw_gbps": pytest.approx(40.0)}}
    peaked = analyze_traces(tmp_path / "run", link_peak_gbps=80.0)["summary"]["bandwidth"]
    assert peaked["all_gather"]["peak_pct"] == pytest.approx(50.0)
    # the report's timeline of the step: the same wait/transfer cut, the compute kernels, rank 0's loader rows
    assert r0["timeline"] == {"step": "1", "start_us": 0.0, "end_us": 1000.0, "compute": [[50.0, 130.0], [720.0, 800.0]],
                              "wait": [[100.0, 160.0]], "transfer": [[160.0, 300.0], [500.0, 600.0]],
                              "input": [[10.0, 40.0], [700.0, 760.0]]}
    assert r1["timeline"]["wait"] == [[450.0, 500.0]] and r1["timeline"]["compute"] == [[400.0, 470.0]]


def test_clock_offset_is_recovered_and_split_unchanged(tmp_path):
    plain = analyze_traces(_write_run(tmp_path / "plain"))
    shifted = analyze_traces(_write_run(tmp_path / "shifted", shifts=(0, 5000)))
    clock = shifted["summary"]["clock"]
    assert clock["reference_rank"] == 0
    assert clock["offsets_us"] == {"0": 0.0, "1": 5000.0}
    assert clock["residual_us"] == 0 and clock["max_residual_us"] == 0
    for rank in ("0", "1"):
        assert shifted["ranks"][rank]["split"] == plain["ranks"][rank]["split"]
        assert shifted["ranks"][rank]["timeline"] == plain["ranks"][rank]["timeline"]  # drawn on one clock
    # without Seq the same collectives are matched by order within (group, kind)
    ordered = analyze_traces(_write_run(tmp_path / "ordered", shifts=(0, 5000), seq=False))
    assert ordered["summary"]["collectives"]["match"] == "order"
    assert ordered["ranks"]["1"]["split"] == plain["ranks"]["1"]["split"]


def test_missing_rank_gives_a_partial_result_naming_it(tmp_path):
    partial = analyze_traces(_write_run(tmp_path / "run", world=3))
    collectives = partial["summary"]["collectives"]
    assert collectives["missing_ranks"] == [2] and collectives["world_size"] == 3
    assert collectives["match"] == "none" and collectives["unmatched"] == {"0": 2, "1": 2}
    for result in partial["ranks"].values():  # no arrivals to compare: all transfer
        assert result["split"]["wait_us"] == 0 and result["split"]["transfer_us"] == result["comm_us"]
        assert result["split"]["unmatched"] == 2
    alone = analyze_traces(_write_run(tmp_path / "alone", ranks=(1,)))
    assert alone["summary"]["collectives"]["missing_ranks"] == [0]


def test_live_path_combine_equals_analyze_traces(tmp_path):
    run = _write_run(tmp_path / "run", shifts=(0, 5000))
    offline = analyze_traces(run)
    per_rank = {}
    for rank in (0, 1):
        result = analyze_trace_file(run / f"rank{rank}.pt.trace.json", payload=True)
        per_rank[str(rank)] = json.loads(json.dumps(result))  # what a gather would carry: plain JSON
    assert len(json.dumps(per_rank["0"]["payload"])) < 4000  # compact: not the trace
    assert combine(per_rank) == offline
    assert "payload" not in analyze_trace_file(run / "rank0.pt.trace.json")
    with pytest.raises(ShardlightError, match="no payload"):
        combine({"0": analyze_trace_file(run / "rank0.pt.trace.json")})
    with pytest.raises(ShardlightError, match="link peak"):
        combine(per_rank, link_peak_gbps=-1)


def _refuse(error, text):
    raise error("refused")


def test_the_reader_keeps_the_same_comm_args_and_input_rows_typed_or_plain(tmp_path, monkeypatch):
    import msgspec

    trace = _write_run(tmp_path / "run") / "rank0.pt.trace.json"
    typed = reader.read_trace(trace)
    typed_analysis = analyze_trace_file(trace, payload=True)
    assert len(typed.gpu_args) == 2 and typed.world_size == 2 and typed.rows("enumerate(DataLoader)")
    for refusal in (msgspec.ValidationError, msgspec.DecodeError):  # as plain values; with the json module
        refuses = SimpleNamespace(decode=partial(_refuse, refusal))
        monkeypatch.setattr(reader, "_TYPED_DECODER", refuses)
        if refusal is msgspec.DecodeError:
            monkeypatch.setattr(reader, "_VALUES_DECODER", refuses)
        plain = reader.read_trace(trace)
        assert plain.gpu_args == typed.gpu_args and plain.world_size == 2
        assert [vars(row) for row in plain.rows("enumerate(DataLoader)")] == \
               [vars(row) for row in typed.rows("enumerate(DataLoader)")]
        assert analyze_trace_file(trace, payload=True) == typed_analysis


def test_gloo_collate_inside_the_loader_is_input_not_compute(tmp_path):
    def gloo_trace(rank):
        events = [_cpu("ProfilerStep#1", 0, 1000), _cpu(_LOADER, 0, 100),
                  _cpu("aten::stack", 20, 50),  # the loader's collate: input, not compute
                  _cpu("aten::mm", 200, 100),
                  _cpu("c10d::allreduce_", 300 + 50 * rank, 5),
                  dict(_cpu("gloo:all_reduce", 310 + 50 * rank, 190 - 50 * rank, tid=9),
                       args={"Input Dims": [[1024]], "Input type": ["float"]})]
        info = {"backend": "gloo", "rank": rank, "world_size": 2,
                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2, "ranks": [0, 1]}]}
        return {"distributedInfo": info, "traceEvents": events}
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(gloo_trace(rank)))
    analysis = analyze_traces(tmp_path)
    r0 = analysis["ranks"]["0"]
    assert r0["mode"] == "gloo" and r0["compute_us"] == 100
    assert (r0["split"]["input_us"], r0["split"]["input_wait_us"]) == (100, 100)
    # rank 1's work starts at 360, 50 us after rank 0's: rank 0 waits 50, both transfer 140
    assert (r0["split"]["wait_us"], r0["split"]["transfer_us"]) == (50, 140)
    assert analysis["summary"]["bandwidth"]["all_reduce"]["bytes"] == 4096


@pytest.mark.parametrize("size,label", [(1, "1B-4B"), (1023, "256B-1KiB"), (1024, "1KiB-4KiB"),
                                        (300_000, "256KiB-1MiB"), (8e6, "4MiB-16MiB"), (4 ** 10, "1MiB-4MiB")])
def test_size_buckets(size, label):
    assert bucket_of(size) == label


def test_cli_prints_split_and_writes_it(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    out = tmp_path / "a.json"
    assert main(["analyze", str(run), "--json", str(out), "--link-peak-gbps", "100"]) == 0
    printed = capsys.readouterr().out
    assert "wait ms" in printed and "busbw GB/s" in printed and "clock" in printed
    report = json.loads(out.read_text())
    assert report["ranks"]["0"]["split"]["wait_us"] == 60
    assert report["summary"]["bandwidth"]["all_gather"]["peak_pct"] == pytest.approx(40.0)
    assert main(["analyze", str(run), "--link-peak-gbps", "0"]) == 2
    assert "--link-peak-gbps must be a positive" in capsys.readouterr().err


# --- a real 2-rank gloo run -------------------------------------------------------------------

REPS, STALL_MS = 10, 200.0
SIZES = {"all_gather": 4 * (1 << 21) * 2, "reduce_scatter": 4 * (1 << 23), "all_reduce": 4 * (1 << 23)}
BUS_FACTOR = {"all_gather": 0.5, "reduce_scatter": 0.5, "all_reduce": 1.0}  # nccl-tests on 2 ranks


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collective_timing")
    worker = REPO / "tests" / "workers" / "collective_timing_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(out), str(free_port()), str(REPS), str(STALL_MS)],
                          capture_output=True, text=True, timeout=180, env=dict(os.environ, KINETO_LOG_LEVEL="6"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_gloo_bytes_exact_and_bus_bandwidth_matches_perf_counter(gloo_run):
    ratios: dict[str, list[float]] = {kind: [] for kind in SIZES}
    own_call: list[float] = []  # reduce_scatter's bandwidth over its own call's
    for rep in range(REPS):
        window = gloo_run / "timing" / f"rep{rep}"
        analysis = analyze_traces(window)
        collectives = analysis["summary"]["collectives"]
        assert collectives["match"] == "order" and collectives["unmatched"] == {"0": 0, "1": 0}
        calls = [json.loads((window / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        for rank in (0, 1):
            instances = analyze_trace_file(window / f"rank{rank}.pt.trace.json", payload=True)["payload"]["instances"]
            for kind, size in SIZES.items():
                assert [b for k, b in zip(instances["kind"], instances["bytes"]) if k == kind] == [size], kind
        for kind, factor in BUS_FACTOR.items():
            # The rank that arrived last waited least: its call time is the transfer plus call overhead.
            # gloo runs reduce_scatter_tensor as a clone of the whole input on the calling thread, an all_reduce
            # of it (the gloo:all_reduce work: the transfer the analyzer times), and a copy of the chunk out. The
            # copies' share of the call depends on the host (fresh pages for the clone: 1.3x to over 3x the
            # transfer on this machine), so the transfer's truth is the all_reduce call of the same 32 MiB in the
            # same window; the reduce_scatter call itself only bounds it (its bandwidth is never above ours).
            reference = "all_reduce" if kind == "reduce_scatter" else kind
            seconds = min(calls[0][reference]["seconds"], calls[1][reference]["seconds"])
            measured = SIZES[kind] * factor / seconds / 1e9
            reported = analysis["summary"]["bandwidth"][kind]
            assert reported["bytes"] == SIZES[kind] and reported["count"] == 1
            ratios[kind].append(reported["busbw_gbps"] / measured)
            if kind == "reduce_scatter":
                call_s = min(calls[0][kind]["seconds"], calls[1][kind]["seconds"])
                own_call.append(reported["busbw_gbps"] / (SIZES[kind] * factor / call_s / 1e9))
    # Call by call, then the median: a busy host stretches single calls (thread wake-ups) both ways. (On a
    # host loaded far beyond its cores, load average 5 on 2, the median has reached 1.11: the wake-ups that
    # perf_counter times and the trace's gloo work does not hold grow with the load.)
    for kind, values in ratios.items():
        # reduce_scatter's all_reduce runs while the other rank may still clone or copy (two ranks, two cores), the
        # reference alone: per call 0.61 to 1.81 of the reference's bandwidth, medians of 10 from 0.85 to 1.11 in
        # five runs on 3 December (the others within 0.98-1.05). Counting the copies as transfer would give about
        # 0.3 on this machine (the reduce_scatter calls took up to 3.1x the analyzer's transfer).
        tolerance = 0.30 if kind == "reduce_scatter" else 0.10
        assert statistics.median(values) == pytest.approx(1.0, abs=tolerance), (kind, values)
    assert statistics.median(own_call) >= 0.9, own_call  # the copies are not transfer


def test_gloo_stall_is_wait_on_the_early_rank(gloo_run):
    analysis = analyze_traces(gloo_run / "stall")
    early, late = analysis["ranks"]["0"], analysis["ranks"]["1"]
    steps = [step for step in early["steps"] if step.isdigit()]
    assert len(steps) == REPS and early["split"]["matched"] == REPS
    stall_us = STALL_MS * 1e3
    # The truth, timed independently: rank 1 issued each all_gather this long after rank 0 (about the
    # stall; less when a loaded host delayed rank 0 too). Iteration K is ProfilerStep#K.
    issued = [json.loads((gloo_run / "stall" / f"rank{rank}.json").read_text())["issued_s"] for rank in (0, 1)]
    for step in steps:
        truth_us = (issued[1][int(step)] - issued[0][int(step)]) * 1e6
        assert truth_us > 0.5 * stall_us, (step, truth_us)  # the stall is there
        assert early["steps"][step]["wait_us"] == pytest.approx(truth_us, rel=0.05, abs=2000), step
        assert late["steps"][step]["wait_us"] < 0.05 * stall_us, step
    for result in (early, late):
        split = result["split"]
        assert split["wait_us"] + split["transfer_us"] == pytest.approx(result["comm_us"], abs=1)
        assert split["wall_us"] >= REPS * stall_us  # every step holds one stall
    # One host, one clock, so the true offset is 0; but the estimate is the median over the matched
    # collectives of where each rank's gloo work ends, and gloo's ends scatter by milliseconds step by step
    # (measured here: -1.7 to +2.3 ms on a quiet host, -6.6 to +8.9 ms with 3 busy processes on the 2 cores;
    # medians of 10 from -1.1 to +2.6 ms, and 2.5 ms in a CI run). What the bound catches is a stall taken
    # for clock skew: rank 1 issues every all_gather 200 ms late, so an estimate from the starts, or one
    # thrown by the stall, is far outside it.
    assert abs(analysis["summary"]["clock"]["offsets_us"]["1"]) < 0.05 * stall_us


# --- real NCCL traces ---------------------------------------------------------------------------

@needs_shared
def test_dlrm_split_adds_up_and_one_host_clocks_agree():
    analysis = analyze_traces([SHARED / "param_dlrm_8rank"])
    assert analysis["summary"]["collectives"]["matched"] == 8  # 3 all_reduce + 5 all-to-all, every rank
    for rank, result in analysis["ranks"].items():
        split = result["split"]
        assert split["wait_us"] + split["transfer_us"] == pytest.approx(result["comm_us"], abs=1), rank
        assert split["exposed_wait_us"] + split["exposed_transfer_us"] == pytest.approx(
            result["exposed_comm_us"], abs=1), rank
        assert 0 <= split["exposed_wait_us"] <= split["wait_us"] and split["unmatched"] == 0
        assert split["input_us"] > 0 and split["steps"] == 1
    clock = analysis["summary"]["clock"]
    # 8 V100s of one host share a clock, and the kernels of one NCCL collective end within a few
    # microseconds of each other: measured offsets are at most 1.5 us, residuals at most 5 us.
    # The bounds leave an order of magnitude for noise and still fail on any real clock skew.
    assert all(abs(offset) < 20 for offset in clock["offsets_us"].values()), clock
    assert clock["residual_us"] < 5 and clock["max_residual_us"] < 50, clock


@needs_shared
def test_bus_bandwidth_of_nccl_sizes_is_physical():
    analysis = analyze_traces([SHARED / "hta_nccl_parser_config_rank0"])
    bandwidth = analysis["summary"]["bandwidth"]
    assert bandwidth["all_reduce"]["bytes"] > 0 and bandwidth["broadcast"]["bytes"] > 0
    for kind, entry in bandwidth.items():
        assert 0 < entry["busbw_gbps"] < 600, kind  # A100 NVLink peak is 600 GB/s
        assert sum(bucket["count"] for bucket in entry["buckets"].values()) == entry["count"]
    # one rank of two: nothing to match, the run is named partial
    assert analysis["summary"]["collectives"]["missing_ranks"] == [1]
    pair = analyze_traces([SHARED / "hta_trace_filter_2rank"])["summary"]["collectives"]
    assert pair["match"] == "none" and len(pair["missing_ranks"]) == 126
