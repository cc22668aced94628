"""Read several trace files -- or one large file's fast scan, in parts -- in forked worker processes when
the bytes and idle CPUs make that pay (:func:`read_traces`); the results equal :func:`.reader.read_trace`'s,
errors included (the same one-line ShardlightError)."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows, where nothing is forked (_can_fork)
    fcntl = None

from shardlight.errors import ShardlightError
from shardlight.trace import fastscan, reader
from shardlight.trace.fastscan import FastPathMiss, Part, merge_parts, scan_part
from shardlight.trace.records import TraceRecord

__all__ = ["read_traces", "read_traces_then"]

# Decoding in worker processes (read_traces), measured on 2 idle cores (ABBA, wall time): two
# workers took 1.25x the serial time for 2 files of 3.4 MB in all, 0.99x for 8 files (7.3 MB),
# 0.72x for 2 files (20 MB) and 0.59x for 2 files (51 MB); with another process busy they lost
# at every size (1.13-1.69x), hence the idle-CPU check (_idle_cpus). That was with a process pool
# (two children, this process waiting); with this process reading a share itself and one forked
# child (_run_shared), thresholds of 4 MB instead of 12 MB took a whole analysis (``analyze_traces``
# of a set, medians of 6 interleaved runs) from 64 to 55 ms for 8 files of 7.3 MB, 67 to 61 ms for
# one file of 9.8 MB, 76 to 66 ms for one of 16 MB; with the child's results no longer waiting on a
# 64 KiB pipe, 2 files of 3.4 MB went from 31 to 28 ms at a threshold of 3 MB (1 MB gained nothing more).
_PARALLEL_MIN_BYTES = 3 << 20  # decompressed bytes of all the files together
# A file is scanned in parts of at least this many decompressed bytes. Each part inflates the
# file (about a fourteenth of a scan's time) and scans its share of the blocks, and does nothing
# else between them: two parts took 0.56 of a scan each on the 54 MB shared trace, against 0.59
# when each part also cut the others' blocks into runs of events.
_SPLIT_MIN_BYTES = 4 << 20
# ...into at most this many parts.
_MAX_PARTS = 4
_PIPE_BYTES = 1 << 20
# A file's parts take its blocks from a pipe of block numbers (_claims), written in full before any part
# starts: at most what a pipe holds by default (64 KiB), 16384 blocks, 32 GiB. A larger file's parts
# take every n-th block instead.
_CLAIM_BYTES = 4
_MAX_CLAIMS = (64 << 10) // _CLAIM_BYTES
_LOOKS = 4  # at the run queue (_idle_cpus)
# A file, and which part of how many, and the read end of its parts' block numbers (-1: every n-th)
# (None: all of the file).
_Task = tuple[Path, tuple[int, int, int] | None]
_Then = Callable[[TraceRecord], Any]


def read_traces(paths: list[Path], workers: int | None = None) -> dict[Path, TraceRecord | ShardlightError]:
    """``read_trace`` of each file, in worker processes when that pays: path -> record, or the
    ShardlightError its read raised (the same one-line message as a read here).

    ``workers``: None decides: up to one process per idle CPU (``make -l``-like, see
    ``_idle_cpus``) when there are at least ``_PARALLEL_MIN_BYTES``
    decompressed bytes in all, else a read here (``shardlight analyze --workers N`` sets the number).
    1 reads here; n > 1 uses up to n processes, this one included, whatever the size and load. Fewer
    files than workers: a large file's fast scan is cut into parts (:func:`.fastscan.merge_parts`).
    The other workers are forked (:func:`_can_fork`); elsewhere the files are read here. The results
    are the same either way.
    """
    return read_traces_then(paths, workers)[0]


def read_traces_then(paths: list[Path], workers: int | None = None, then: _Then | None = None,
                     ) -> tuple[dict[Path, TraceRecord | ShardlightError], dict[Path, Any]]:
    """:func:`read_traces`, and ``then(record)`` of each file read whole in a worker, called in that worker
    right after its read (so the work is shared too): path -> its value. A file read here, or in parts, has
    none: the caller does that work itself."""
    paths = list(dict.fromkeys(paths))
    sizes = {path: _decoded_size(path) for path in paths}
    count = _worker_count(sizes, workers)
    claims: list[int] = []
    try:
        tasks = _plan(sizes, count, claims) if count > 1 else []
        if len(tasks) > 1:
            costs = [sizes[path] / (part[1] if part else 1) for path, part in tasks]

            def finish(results: list) -> tuple[dict[Path, TraceRecord | ShardlightError], dict[Path, Any]]:
                thens = {path: after for (path, _), (_, after) in zip(tasks, results) if after is not None}
                return _assemble(paths, tasks, [result for result, _ in results]), thens

            done = _run_shared(tasks, _shares(costs, min(count, len(tasks))), then, finish)
            if done is not None:
                return done
    finally:
        for read_end in claims:
            os.close(read_end)
    return {path: _read_or_error(path) for path in paths}, {}


def _shares(costs: list[float], count: int) -> list[list[int]]:
    """Task indices per process (this one first): the costliest task goes to the least loaded process."""
    shares: list[list[int]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        least = loads.index(min(loads))
        shares[least].append(index)
        loads[least] += costs[index]
    return [sorted(share) for share in shares if share]


def _run_shared(tasks: list[_Task], shares: list[list[int]], then: _Then | None = None,
                finish: Callable[[list], Any] = list) -> Any | None:
    """Each share's tasks run in its own process -- the first here, the others in forked children that
    send their results back pickled through a pipe -- so none sits idle waiting. Returns
    ``finish(results)``, run before the children are reaped: a child's exit (unmapping its memory) takes
    1-3 ms, spent while this process assembles. None if a child could not be started or died (killed,
    out of memory): the caller reads here, where any error shows. However this ends (an interrupt
    included), no child is left running or unreaped."""
    children: list[tuple[int, int, list[int]]] = []  # (pid, read end, share) not reaped yet
    try:
        for share in shares[1:]:
            try:
                read_end, write_end = os.pipe()
                _widen(write_end)
                pid = os.fork()
            except OSError:  # out of processes or memory: the rest is read here
                return None
            if pid == 0:  # the child: its results, then out at once (no interpreter teardown)
                status = 1
                try:
                    os.close(read_end)
                    data = pickle.dumps([_run_task(tasks[index], then) for index in share])
                    with os.fdopen(write_end, "wb") as pipe:  # its length first: all of it came, or not
                        pipe.write(len(data).to_bytes(8, "little") + data)
                    status = 0
                finally:
                    os._exit(status)
            os.close(write_end)
            children.append((pid, read_end, share))
        results: list = [None] * len(tasks)
        for index in shares[0]:
            results[index] = _run_task(tasks[index], then)
        sent = []
        for number, (pid, read_end, share) in enumerate(children):
            with os.fdopen(read_end, "rb", closefd=False) as pipe:
                sent.append(pipe.read())
            os.close(read_end)
            children[number] = (pid, -1, share)
        complete = all(len(data) >= 8 and int.from_bytes(data[:8], "little") == len(data) - 8 for data in sent)
        if complete:
            for (_, _, share), data in zip(children, sent):
                for index, result in zip(share, pickle.loads(memoryview(data)[8:])):
                    results[index] = result
            finished = finish(results)
        while children:
            _, status = os.waitpid(children[0][0], 0)
            children.pop(0)
            complete = complete and status == 0
        return finished if complete else None
    finally:
        for pid, read_end, _ in children:  # this process stopped first (an error or an interrupt)
            if read_end >= 0:
                os.close(read_end)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _read_or_error(path: Path) -> TraceRecord | ShardlightError:
    try:
        return reader.read_trace(path)
    except ShardlightError as exc:
        return ShardlightError(str(exc))


def _run_task(task: _Task, then: _Then | None) -> tuple[TraceRecord | ShardlightError | Part | None, Any]:
    """A whole file's read and ``then`` of its record (None if none), or a part's fast scan (None: the
    part could not be sure of it) and None."""
    path, part = task
    if part is None:
        result = _read_or_error(path)
        return result, then(result) if then is not None and isinstance(result, TraceRecord) else None
    index, parts, claims = part
    try:
        return scan_part(path, reader._CHUNK_CHARS, index, parts, None if claims < 0 else partial(_claim, claims)), None
    except FastPathMiss:
        return None, None


def _claim(claims: int) -> int | None:
    """The next block no part of the file has taken, from its pipe of block numbers (None: none left).

    Linux reads a pipe under its lock, so each reader gets whole numbers, each number once."""
    data = os.read(claims, _CLAIM_BYTES)
    return int.from_bytes(data, "little") if len(data) == _CLAIM_BYTES else None


def _claims(size: int) -> int:
    """A pipe of the numbers of the blocks of a file of about ``size`` decompressed bytes (and one more
    block, should the size be short), all written: its read end, or -1 if they do not fit (the parts then
    take every n-th block).

    The write never waits: a pipe may hold less than its usual 64 KiB (Linux gives a user over
    /proc/sys/fs/pipe-user-pages-soft one page per pipe), and nothing reads it yet."""
    blocks = size // fastscan.PART_BLOCK + 2
    if blocks > _MAX_CLAIMS:
        return -1
    try:
        read_end, write_end = os.pipe()
    except OSError:  # out of file descriptors
        return -1
    numbers = b"".join(number.to_bytes(_CLAIM_BYTES, "little") for number in range(blocks))
    try:
        os.set_blocking(write_end, False)
        written = os.write(write_end, numbers)
    except OSError:  # BlockingIOError: the pipe is full already
        written = -1
    finally:
        os.close(write_end)
    if written != len(numbers):
        os.close(read_end)
        return -1
    return read_end


def _assemble(paths: list[Path], tasks: list[_Task], results: list) -> dict[Path, TraceRecord | ShardlightError]:
    """What read_trace gives for each path, from the tasks' results (parts in file order)."""
    parts: dict[Path, list] = {}
    for (path, _), result in zip(tasks, results):
        parts.setdefault(path, []).append(result)
    split = {path for path, part in tasks if part is not None}
    out: dict[Path, TraceRecord | ShardlightError] = {}
    for path in paths:
        done = parts[path]
        if path not in split:
            out[path] = done[0]
            continue
        try:
            if None in done:
                raise FastPathMiss("a part missed")
            record = merge_parts(done)
            if record.gpu_ts:
                out[path] = record
                continue
        except FastPathMiss:
            pass
        try:  # as read_trace: a file the fast scan is not sure of, or without device rows
            out[path] = reader._read_trace(path)
        except ShardlightError as exc:
            out[path] = ShardlightError(str(exc))
    return out


def _widen(pipe: int) -> None:
    """Let a child write its results (about 0.5 MB for a 51 MB trace's half) without waiting for this
    process to finish its own share and read: a pipe holds 64 KiB by default (Linux: up to
    /proc/sys/fs/pipe-max-size, 1 MiB unless raised)."""
    try:
        fcntl.fcntl(pipe, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (AttributeError, OSError):  # fcntl is None, or has no F_SETPIPE_SZ (not Linux)
        pass  # another system, or a lower limit: the child waits for the read instead


def _plan(sizes: dict[Path, int], count: int, claims: list[int]) -> list[_Task]:
    """One task per file, or per part of a large file when there are fewer files than workers (the read
    ends of the parts' block numbers are added to ``claims``, for the caller to close)."""
    if len(sizes) >= count:
        return [(path, None) for path in sizes]
    tasks: list[_Task] = []
    for path, size in sizes.items():
        pieces = min(count, _MAX_PARTS, size // _SPLIT_MIN_BYTES)
        if pieces > 1:
            read_end = _claims(size)
            if read_end >= 0:
                claims.append(read_end)
            tasks.extend((path, (index, pieces, read_end)) for index in range(pieces))
        else:
            tasks.append((path, None))
    return tasks


def _can_fork() -> bool:
    """Workers are forked: on Linux, and from a single-threaded process only (forking a threaded one may
    deadlock on a lock another thread held)."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def _worker_count(sizes: dict[Path, int], workers: int | None) -> int:
    if not _can_fork() or not sizes:
        return 1
    if workers is None:
        if sum(sizes.values()) < _PARALLEL_MIN_BYTES:
            return 1
        workers = _idle_cpus()
    return max(workers, 1)


def _idle_cpus() -> int:
    """CPUs this process may use (affinity, and a cgroup v2 quota) that no other task runs on now.

    "Now" is the kernel's count of runnable tasks (/proc/loadavg), not the 1-minute load average,
    which still counts a process that ended seconds ago: the least of up to ``_LOOKS`` looks 1 ms
    apart, stopping at the first that sees no other task. A busy process is runnable in all of them;
    a task that wakes for a moment is not (right after this process starts, one was seen in every
    look of three for 2 ms in one run of six). Where there is no such count, the load average
    stands in. This process's own running threads are not others: just after ``import numpy``
    OpenBLAS's threads spin for some tens of ms, and counted as others they made the read of the
    first (and largest) trace set serial in most runs.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    try:
        busy = float("inf")
        for look in range(_LOOKS):
            if look:
                time.sleep(0.001)
            own = _own_running_threads()  # before and after: a thread may stop running in between
            running = _running_tasks()
            busy = min(busy, running - max(own, _own_running_threads()))
            if busy <= 0:
                break
    except (OSError, ValueError, IndexError):
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
    return max(1, min(cpus, int(cpus - busy + 0.5)))


def _running_tasks() -> int:
    """The kernel's count of runnable tasks (threads) on the machine now, this process's included."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


def _own_running_threads() -> int:
    """This process's threads the kernel counts as running now (itself at least: it is reading)."""
    running = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            running += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            pass
    return max(running, 1)


def _decoded_size(path: Path) -> int:
    """About how many bytes reading ``path`` decodes: a gzip file's trailer says (mod 4 GiB)."""
    try:
        with open(path, "rb") as handle:
            if handle.read(2) != b"\x1f\x8b":
                return os.fstat(handle.fileno()).st_size
            size = handle.seek(0, os.SEEK_END)
            if size < 20:
                return size
            handle.seek(-4, os.SEEK_END)
            inflated = int.from_bytes(handle.read(4), "little")
            return inflated if inflated >= size else size * 16  # wrapped past 4 GiB
    except OSError:
        return 0  # the read words the error
