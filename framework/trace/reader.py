"""Read PyTorch profiler (Kineto) chrome traces into compact TraceRecords: one file (:func:`read_trace`), or
several in worker processes (:func:`read_traces`).

A file is inflated (gzip by ISA-L, ``isal``, where installed: the same bytes and checks as zlib, about twice
as fast) and decoded in one msgspec call into :class:`.records.Event` structs, which hold only the keys the
Collector reads, so a large trace does not become a dict per event. Three ways, each taken only when the one
before does not accept the file, give identical records: typed structs; plain values (an event or its args
not an object, or a row whose whole args are kept); the json module (``NaN``, a number out of float range,
and bad JSON, whose errors it words). Every error message is worded here. The CPU rows the registered
sources ask for (:data:`shardlight.trace.sources.CPU_PREFIXES`) are collected, and a record keeps those of
the source that analyses it (:func:`.sources.keep_own_rows`).
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import re
import sys
import threading
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from pathlib import Path
from typing import Any, Callable

import msgspec

try:  # see pyproject.toml
    from isal import igzip as _gzip
    from isal.isal_zlib import error as _IsalError
except ImportError:  # pragma: no cover - a declared dependency; gzip gives the same bytes
    _gzip, _IsalError = gzip, zlib.error

from shardlight.errors import ShardlightError
from shardlight.trace.records import Args, Collector, Event, TraceRecord, event_of, needs_args_dict, read_issued
from shardlight.trace.sources import CPU_ARGS_PREFIXES, CPU_PREFIXES, keep_own_rows

__all__ = ["read_trace", "read_traces"]


class _Decoded(Event, gc=False):
    args: Args | None = None


class _Trace(msgspec.Struct, gc=False):
    """The keys of a trace's top-level object the reader reads."""

    traceEvents: list[_Decoded] | msgspec.UnsetType = msgspec.UNSET
    distributedInfo: Any = None


# A trace is an object with traceEvents, or (the bare Chrome form: no metadata) the array of its events.
_TYPED_DECODER = msgspec.json.Decoder(_Trace | list[_Decoded])
_VALUES_DECODER = msgspec.json.Decoder()
_WHITESPACE = re.compile(rb"[ \t\n\r]*")
# A row whose whole args are kept has one of these in its name (or, escaped, a backslash).
_ARGS_MARKS = tuple(prefix.encode() for prefix in CPU_ARGS_PREFIXES) + (b"\\",) if CPU_ARGS_PREFIXES else ()
# Decoding several files in worker processes (read_traces) by default from this many decompressed bytes in all:
# starting a pool of 2 and sending the records back costs about 10 ms, reading 8 files of 7.3 MB in all 40 ms
# (2 cores; with another process busy, workers lose at any size).
_PARALLEL_MIN_BYTES = 16 << 20


def read_trace(path: str | Path) -> TraceRecord:
    """Parse one trace file (``.json`` or gzip, detected by content) into a TraceRecord.

    Raises ShardlightError with a one-line message naming the file for unreadable, corrupt,
    truncated or non-trace input.
    """
    return _read_trace(Path(path))


def read_traces(paths: list[Path], workers: int | None = None, then: Callable[[TraceRecord], Any] | None = None,
                ) -> tuple[dict[Path, TraceRecord | ShardlightError], dict[Path, Any]]:
    """``read_trace`` of each file: path -> its record, or the ShardlightError its read raised (the same
    one-line message); and ``then(record)`` of each file a worker process read, called there (path -> value).

    ``workers``: processes that decode the files. None: one per CPU this process may use, up to one per
    file, when the files hold at least ``_PARALLEL_MIN_BYTES`` decompressed bytes, else this process
    alone; 1: this process alone. Workers are forked (Linux, from a single-threaded process only: forking a
    threaded one may deadlock); elsewhere, or if a worker cannot start or dies, the files are read here.
    The records and errors are the same either way.
    """
    paths = list(dict.fromkeys(paths))
    sizes = {path: _decoded_size(path) for path in paths}
    count = _worker_count(sizes, workers)
    if count > 1:
        order = sorted(paths, key=sizes.__getitem__, reverse=True)  # the largest first: the workers end together
        try:
            with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork")) as pool:
                done = dict(zip(order, pool.map(partial(_read_then, then=then), order)))
        except (BrokenProcessPool, OSError):
            pass  # read here, where any error shows
        else:
            return ({path: done[path][0] for path in paths},
                    {path: done[path][1] for path in paths if done[path][1] is not None})
    return {path: _read_or_error(path) for path in paths}, {}


def _read_or_error(path: Path) -> TraceRecord | ShardlightError:
    try:
        return _read_trace(path)
    except ShardlightError as exc:
        return ShardlightError(str(exc))


def _read_then(path: Path, then: Callable[[TraceRecord], Any] | None) -> tuple[TraceRecord | ShardlightError, Any]:
    record = _read_or_error(path)
    return record, then(record) if then is not None and isinstance(record, TraceRecord) else None


def _can_fork() -> bool:
    """Workers are forked: on Linux, and from a single-threaded process only."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def _worker_count(sizes: dict[Path, int], workers: int | None) -> int:
    if workers == 1 or len(sizes) < 2 or not _can_fork():
        return 1
    if workers is None:
        if sum(sizes.values()) < _PARALLEL_MIN_BYTES:
            return 1
        workers = len(os.sched_getaffinity(0))
    return max(1, min(workers, len(sizes)))


def _decoded_size(path: Path) -> int:
    """About how many bytes reading ``path`` decodes: a gzip file's trailer says (mod 4 GiB)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if handle.read(2) != b"\x1f\x8b" or size < 20:
                return size
            handle.seek(-4, os.SEEK_END)
            return max(int.from_bytes(handle.read(4), "little"), size)
    except OSError:
        return 0  # the read words the error


def _read_trace(path: Path, gzip_module: Any = _gzip) -> TraceRecord:
    """``gzip_module``: what inflates a gzip file; an error ISA-L's raises is worded by the gzip module's."""
    try:
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip_module.decompress(data)
        events, info = _decode(data, path)
    except ShardlightError:
        raise
    except FileNotFoundError:
        raise ShardlightError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ShardlightError(f"{path}: is a directory") from None
    except PermissionError:
        raise ShardlightError(f"{path}: permission denied") from None
    except (EOFError, gzip.BadGzipFile, zlib.error, _IsalError) as exc:
        if gzip_module is not gzip:  # ISA-L's framing words some errors otherwise (trailing bytes: "truncated")
            return _read_trace(path, gzip)
        what = "truncated" if isinstance(exc, EOFError) else "corrupt"
        raise ShardlightError(f"{path}: {what} gzip data") from None
    except UnicodeDecodeError:
        raise ShardlightError(f"{path}: not a JSON trace (not UTF-8 text)") from None
    except OSError as exc:
        raise ShardlightError(f"{path}: cannot read ({exc.strerror or exc})") from None
    record = TraceRecord(path=str(path), rank=0)
    record.read_distributed_info(info)
    add = Collector(record, CPU_PREFIXES, CPU_ARGS_PREFIXES).add
    for event in events:
        if not isinstance(event, Event):
            event = event_of(event)  # a plain value; None when it is not an object
        if event is not None:
            add(event)
    keep_own_rows(record)
    record.issued = read_issued(path)
    return record


def _decode(data: bytes, path: Path) -> tuple[list, Any]:
    """(the events, distributedInfo or None) of a trace's text; an event is an Event or a plain value."""
    start = _WHITESPACE.match(data).end()
    if data[start:start + 1] not in (b"{", b"["):
        found = repr(data[start:start + 4].decode("utf-8", "replace")[0]) if start < len(data) else "end of file"
        raise ShardlightError(f"{path}: not a JSON trace (expected '{{[', found {found})")
    try:
        try:
            top = _TYPED_DECODER.decode(data)
            events = top if isinstance(top, list) else top.traceEvents
            if (_ARGS_MARKS and isinstance(events, list) and any(mark in data for mark in _ARGS_MARKS)
                    and needs_args_dict(events, CPU_ARGS_PREFIXES)):
                top = _VALUES_DECODER.decode(data)
        except msgspec.ValidationError:  # not in the shape of a trace of Events: as plain values
            top = _VALUES_DECODER.decode(data)
    except msgspec.DecodeError:  # not what msgspec accepts at all: the json module reads it, or words why not
        top = _json_loads(data, path)
    if isinstance(top, list):
        return top, None
    if isinstance(top, _Trace):
        top = {"distributedInfo": top.distributedInfo} | ({} if top.traceEvents is msgspec.UNSET
                                                         else {"traceEvents": top.traceEvents})
    if "traceEvents" not in top:
        raise ShardlightError(f"{path}: not a profiler trace (no traceEvents)")
    if not isinstance(top["traceEvents"], list):
        raise ShardlightError(f"{path}: not a profiler trace (traceEvents is not a list)")
    return top["traceEvents"], top.get("distributedInfo")


def _json_loads(data: bytes, path: Path) -> Any:
    text = data.decode("utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            raise ShardlightError(f"{path}: not a JSON trace (extra data after the top-level value)") from None
        what = "truncated" if exc.pos >= len(text) - 1 else "invalid"
        raise ShardlightError(f"{path}: {what} JSON ({exc.msg})") from None
