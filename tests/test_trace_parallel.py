"""Decoding a run's trace files in worker processes gives what reading them one by one gives.

The shared real traces and a synthetic multi-file set are loaded both ways and compared field by
field; a file a worker cannot read gives the same one-line error (or skip reason) as a serial read.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from shardlight.errors import ShardlightError
from shardlight.trace import analyze_traces, fastscan, parallel, reader
from shardlight.trace.analysis import load_traces
from shardlight.trace.fastscan import merge_parts, scan_part

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARDLIGHT_SHARED_TRACES") or REPO.parent / "shared" / "traces")
needs_shared = pytest.mark.skipif(not (SHARED / "reference.json").is_file(),
                                  reason=f"shared reference traces not found at {SHARED} (set SHARDLIGHT_SHARED_TRACES)")


def _sets() -> list[Path]:
    return sorted(p for p in SHARED.iterdir() if p.is_dir()) if SHARED.is_dir() else []


def _fields(loaded):
    records, skipped = loaded
    return [asdict(record) for record in records], skipped


# --- synthetic traces (Kineto's key order, so the fast scanner reads them) ---------------------

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

@needs_shared
@pytest.mark.parametrize("name", [p.name for p in _sets()])
def test_parallel_load_equals_serial_on_shared_traces(name):
    serial = _fields(load_traces([SHARED / name], workers=1))
    parallel = _fields(load_traces([SHARED / name], workers=4))
    assert parallel == serial


@needs_shared
def test_parallel_analysis_equals_serial_on_shared_traces(monkeypatch):
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
        with open(log, "a") as handle:  # children append too
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
        assert sorted(rank for _, rank in analysed()) == [0, 1, 2, 3]
        assert analyze_traces([run], include_last_step=include_last, workers=2) == serial
        done = analysed()
        assert sorted(rank for _, rank in done) == [0, 1, 2, 3]  # each once
        assert len({pid for pid, _ in done}) == 2 and os.getpid() in {pid for pid, _ in done}
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


@pytest.fixture(autouse=True)
def forkable(monkeypatch):
    """Other tests of a session leave idle threads in pytest's process (loggers, progress monitors), which
    makes read_traces refuse to fork; these tests fork it on purpose (the rule has its own test)."""
    monkeypatch.setattr(parallel, "_can_fork", lambda: True)


def test_workers_really_are_other_processes(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "run")
    files = sorted(p for p in run.iterdir() if p.name.startswith("rank"))
    real = reader.read_trace

    def read_and_say_where(path):
        record = real(path)
        record.path = f"{record.path}@{os.getpid()}"
        return record

    monkeypatch.setattr(reader, "read_trace", read_and_say_where)
    # Two workers: this process reads a share, and one forked child the rest.
    pids = {r.path.rsplit("@", 1)[1] for r in parallel.read_traces(files, workers=2).values()}
    assert str(os.getpid()) in pids and len(pids) == 2
    # Small files on their own stay in this process (a fork would cost more than it saves)...
    monkeypatch.setattr(parallel, "_idle_cpus", lambda: 2)
    pids = {r.path.rsplit("@", 1)[1] for r in parallel.read_traces(files).values()}
    assert pids == {str(os.getpid())}
    # ...enough bytes in all are shared with a child, unless the CPUs are busy (the run queue says).
    monkeypatch.setattr(parallel, "_PARALLEL_MIN_BYTES", 0)
    pids = {r.path.rsplit("@", 1)[1] for r in parallel.read_traces(files).values()}
    assert len(pids) == 2
    monkeypatch.setattr(parallel, "_idle_cpus", lambda: 1)
    pids = {r.path.rsplit("@", 1)[1] for r in parallel.read_traces(files).values()}
    assert pids == {str(os.getpid())}


def test_a_child_that_dies_is_read_here_and_a_failure_here_leaves_no_child(tmp_path, monkeypatch):
    run = _write_run(tmp_path / "run")
    files = sorted(p for p in run.iterdir() if p.name.startswith("rank"))
    serial = {path: asdict(record) for path, record in parallel.read_traces(files, workers=1).items()}
    here, real = os.getpid(), parallel._run_task

    def killed_in_a_child(task, then):
        if os.getpid() != here:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return real(task, then)

    monkeypatch.setattr(parallel, "_run_task", killed_in_a_child)
    assert {path: asdict(record) for path, record in parallel.read_traces(files, workers=2).items()} == serial

    class Cut(bytes):  # what a child killed while writing leaves: fewer bytes than its length says
        def __len__(self):
            return super().__len__() + 5

    real_dumps = parallel.pickle.dumps
    monkeypatch.setattr(parallel.pickle, "dumps", lambda value: Cut(real_dumps(value)[:-5]) if os.getpid() != here
                        else real_dumps(value))
    monkeypatch.setattr(parallel, "_run_task", real)
    assert {path: asdict(record) for path, record in parallel.read_traces(files, workers=2).items()} == serial
    monkeypatch.setattr(parallel.pickle, "dumps", real_dumps)

    def no_more_processes():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(parallel.os, "fork", no_more_processes)  # as fork fails at a process limit
    assert {path: asdict(record) for path, record in parallel.read_traces(files, workers=2).items()} == serial
    monkeypatch.undo()
    monkeypatch.setattr(parallel, "_can_fork", lambda: True)

    def fails_here(task, then):
        if os.getpid() == here:
            raise KeyboardInterrupt
        time.sleep(30)  # a child still at work when this process stops
        return real(task, then)

    monkeypatch.setattr(parallel, "_run_task", fails_here)
    forked, real_fork = [], os.fork

    def fork_and_say():
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(parallel.os, "fork", fork_and_say)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        parallel.read_traces(files, workers=2)
    assert time.monotonic() - started < 10  # the child was killed, not waited for
    assert forked
    for pid in forked:  # and reaped: no such child left (other tests' children may be)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_shares_put_the_costliest_task_on_the_least_loaded_process():
    assert parallel._shares([5.0, 1.0, 1.0, 1.0, 4.0], 2) == [[0, 2], [1, 3, 4]]
    assert parallel._shares([1.0, 1.0], 4) == [[0], [1]]  # no process without a task


def test_worker_count_explicit_or_from_the_bytes_and_idle_cpus(tmp_path, monkeypatch):
    files = {tmp_path / "a.json": 10, tmp_path / "b.json": 10}
    assert parallel._worker_count(files, 2) == 2
    assert parallel._worker_count(files, 1) == 1
    assert parallel._worker_count(files, None) == 1  # 20 bytes: not worth a pool
    monkeypatch.setattr(parallel, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(parallel, "_idle_cpus", lambda: 3)
    assert parallel._worker_count(files, None) == 3


def test_idle_cpus_do_not_count_this_processs_own_running_threads(monkeypatch):
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(parallel.Path, "read_text", _no_cgroup_quota(parallel.Path.read_text))
    monkeypatch.setattr(parallel.time, "sleep", lambda seconds: None)
    looks = []
    monkeypatch.setattr(parallel, "_own_running_threads", lambda: 2)  # this thread and a spinning BLAS thread
    monkeypatch.setattr(parallel, "_running_tasks", lambda: looks.append(1) or 2)
    assert parallel._idle_cpus() == 2 and len(looks) == 1  # no other task: the first look says so
    looks.clear()
    monkeypatch.setattr(parallel, "_running_tasks", lambda: looks.append(1) or 3)
    assert parallel._idle_cpus() == 1 and len(looks) == parallel._LOOKS  # another busy task, in every look
    seen = iter([3, 3, 2, 3])
    monkeypatch.setattr(parallel, "_running_tasks", lambda: next(seen))
    assert parallel._idle_cpus() == 2  # a task that woke for a moment is not busy


def _no_cgroup_quota(read_text):
    def read(path, *args, **kwargs):
        if str(path) == "/sys/fs/cgroup/cpu.max":
            return "max 100000\n"
        return read_text(path, *args, **kwargs)
    return read


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="thread states are read from Linux's /proc")
def test_own_running_threads_counts_a_thread_at_work_outside_the_gil():
    import hashlib
    import threading

    data, stop = b"x" * (64 << 20), threading.Event()

    def hash_until_stopped():  # hashlib lets go of the GIL over large inputs: this thread stays runnable
        while not stop.is_set():
            hashlib.sha256(data).digest()

    alone = min(parallel._own_running_threads() for _ in range(20))  # this thread (others of pytest's sleep)
    thread = threading.Thread(target=hash_until_stopped)
    thread.start()
    try:
        assert max(parallel._own_running_threads() for _ in range(200)) >= alone + 1
    finally:
        stop.set()
        thread.join()


def test_a_threaded_process_reads_here(tmp_path, monkeypatch):
    import threading

    monkeypatch.undo()  # the real check, not the autouse fixture's
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert not parallel._can_fork()
        assert parallel._worker_count({tmp_path / "a.json": 10, tmp_path / "b.json": 10}, 2) == 1
    finally:
        stop.set()
        thread.join()


def _in_parts(path: Path, parts: int) -> dict:
    """merge_parts of all ``parts`` parts of the file, as a dict."""
    return asdict(merge_parts([scan_part(path, reader._CHUNK_CHARS, index, parts) for index in range(parts)]))


def _in_claimed_parts(path: Path, owners: list[int]) -> dict:
    """merge_parts of parts that claimed their blocks as they went: part ``owners[n]`` took block n (each part's
    blocks in increasing order, as taking them from one counter gives, whatever the parts' speeds)."""
    parts = max(owners) + 1
    taken = [iter([n for n, owner in enumerate(owners) if owner == part]) for part in range(parts)]
    return asdict(merge_parts([scan_part(path, reader._CHUNK_CHARS, part, parts, lambda it=taken[part]: next(it, None))
                               for part in range(parts)]))


def _owners(blocks: int, parts: int, seed: int) -> list[int]:
    """Who took each block: in turn, one part all, and runs of random lengths (a part taking several in a row)."""
    import random

    pick = random.Random(seed)
    owners, part = [], 0
    while len(owners) < blocks:
        owners += [part] * pick.randint(1, 3)
        part = pick.randrange(parts)
    return [[n % parts for n in range(blocks)], [parts - 1] * blocks, owners[:blocks]][seed % 3]


@needs_shared
@pytest.mark.parametrize("name", [p.name for p in _sets()])
def test_scan_in_claimed_parts_equals_one_scan_on_shared_traces(name, monkeypatch):
    for path in sorted((SHARED / name).iterdir()):
        whole = asdict(reader.read_trace(path))
        for seed, block in enumerate((fastscan.PART_BLOCK, 65_537, 30_011, 65_537, 30_011, 1 << 20)):
            monkeypatch.setattr(fastscan, "PART_BLOCK", block)
            blocks = parallel._decoded_size(path) // block + 2
            merged = _in_claimed_parts(path, _owners(blocks, 2 + seed % 2, seed))
            assert merged == whole
            assert list(merged["launch_ts"]) == list(whole["launch_ts"])


@needs_shared
@pytest.mark.parametrize("name", [p.name for p in _sets()])
def test_scan_in_parts_equals_one_scan_on_shared_traces(name, monkeypatch):
    for path in sorted((SHARED / name).iterdir()):
        whole = reader.read_trace(path)
        # Blocks of 2 MiB, and odd ones: 65 kB, and 30 kB (the first ends in the header, before any event).
        for parts, block in ((2, fastscan.PART_BLOCK), (3, 65_537), (2, 30_011)):
            monkeypatch.setattr(fastscan, "PART_BLOCK", block)
            merged = _in_parts(path, parts)
            assert merged == asdict(whole)
            assert list(merged["launch_ts"]) == list(whole.launch_ts)  # the same order, too


def test_one_large_file_is_read_in_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "_CHUNK_CHARS", 1 << 13)  # many windows, so the parts interleave
    monkeypatch.setattr(fastscan, "PART_BLOCK", 1 << 13)
    monkeypatch.setattr(parallel, "_SPLIT_MIN_BYTES", 1 << 12)
    path = tmp_path / "big.json.gz"
    trace = _trace(rank=3, world=4, steps=4, kernels=300)
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps(trace))
    serial = asdict(reader.read_trace(path))
    claims: list[int] = []
    tasks = parallel._plan({path: parallel._decoded_size(path)}, 3, claims)
    assert len(claims) == 1 and tasks == [(path, (index, 3, claims[0])) for index in range(3)]
    blocks = parallel._decoded_size(path) // fastscan.PART_BLOCK + 2  # the file's blocks, and one more
    assert [parallel._claim(claims[0]) for _ in range(blocks + 1)] == [*range(blocks), None]
    os.close(claims[0])
    assert asdict(parallel.read_traces([path], workers=3)[path]) == serial
    for parts in (2, 5):
        assert _in_parts(path, parts) == serial
    # The rank, world and groups from a distributedInfo after the events (the block with the array's
    # end reads it), and a bare array of events (the blocks agree that nothing follows it).
    info = trace.pop("distributedInfo")
    after = tmp_path / "info_after.json"
    after.write_text(json.dumps({**trace, "distributedInfo": info, "deviceProperties": [{"id": 0}, {"id": 1}]}))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(trace["traceEvents"]))
    for other in (after, bare):
        whole = asdict(reader.read_trace(other))
        assert whole["rank"] == (3 if other == after else 0)
        for parts in (2, 3):
            assert _in_parts(other, parts) == whole
        assert asdict(parallel.read_traces([other], workers=3)[other]) == whole
    # A block that would begin inside an event (at a "}, {" in a string, or between objects nested in
    # args) never gives another record: its scan or the one before it misses (the file is then read
    # in full), or both read what they cut exactly as one scan would. So does an event as long as blocks.
    odd = json.loads(json.dumps(trace))
    odd["traceEvents"].insert(len(trace["traceEvents"]) // 2, {
        "ph": "X", "cat": "cpu_op", "name": 'f({"a"}, {"b"})', "pid": 0, "tid": 1, "ts": 5, "dur": 1,
        "args": {"Input dims": [{"x": 1}, {"y": 2}]}})
    odd_path = tmp_path / "odd_event.json"
    odd_path.write_text(json.dumps(odd))
    whole = asdict(reader.read_trace(odd_path))
    text = odd_path.read_bytes()
    event = text.index(b'"cat": "cpu_op"')
    inside = [at for at in range(event, text.index(b"]}}", event)) if text.startswith(b"}, {", at)]
    assert len(inside) == 2
    for block in (offset for at in inside for offset in range(at - 2, at + 3)):
        monkeypatch.setattr(fastscan, "PART_BLOCK", block)
        try:
            assert _in_parts(odd_path, 2) == whole
        except fastscan.FastPathMiss:
            pass
        assert asdict(parallel.read_traces([odd_path], workers=2)[odd_path]) == whole
    long = json.loads(json.dumps(trace))
    next(event for event in long["traceEvents"][len(trace["traceEvents"]) // 2:] if "args" in event)["args"].update(
        long="z" * (3 << 13))
    long_path = tmp_path / "long_event.json"
    long_path.write_text(json.dumps(long))
    monkeypatch.setattr(fastscan, "PART_BLOCK", 1 << 13)
    assert _in_parts(long_path, 3) == asdict(reader.read_trace(long_path))  # blocks in the event: empty
    # Files the fast scan is not sure of are read in full, as they are serially: a separator
    # inside a string, and a CPU trace (no device rows).
    odd = tmp_path / "odd.json"
    trace = _trace(rank=3, world=4, steps=4, kernels=300)
    trace["traceEvents"][700]["name"] = 'gemm_{lambda()#1}, {"odd": "name"}'
    odd.write_text(json.dumps(trace))
    with pytest.raises(fastscan.FastPathMiss):
        fastscan.scan_trace(odd, reader._CHUNK_CHARS)
    assert asdict(parallel.read_traces([odd], workers=2)[odd]) == asdict(reader.read_trace(odd))
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": f"gloo:all_reduce#{i}", "pid": 0,
                                                "tid": 1, "ts": 10 * i, "dur": 5} for i in range(3000)]}))
    assert asdict(parallel.read_traces([cpu], workers=2)[cpu]) == asdict(reader.read_trace(cpu))


def test_claimed_parts_find_one_float_timestamp_wherever_it_is_and_miss_unclaimed_blocks(tmp_path, monkeypatch):
    """A single float "ts" makes HTA round the whole file: parts that claim blocks look at every chunk they read, so
    one of them sees it whichever took its block. A block nobody claimed leaves the blocks unjoined: a miss."""
    monkeypatch.setattr(reader, "_CHUNK_CHARS", 1 << 12)
    monkeypatch.setattr(fastscan, "PART_BLOCK", 5_000)
    trace = _trace(rank=0, world=2, steps=3, kernels=120)
    plain = tmp_path / "ints.json"
    plain.write_text(json.dumps(trace))
    blocks = parallel._decoded_size(plain) // 5_000 + 2
    for row in (1, len(trace["traceEvents"]) // 3, len(trace["traceEvents"]) - 2):
        changed = json.loads(json.dumps(trace))  # a CPU op, which only the chunks' look for a float finds
        changed["traceEvents"].insert(row, {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 0, "tid": 1,
                                            "ts": changed["traceEvents"][row]["ts"] + 0.5, "dur": 1})
        path = tmp_path / f"float_{row}.json"
        path.write_text(json.dumps(changed))
        whole = asdict(reader.read_trace(path))  # one scan: it too looks at every chunk (it once lost the answer)
        assert whole["float_timestamps"] and reader._read_trace(path).float_timestamps
        for seed in range(6):
            assert _in_claimed_parts(path, _owners(blocks, 2, seed)) == whole
    assert not _in_claimed_parts(plain, _owners(blocks, 2, 2))["float_timestamps"]
    unread = iter([0, 1, *range(3, blocks)])  # block 2 is claimed by nobody
    parts = [scan_part(plain, reader._CHUNK_CHARS, 0, 2, lambda: next(unread, None)),
             scan_part(plain, reader._CHUNK_CHARS, 1, 2, lambda: None)]
    with pytest.raises(fastscan.FastPathMiss, match="join"):
        merge_parts(parts)


def test_block_numbers_that_do_not_fit_their_pipe_mean_every_nth_block_never_a_wait(monkeypatch):
    """A pipe may hold one page only (a user over pipe-user-pages-soft gets that): the numbers of 1,500 blocks do
    not fit, and the parts then take every n-th block instead of waiting on a write nobody reads."""
    real_pipe, opened = os.pipe, []

    def one_page_pipe():
        read_end, write_end = real_pipe()
        fcntl = pytest.importorskip("fcntl")
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
        opened.append(read_end)
        return read_end, write_end

    monkeypatch.setattr(parallel.os, "pipe", one_page_pipe)
    assert parallel._claims(1_500 * fastscan.PART_BLOCK) == -1
    with pytest.raises(OSError):  # and closed
        os.fstat(opened[0])
    claims = parallel._claims(100 * fastscan.PART_BLOCK)  # 102 numbers fit a page
    assert [parallel._claim(claims) for _ in range(103)] == [*range(102), None]
    os.close(claims)


def test_a_fractional_kernel_duration_is_read_in_full_wherever_it_is(tmp_path, monkeypatch):
    """With int timestamps, HTA's rounding depends on events the fast scan does not read, so a GPU row with a
    fractional duration sends the file to the full read: in a chunk the regex reads, in the file's last event
    (decoded on its own), and in any block of a scan in parts. A float duration with no fraction does not."""
    monkeypatch.setattr(reader, "_CHUNK_CHARS", 1 << 13)
    monkeypatch.setattr(fastscan, "PART_BLOCK", 1 << 13)
    trace = _trace(rank=1, world=2, steps=3, kernels=200)
    kernels = [index for index, event in enumerate(trace["traceEvents"]) if event["cat"] == "kernel"]
    assert kernels[-1] == len(trace["traceEvents"]) - 1
    for row, dur, misses in ((kernels[5], 2.5, True), (kernels[len(kernels) // 2], 0.25, True),
                             (kernels[-1], 3001.5, True), (kernels[5], 3000.0, False)):
        changed = json.loads(json.dumps(trace))
        changed["traceEvents"][row]["dur"] = dur
        path = tmp_path / f"dur_{row}_{dur}.json"
        path.write_text(json.dumps(changed))
        full = asdict(reader._read_trace(path))
        if misses:
            with pytest.raises(fastscan.FastPathMiss, match="fractional durations"):
                fastscan.scan_trace(path, reader._CHUNK_CHARS)
            for parts in (2, 3):
                with pytest.raises(fastscan.FastPathMiss, match="fractional durations"):
                    _in_parts(path, parts)
            assert asdict(reader.read_trace(path)) == full
            assert asdict(parallel.read_traces([path], workers=2)[path]) == full
        else:  # the fast scan keeps the CPU rows of the input pipeline only
            fast = asdict(fastscan.scan_trace(path, reader._CHUNK_CHARS))
            fast_rows = fast.pop("cpu_rows")
            assert fast_rows == {"enumerate(DataLoader)": []}
            assert fast == {key: value for key, value in full.items() if key != "cpu_rows"}
            assert _in_parts(path, 3) == asdict(reader.read_trace(path)) == dict(fast, cpu_rows=fast_rows)


def _corrupt(directory: Path) -> dict[str, Path]:
    good = _write_run(directory)
    gz = (good / "rank0.json.gz").read_bytes()
    bad = {
        "truncated_gzip": gz[: len(gz) // 2],
        "corrupt_gzip": gz[:20] + bytes(b ^ 0x5A for b in gz[20:60]) + gz[60:],
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


def test_worker_errors_in_a_directory_are_the_same_skips(tmp_path):
    _corrupt(tmp_path / "run")
    serial = _fields(load_traces([tmp_path / "run"], workers=1))
    parallel = _fields(load_traces([tmp_path / "run"], workers=2))
    assert parallel == serial
    assert len(serial[1]) == 5 and all("\n" not in s["reason"] for s in serial[1])


def test_missing_path_is_reported_in_order(tmp_path):
    run = _write_run(tmp_path / "run")
    for workers in (1, 2):
        with pytest.raises(ShardlightError, match="no such file or directory"):
            load_traces([run, tmp_path / "absent"], workers=workers)
        with pytest.raises(ShardlightError, match="no trace files"):
            (tmp_path / "empty").mkdir(exist_ok=True)
            load_traces([tmp_path / "empty", run], workers=workers)


# --- the analyze command's heap setting --------------------------------------------------------

_FAULTS = r"""
import resource, sys
from pathlib import Path
from shardlight.trace import analyze_traces
from shardlight.trace.chunks import keep_heap_top
kept = keep_heap_top() if sys.argv[2] == "pad" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
analyze_traces([Path(sys.argv[1])], workers=1)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@needs_shared
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="minor page faults are counted on Linux only")
def test_keeping_the_heap_top_saves_the_page_faults_of_a_large_read():
    # The truth: with glibc's default the 54 MB set's megabyte chunk buffers are faulted in again and again
    # (about 41,000 faults here); served from the heap, its top kept, they are faulted in once (about 2,900).
    big = SHARED / "hta_df_index_resolver_rank1"
    if not big.is_dir():
        pytest.skip(f"{big} not found")
    faults = {}
    for mode in ("default", "pad"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, str(big), mode], capture_output=True, text=True,
                             check=True).stdout.split()
        faults[mode] = int(out[-1])
        kept = out[0]
    if kept != "True":
        pytest.skip("not glibc: keep_heap_top changes nothing here")
    assert faults["pad"] * 4 < faults["default"], faults
