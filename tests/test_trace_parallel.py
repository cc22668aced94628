"""Decoding a run's trace files in worker processes (``reader.read_traces``) gives what reading them one by one gives.

The shared real traces and a synthetic multi-file set are loaded both ways and compared field by
field; a file a worker cannot read gives the same one-line error (or skip reason) as a serial read.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
from dataclasses import asdict
from pathlib import Path

import pytest

from shardlight.errors import ShardlightError
from shardlight.trace import analyze_traces, reader
from shardlight.trace.analysis import load_traces

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDLIGHT_SHARED_TRACES") or REPO.parent / "shared" / "traces")
needs_shared = pytest.mark.skipif(not (SHARED / "reference.json").is_file(),
                                  reason=f"shared reference traces not found at {SHARED} (set SHARDLIGHT_SHARED_TRACES)")


def _sets() -> list[Path]:
    return sorted(p for p in SHARED.iterdir() if p.is_dir()) if SHARED.is_dir() else []


def _fields(loaded):
    records, skipped = loaded
    return [asdict(record) for record in records], skipped


# --- synthetic traces ---------------------------------------------------------------------------

def _trace(rank: int, world: int, steps: int = 3, kernels: int = 40) -> dict:
    events, correlation = [], 0
    for step in range(steps):
        base = 1_000_000 * (step + 1) + 37 * rank
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 0, "tid": 1,
                       "ts": base, "dur": 900_000})
        for k in range(kernels):
            correlation += 1
            ts = base + 10_000 * k
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0, "tid": 1,
                           "ts": ts, "dur": 5, "args": {"correlation": correlation}})
            nccl = k % 4 == 0
            args = {"stream": 20 if nccl else 7, "correlation": correlation}
            if nccl:
                args.update({"Collective name": "allreduce", "In msg nelems": 1024 * (k + 1),
                             "Out msg nelems": 1024 * (k + 1), "Group size": world, "dtype": "Float",
                             "Process Group Name": "0", "Process Group Ranks": str(list(range(world))),
                             "Seq": step * kernels + k})
            events.append({"ph": "X", "cat": "kernel",
                           "name": "ncclKernel_AllReduce_RING_LL_Sum_float" if nccl else f"gemm_{k % 3}",
                           "pid": 0, "tid": args["stream"], "ts": ts + 20 + rank, "dur": 3000 + 11 * k + rank,
                           "args": args})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "traceEvents": events}


def _write_run(directory: Path, world: int = 4) -> Path:
    directory.mkdir(parents=True)
    for rank in range(world):
        text = json.dumps(_trace(rank, world))
        if rank % 2:
            (directory / f"rank{rank}.json").write_text(text)
        else:
            with gzip.open(directory / f"rank{rank}.json.gz", "wt") as handle:
                handle.write(text)
    (directory / "config.json").write_text('{"not": "a trace"}')  # skipped, with a reason
    return directory


# --- tests --------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def forkable(monkeypatch):
    """Other tests of a session leave idle threads in pytest's process (loggers, progress monitors), which
    makes read_traces refuse to fork; these tests fork it on purpose (the rule has its own test)."""
    monkeypatch.setattr(reader, "_can_fork", lambda: True)


@needs_shared
@pytest.mark.parametrize("name", [p.name for p in _sets()])
def test_parallel_load_equals_serial_on_shared_traces(name):
    serial = _fields(load_traces([SHARED / name], workers=1))
    parallel = _fields(load_traces([SHARED / name], workers=4))
    assert parallel == serial


@needs_shared
def test_parallel_analysis_equals_serial_on_shared_traces():
    sets = [p for p in _sets() if len(list(p.iterdir())) > 1]
    assert sets, "no multi-file set among the shared traces"
    serial = [json.dumps(analyze_traces([s], workers=1), sort_keys=True) for s in sets]
    parallel = [json.dumps(analyze_traces([s], workers=3), sort_keys=True) for s in sets]
    assert parallel == serial


def test_workers_analyse_the_ranks_they_read_unless_the_set_decides_the_step_filter_otherwise(tmp_path, monkeypatch):
    """Each worker analyses the ranks it reads, and the result equals one process's. HTA drops the last step by the
    step names of all ranks together; a rank whose own names decide otherwise is analysed again here."""
    from shardlight.trace import analysis

    log = tmp_path / "analysed.txt"
    real = analysis._analyze

    def logged(record, *args, **kwargs):
        with open(log, "a") as handle:  # workers append too
            handle.write(f"{os.getpid()} {record.rank}\n")
        return real(record, *args, **kwargs)

    monkeypatch.setattr(analysis, "_analyze", logged)

    def analysed() -> list[tuple[int, int]]:
        done = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
        log.unlink()
        return done

    run = _write_run(tmp_path / "run")
    for include_last in (False, True):
        serial = analyze_traces([run], include_last_step=include_last, workers=1)
        assert analysed() == [(os.getpid(), rank) for rank in range(4)]
        assert analyze_traces([run], include_last_step=include_last, workers=2) == serial
        done = analysed()
        assert sorted(rank for _, rank in done) == [0, 1, 2, 3]  # each once, in a worker
        assert os.getpid() not in {pid for pid, _ in done}
    # Rank 2 profiled one step only: by its own names the filter does not apply, by the set's it does (and keeps
    # what ends by its last step's end).
    one_step = tmp_path / "one_step"
    one_step.mkdir()
    for rank in range(4):
        trace = _trace(rank, 4, steps=1 if rank == 2 else 3)
        (one_step / f"rank{rank}.json").write_text(json.dumps(trace))
    serial = analyze_traces([one_step], include_last_step=True, workers=1)
    analysed()
    assert analyze_traces([one_step], include_last_step=True, workers=2) == serial
    done = analysed()
    assert sorted(rank for _, rank in done) == [0, 1, 2, 2, 3]
    assert (os.getpid(), 2) == done[-1]  # again here, after all were read


def test_parallel_load_equals_serial_on_synthetic_run(tmp_path):
    run = _write_run(tmp_path / "run")
    serial = _fields(load_traces([run], workers=1))
    assert [r["rank"] for r in serial[0]] == [0, 1, 2, 3]
    assert [Path(s["file"]).name for s in serial[1]] == ["config.json"]
    for workers in (2, 3, 8):
        assert _fields(load_traces([run], workers=workers)) == serial
    # Files named one by one, and a directory and a file together, read the same way too.
    files = sorted(p for p in run.iterdir() if p.name.startswith("rank"))
    assert _fields(load_traces(files, workers=2))[0] == serial[0]


def test_workers_really_are_other_processes_when_asked_or_the_bytes_make_it_pay(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "run")
    files = sorted(p for p in run.iterdir() if p.name.startswith("rank"))
    real = reader._read_trace

    def read_and_say_where(path):
        record = real(path)
        record.path = f"{record.path}@{os.getpid()}"
        return record

    monkeypatch.setattr(reader, "_read_trace", read_and_say_where)
    pids = {r.path.rsplit("@", 1)[1] for r in reader.read_traces(files, workers=2)[0].values()}
    assert str(os.getpid()) not in pids
    # Small files on their own stay in this process (a pool would cost more than it saves)...
    pids = {r.path.rsplit("@", 1)[1] for r in reader.read_traces(files)[0].values()}
    assert pids == {str(os.getpid())}
    # ...enough bytes in all go to workers.
    monkeypatch.setattr(reader, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(reader.os, "sched_getaffinity", lambda pid: {0, 1})
    pids = {r.path.rsplit("@", 1)[1] for r in reader.read_traces(files)[0].values()}
    assert str(os.getpid()) not in pids
    assert reader._worker_count(dict.fromkeys(files, 1 << 30), None) == 2
    assert reader._worker_count(dict.fromkeys(files, 1 << 30), 3) == 3
    assert reader._worker_count(dict.fromkeys(files[:2], 1 << 30), 8) == 2  # not more than files


def test_a_worker_that_dies_means_a_read_here(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "run")
    files = sorted(p for p in run.iterdir() if p.name.startswith("rank"))
    serial = {path: asdict(record) for path, record in reader.read_traces(files, workers=1)[0].items()}
    here, real = os.getpid(), reader._read_or_error

    def killed_in_a_worker(path):
        if os.getpid() != here:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return real(path)

    monkeypatch.setattr(reader, "_read_or_error", killed_in_a_worker)
    assert {path: asdict(record) for path, record in reader.read_traces(files, workers=2)[0].items()} == serial


def test_a_threaded_process_reads_here(tmp_path, monkeypatch):
    import threading

    monkeypatch.undo()  # the real check, not the autouse fixture's
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert not reader._can_fork()
        assert reader._worker_count({tmp_path / "a.json": 10, tmp_path / "b.json": 10}, 2) == 1
    finally:
        stop.set()
        thread.join()


def _corrupt(directory: Path) -> dict[str, Path]:
    good = _write_run(directory)
    gz = (good / "rank0.json.gz").read_bytes()
    bad = {
        "truncated_gzip": gz[: len(gz) // 2],
        "corrupt_gzip": gz[:20] + bytes(b ^ 0x5A for b in gz[20:60]) + gz[60:],
        "trailing_bytes_gzip": gz + b"junk",
        "truncated_json": (good / "rank1.json").read_bytes()[:5000],
        "not_utf8": b'{"traceEvents": [{"name": "\xff"}]}',
    }
    paths = {}
    for name, data in bad.items():
        paths[name] = good / f"{name}.json"
        paths[name].write_bytes(data)
    return paths


def test_worker_error_is_the_same_one_line_error(tmp_path):
    bad = _corrupt(tmp_path / "run")
    run = tmp_path / "run"
    good = sorted(p for p in run.iterdir() if p.name.startswith("rank"))
    for name, path in bad.items():
        messages = []
        for workers in (1, 2):
            with pytest.raises(ShardlightError) as caught:
                load_traces([*good, path], workers=workers)
            messages.append(str(caught.value))
        assert messages[0] == messages[1], name
        assert "\n" not in messages[1] and messages[1].startswith(str(path)), messages[1]
    assert "corrupt gzip data" in str(pytest.raises(ShardlightError, reader.read_trace, bad["trailing_bytes_gzip"]).value)


def test_worker_errors_in_a_directory_are_the_same_skips(tmp_path):
    _corrupt(tmp_path / "run")
    serial = _fields(load_traces([tmp_path / "run"], workers=1))
    parallel = _fields(load_traces([tmp_path / "run"], workers=2))
    assert parallel == serial
    assert len(serial[1]) == 6 and all("\n" not in s["reason"] for s in serial[1])


def test_missing_path_is_reported_in_order(tmp_path):
    run = _write_run(tmp_path / "run")
    for workers in (1, 2):
        with pytest.raises(ShardlightError, match="no such file or directory"):
            load_traces([run, tmp_path / "absent"], workers=workers)
        with pytest.raises(ShardlightError, match="no trace files"):
            (tmp_path / "empty").mkdir(exist_ok=True)
            load_traces([tmp_path / "empty", run], workers=workers)
