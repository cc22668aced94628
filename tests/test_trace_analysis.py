"""shardlight analyze: HTA 0.5.0 parity on real NCCL/RCCL traces, semantics, CLI and bad input."""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from shardlight.cli.main import main
from shardlight.errors import ShardlightError
from shardlight.trace import analyze_trace_file, analyze_traces, reader
from shardlight.trace.events import COMMUNICATION, COMPUTATION, MEMORY, OTHER
from shardlight.trace.intervals import length, merge, overlap
from shardlight.trace.sources.nccl import kernel_type, nccl_collective


def _shared_traces() -> Path:
    override = os.environ.get("SHARDLIGHT_SHARED_TRACES")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces"


SHARED = _shared_traces()
needs_shared = pytest.mark.skipif(
    not (SHARED / "reference.json").is_file(),
    reason=f"shared reference traces not found at {SHARED} (set SHARDLIGHT_SHARED_TRACES)",
)


def _reference() -> dict:
    return json.loads((SHARED / "reference.json").read_text())


def _set_names() -> list[str]:
    if not (SHARED / "reference.json").is_file():
        return ["unavailable"]
    return sorted(_reference()["sets"])


SECTIONS = [("hta_default", False), ("hta_include_last_profiler_step", True)]


@needs_shared
@pytest.mark.parametrize("section,include_last", SECTIONS, ids=["default", "include_last"])
@pytest.mark.parametrize("set_name", _set_names())
def test_matches_hta_for_every_rank(set_name, section, include_last):
    expected = _reference()["sets"][set_name][section]
    analysis = analyze_traces([SHARED / set_name], include_last_step=include_last)
    assert sorted(int(r) for r in analysis["ranks"]) == expected["ranks"]
    for rank, ref in expected["per_rank"].items():
        got = analysis["ranks"][rank]
        breakdown, derived = ref["get_temporal_breakdown"], ref["derived"]
        assert Path(got["file"]).name == ref["file"]
        assert got["overlap_pct"] == pytest.approx(ref["get_comm_comp_overlap.comp_comm_overlap_pctg"], abs=0.01)
        pairs = {
            "idle_us": breakdown["idle_time(us)"],
            "compute_us": breakdown["compute_time(us)"],
            "non_compute_us": breakdown["non_compute_time(us)"],
            "span_us": breakdown["kernel_time(us)"],
            "comm_us": derived["comm_union_us"],
            "overlap_us": derived["overlap_us"],
            "exposed_comm_us": derived["exposed_comm_us"],
        }
        for key, value in pairs.items():
            assert got[key] == pytest.approx(value, abs=1), (rank, key)
        assert got["comm_to_compute"] == pytest.approx(derived["comm_to_compute_ratio"], rel=1e-6)
        assert got["comm_count"] == derived["comm_kernel_count"]
        assert sum(c["count"] for c in got["by_collective"].values()) == derived["comm_kernel_count"]
        assert sum(c["sum_dur_us"] for c in got["by_collective"].values()) == pytest.approx(
            derived["comm_kernel_sum_dur_us"], abs=1)


@needs_shared
@pytest.mark.parametrize("set_name", _set_names())
def test_per_step_matches_reference(set_name):
    expected = _reference()["sets"][set_name]["per_step_by_launch"]
    analysis = analyze_traces([SHARED / set_name], include_last_step=True)
    for rank, steps in expected.items():
        got_steps = analysis["ranks"][rank]["steps"]
        want_keys = {"unassigned" if step == "None" else step for step in steps}
        assert set(got_steps) == want_keys
        for step, ref in steps.items():
            got = got_steps["unassigned" if step == "None" else step]
            assert got["n_events"] == ref["n_gpu_events"]
            for key, ref_key in (("span_us", "gpu_span_us"), ("busy_us", "gpu_busy_us"),
                                 ("compute_us", "compute_us"), ("comm_us", "comm_us"),
                                 ("overlap_us", "overlap_us"), ("exposed_comm_us", "exposed_comm_us")):
                assert got[key] == pytest.approx(ref[ref_key], abs=1), (rank, step, key)


@needs_shared
def test_collective_names_and_cross_rank_summary():
    dlrm = analyze_traces([SHARED / "param_dlrm_8rank"])
    assert set(dlrm["ranks"]["0"]["by_collective"]) == {"all_reduce", "send_recv"}
    summary = dlrm["summary"]
    assert summary["num_ranks"] == 8
    spans = {rank: r["span_us"] for rank, r in dlrm["ranks"].items()}
    assert summary["metrics"]["span_us"]["max"] == max(spans.values())
    assert summary["metrics"]["overlap_pct"]["min_rank"] == 4
    # the straggler is judged on the step's own events: rank 3's total span includes kernels
    # launched outside ProfilerStep#10, its step span is shorter than rank 1's
    assert int(max(spans, key=spans.get)) == 3
    assert summary["stragglers"]["10"]["rank"] == 1
    assert summary["stragglers"]["10"]["span_us"] == 18467
    amd = analyze_trace_file(SHARED / "tracelens_mi300_resnet_act_ckpt_rank0" / "resnet_act_checkpoint.json.gz")
    # RCCL's ncclDevKernel_Generic does not name its collective; the kernels' record_param_comms args do
    assert set(amd["by_collective"]) == {"all_reduce", "broadcast"}
    pair = analyze_traces([SHARED / "hta_trace_filter_2rank"], include_last_step=True)["summary"]
    assert set(pair["stragglers"]) == {"551", "552"}
    assert pair["stragglers"]["552"]["rank"] == 1


class _Refuses:
    """A decoder that refuses every window with ``error``."""

    def __init__(self, error):
        self.error = error

    def decode(self, text):
        raise self.error("refused")


@needs_shared
@pytest.mark.parametrize("set_name", _set_names())
def test_typed_plain_and_json_decoding_read_the_same_records(set_name, monkeypatch):
    """Every shared file: decoded into Event structs (the usual way), into plain values (an event msgspec
    does not accept as an Event), and with the json module (a file msgspec does not accept at all) gives the
    same record."""
    import msgspec

    for path in sorted((SHARED / set_name).iterdir()):
        typed = asdict(reader.read_trace(path))
        assert typed["gpu_name"], path
        small = path.stat().st_size < 2 << 20  # the json module takes seconds on the large ones
        for error in [msgspec.ValidationError] + [msgspec.DecodeError] * small:
            with monkeypatch.context() as patch:
                patch.setattr(reader, "_TYPED_DECODER", _Refuses(error))
                assert asdict(reader.read_trace(path)) == typed, (path, error)


@needs_shared
def test_cli_prints_table_and_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "a.json", tmp_path / "a.png"
    code = main(["analyze", str(SHARED / "hta_trace_filter_2rank"), "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "overlap %" in printed and "11.81" in printed and "20.05" in printed
    report = json.loads(out_json.read_text())
    assert report["ranks"]["0"]["overlap_pct"] == pytest.approx(11.81, abs=0.01)
    assert out_png.read_bytes()[:4] == b"\x89PNG"


# --- semantics on synthetic traces (no shared data needed) ---------------------------------


def _kernel(name, ts, dur, correlation, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"stream": stream, "correlation": correlation}}


def _launch(ts, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "pid": 0, "tid": 1, "args": {"correlation": correlation}}


def _step(number, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "ts": ts, "dur": dur,
            "pid": 0, "tid": 1}


def _synthetic_trace(rank=0):
    events = [_step(1, 0, 100), _step(2, 100, 100)]
    for step, base in ((1, 0), (2, 100)):
        corr = 10 * step
        events += [_launch(base + 1, corr), _kernel("gemm_kernel", base + 10, 40, corr)]
        events += [_launch(base + 2, corr + 1),
                   _kernel("ncclDevKernel_AllGather_RING_LL(x)", base + 30, 30, corr + 1, stream=20)]
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}


def _write(path: Path, payload, compress=False) -> Path:
    data = json.dumps(payload).encode() if not isinstance(payload, bytes) else payload
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def _nccl_args_trace(stretches) -> dict:
    """Stretches of 40 kernels each, with their launches: "plain" (gemm), "nccl" (NCCL kernels without a
    collective's args) or "args" (NCCL kernels with them)."""
    events, correlation = [_step(1, 0, 10_000_000)], 0
    for number, kind in enumerate(stretches):
        for k in range(40):
            correlation += 1
            ts = 100_000 * number + 1_000 * k
            stream = 20 if kind != "plain" else 7
            args = {"stream": stream, "correlation": correlation}
            if kind == "args":
                args.update({"Collective name": "allreduce", "In msg nelems": 256 * (k + 1), "Group size": 2,
                             "dtype": "Float"})
            events += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0, "tid": 1, "ts": ts,
                        "dur": 1, "args": {"correlation": correlation}},  # in Kineto's key order, as the regex reads
                       {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"
                        if kind != "plain" else "gemm_kernel", "pid": 0, "tid": stream, "ts": ts + 20, "dur": 300,
                        "args": args}]
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": events}


def test_synthetic_trace_metrics_and_last_step_filter(tmp_path):
    path = _write(tmp_path / "r0.json.gz", _synthetic_trace(), compress=True)
    default = analyze_trace_file(path)
    assert default["steps"].keys() == {"1"}
    assert (default["comm_us"], default["compute_us"], default["overlap_us"]) == (30, 40, 20)
    assert default["overlap_pct"] == pytest.approx(200 / 3, abs=1e-3)
    assert default["exposed_comm_us"] == 10 and default["span_us"] == 50 and default["idle_us"] == 0
    assert default["by_collective"]["all_gather"]["count"] == 1
    both = analyze_trace_file(path, include_last_step=True)
    assert both["steps"].keys() == {"1", "2"}
    assert both["comm_us"] == 60 and both["span_us"] == 150 and both["idle_us"] == 50


def test_float_timestamps_round_like_hta(tmp_path):
    trace = _synthetic_trace()
    trace["traceEvents"].append(_kernel("tiny_kernel", 5.6, 0.3, 10))  # ceil 6, floor 5: negative
    path = _write(tmp_path / "t.json", trace)
    result = analyze_trace_file(path, include_last_step=True)
    assert result["compute_us"] == 80 - 1


def _merged(*pairs):
    ts, end = zip(*pairs)
    return merge(np.array(ts), np.array(end))


def test_interval_semantics():
    starts, ends = _merged((0, 10), (10, 20), (21, 22))
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 20), (21, 22)]  # touching intervals merge
    assert length(_merged((5, 4))) == -1  # a rounded sub-microsecond kernel counts negative, as in HTA
    assert overlap(_merged((0, 10)), _merged((5, 20))) == 5
    assert overlap(_merged((0, 10)), _merged((10, 20))) == 0


@pytest.mark.parametrize("name,kind,collective", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", COMMUNICATION, "all_reduce"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", COMMUNICATION, "reduce_scatter"),
    ("ncclDevKernel_AllGather_RING_LL(x)", COMMUNICATION, "all_gather"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", COMMUNICATION, "send_recv"),
    ("ncclKernel_Broadcast_RING_LL_Sum_int8_t", COMMUNICATION, "broadcast"),
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", COMMUNICATION, "unknown"),
    ("Memcpy DtoH (Device -> Pinned)", MEMORY, None),
    ("Memset (Device)", MEMORY, None),
    ("void at::native::copy_Memcpy_like_kernel", OTHER, None),
    ("Event Sync", OTHER, None),
    ("volta_sgemm_128x64_nn", COMPUTATION, None),
])
def test_kernel_classification(name, kind, collective):
    assert kernel_type(name) == kind
    if collective:
        assert nccl_collective(name) == collective


# --- bad input ------------------------------------------------------------------------------


def _expect_exit_2(capsys, *paths):
    assert main(["analyze", *map(str, paths)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_truncated_gzip(tmp_path, capsys):
    blob = gzip.compress(json.dumps(_synthetic_trace()).encode())
    path = _write(tmp_path / "cut.json.gz", blob[: len(blob) // 2])
    assert str(path) in _expect_exit_2(capsys, path)


def test_corrupt_gzip(tmp_path, capsys):
    blob = bytearray(gzip.compress(json.dumps(_synthetic_trace()).encode()))
    blob[20:40] = b"\xff" * 20
    path = _write(tmp_path / "bad.json.gz", bytes(blob))
    assert str(path) in _expect_exit_2(capsys, path)


def test_truncated_plain_json(tmp_path, capsys):
    path = _write(tmp_path / "cut.json", json.dumps(_synthetic_trace()).encode()[:-30])
    assert "truncated" in _expect_exit_2(capsys, path)


def test_json_that_is_not_a_trace(tmp_path, capsys):
    path = _write(tmp_path / "config.json", {"lr": 0.1, "layers": [1, 2]})
    assert "no traceEvents" in _expect_exit_2(capsys, path)
    path = _write(tmp_path / "text.json", b"hello world")
    assert str(path) in _expect_exit_2(capsys, path)


def test_trace_without_gpu_or_gloo_events(tmp_path, capsys):
    trace = {"distributedInfo": {"rank": 0}, "traceEvents": [_step(1, 0, 10), _launch(1, 3)]}
    path = _write(tmp_path / "cpu.json", trace)
    assert "no GPU kernels" in _expect_exit_2(capsys, path)


def test_duplicate_ranks_in_directory(tmp_path, capsys):
    _write(tmp_path / "a.json", _synthetic_trace(rank=3))
    _write(tmp_path / "b.json.gz", _synthetic_trace(rank=3), compress=True)
    assert "duplicate rank 3" in _expect_exit_2(capsys, tmp_path)


def test_directory_reports_skipped_files(tmp_path, capsys):
    _write(tmp_path / "rank0.json", _synthetic_trace(rank=0))
    _write(tmp_path / "rank1.json.gz", _synthetic_trace(rank=1), compress=True)
    _write(tmp_path / "broken.json.gz", b"\x1f\x8b\x08\x00garbage")
    _write(tmp_path / "notes.json", {"hello": 1})
    (tmp_path / "README.md").write_text("not a trace")
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "broken.json.gz" in out and "notes.json" in out
    analysis = analyze_traces(tmp_path)
    assert sorted(analysis["ranks"]) == ["0", "1"]
    assert len(analysis["summary"]["skipped"]) == 2


def test_missing_path_and_all_bad_directory(tmp_path, capsys):
    assert "no such file" in _expect_exit_2(capsys, tmp_path / "nope.json")
    _write(tmp_path / "notes.json", {"hello": 1})
    assert "no usable trace" in _expect_exit_2(capsys, tmp_path)


def test_api_raises_shardlight_error(tmp_path):
    path = _write(tmp_path / "x.json", b"[1, 2")
    with pytest.raises(ShardlightError, match="x.json"):
        analyze_trace_file(path)
