"""Read several trace files -- or one large file's fast scan, in parts -- in forked worker processes when
the bytes and idle CPUs make that pay (:func:`read_traces`); the results equal :func:`.reader.read_trace`'s,
errors included (the same one-line ShardlightError)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from shardlight.errors import ShardlightError
from shardlight.trace import reader
from shardlight.trace.fastscan import FastPathMiss, Part, merge_parts, scan_part
from shardlight.trace.records import TraceRecord

__all__ = ["read_traces"]

# Decoding in worker processes (read_traces), measured on 2 idle cores (ABBA, wall time): two
# workers took 1.25x the serial time for 2 files of 3.4 MB in all, 0.99x for 8 files (7.3 MB),
# 0.72x for 2 files (20 MB) and 0.59x for 2 files (51 MB); with another process busy they lost
# at every size (1.13-1.69x), hence the idle-CPU check (_idle_cpus).
_PARALLEL_MIN_BYTES = 12 << 20  # decompressed bytes of all the files together
# A file is scanned in parts of at least this many decompressed bytes. Each part inflates the
# whole file (a quarter of a scan's time) and scans its share of it: two parts took 0.76x of one
# scan for 54 MB, 0.87x for 26 MB, 0.95x for 17 MB (idle cores, wall time).
_SPLIT_MIN_BYTES = 12 << 20
# ...into at most this many parts: n parts take (0.27 + 0.73 / n) of a scan each, so more
# parts gain little (4: 2.2x faster for 1.8x the CPU; 8: 2.7x for 2.9x).
_MAX_PARTS = 4
_Task = tuple[Path, tuple[int, int] | None]  # a file, and which part of how many (None: all of it)


def read_traces(paths: list[Path], workers: int | None = None) -> dict[Path, TraceRecord | ShardlightError]:
    """``read_trace`` of each file, in worker processes when that pays: path -> record, or the
    ShardlightError its read raised (the same one-line message as a read here).

    ``workers``: None decides: up to one process per idle CPU (``make -l``-like, see
    ``_idle_cpus``) when there are at least ``_PARALLEL_MIN_BYTES``
    decompressed bytes in all, else a read here (``shardlight analyze --workers N`` sets the number).
    1 reads here; n > 1 uses up to n processes whatever the size and load. Fewer files
    than workers: a large file's fast scan is cut into parts (:func:`.fastscan.merge_parts`).
    Workers are forked (:func:`_can_fork`); elsewhere the files are read here. The results are the same either way.
    """
    paths = list(dict.fromkeys(paths))
    sizes = {path: _decoded_size(path) for path in paths}
    count = _worker_count(sizes, workers)
    tasks = _plan(sizes, count) if count > 1 else []
    if len(tasks) > 1:
        try:
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=min(count, len(tasks)), mp_context=context) as pool:
                results = list(pool.map(_run_task, tasks))
        except BrokenProcessPool:
            pass  # a worker died (killed, out of memory): read here, where the error shows
        else:
            return _assemble(paths, tasks, results)
    return {path: _read_or_error(path) for path in paths}


def _read_or_error(path: Path) -> TraceRecord | ShardlightError:
    try:
        return reader.read_trace(path)
    except ShardlightError as exc:
        return ShardlightError(str(exc))


def _run_task(task: _Task) -> TraceRecord | ShardlightError | Part | None:
    """A whole file's read, or a part's fast scan (None: the part could not be sure of it)."""
    path, part = task
    if part is None:
        return _read_or_error(path)
    try:
        return scan_part(path, reader._CHUNK_CHARS, *part)
    except FastPathMiss:
        return None


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


def _plan(sizes: dict[Path, int], count: int) -> list[_Task]:
    """One task per file, or per part of a large file when there are fewer files than workers."""
    if len(sizes) >= count:
        return [(path, None) for path in sizes]
    tasks: list[_Task] = []
    for path, size in sizes.items():
        pieces = min(count, _MAX_PARTS, size // _SPLIT_MIN_BYTES)
        if pieces > 1:
            tasks.extend((path, (index, pieces)) for index in range(pieces))
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

    "Now" is the kernel's count of runnable tasks (/proc/loadavg, this process included; the
    least of 3 looks 1 ms apart), not the 1-minute load average, which still counts a process
    that ended seconds ago. Where there is no such count, the load average stands in.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    try:
        looks = []
        for look in range(3):
            if look:
                time.sleep(0.001)
            looks.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        busy = float(min(looks))
    except (OSError, ValueError, IndexError):
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
    return max(1, min(cpus, int(cpus - busy + 0.5)))


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
