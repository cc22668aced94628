"""Read PyTorch profiler (Kineto) chrome traces into compact TraceRecords: one file (:func:`read_trace`), or
several in worker processes (:func:`read_traces`).

The top-level object is walked key by key and ``traceEvents`` is decoded a window at a time, so peak
memory is one read window (1 Mi chars) and its events plus the compact records (a 1 GB trace does not
become 10 GB of dicts). Every error message is worded here. The CPU rows the registered sources ask for
(:data:`shardlight.trace.sources.CPU_PREFIXES`) are collected, and a record keeps those of the source
that analyses it (:func:`.sources.keep_own_rows`).

The whole events in the window (up to its last ``}, {``) are decoded with one msgspec call
(:func:`_decode_batch`) into :class:`.records.Event` structs, which hold only the keys the Collector reads;
a window msgspec does not accept so (an event or its args not an object, a row whose whole args are kept)
is decoded into plain values, and anything msgspec does not accept at all -- bad JSON, a separator inside
a string, ``NaN``, a number out of float range -- one event at a time with the json module, which words
the errors. msgspec gives the same values as json for what it accepts (arbitrary-size ints included,
unlike orjson), so every way gives identical records.

gzip is inflated by ISA-L (``isal``, see pyproject.toml) where it is installed: the same bytes and checks
as zlib, about twice as fast on the shared traces.
"""

from __future__ import annotations

import gzip
import io
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
from shardlight.trace.records import Args, Collector, Event, TraceRecord, as_int, event_of, needs_args_dict
from shardlight.trace.sources import CPU_ARGS_PREFIXES, CPU_PREFIXES, keep_own_rows

__all__ = ["read_trace", "read_traces"]

# Chunk size of the text windows (chars); tests shrink it to hit chunk edges.
_CHUNK_CHARS = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Decoded(Event, gc=False):
    args: Args | None = None


_EVENTS_DECODER = msgspec.json.Decoder(list[_Decoded])
_VALUES_DECODER = msgspec.json.Decoder()
_WS_CHARS = " \t\n\r"
_ARGS_MARKS = CPU_ARGS_PREFIXES + ("\\",) if CPU_ARGS_PREFIXES else ()
# Decoding several files in worker processes (read_traces) by default from this many decompressed bytes in all:
# starting a pool of 2 and sending the records back costs about 10 ms, reading 8 files of 7.3 MB in all 40 ms
# (2 cores; with another process busy, workers lose at any size).
_PARALLEL_MIN_BYTES = 16 << 20


class _TextStream:
    """A growable text window over a file, for decoding one JSON value at a time."""

    def __init__(self, handle: io.TextIOBase, path: str):
        self._handle = handle
        self._path = path
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.consumed = 0  # chars of the file before buf[0]

    def _fill(self, at_least: int = 0) -> bool:
        if self.eof:
            return False
        data = self._handle.read(max(at_least, _CHUNK_CHARS))
        if not data:
            self.eof = True
            return False
        self.consumed += self.pos
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def peek(self) -> str:
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def expect(self, chars: str) -> str:
        char = self.peek()
        if not char or char not in chars:
            found = repr(char) if char else "end of file"
            raise ShardlightError(f"{self._path}: not a JSON trace (expected {chars!r}, found {found})")
        self.pos += 1
        return char

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                # The value may just run past the window; only a complete file can prove it bad.
                if self._fill(len(self.buf)):
                    continue
                what = "truncated" if exc.pos >= len(self.buf) - 1 else "invalid"
                raise ShardlightError(f"{self._path}: {what} JSON ({exc.msg})") from None
            # A number that ends exactly at the window edge may continue in the next chunk.
            if end == len(self.buf) and self._fill():
                continue
            self.pos = end
            return obj


def _open_text(path: Path, gzip_module: Any = _gzip) -> io.TextIOBase:
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    binary = gzip_module.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
    return io.TextIOWrapper(binary, encoding="utf-8")


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
    record = TraceRecord(path=str(path), rank=0)
    collector = Collector(record, CPU_PREFIXES, CPU_ARGS_PREFIXES)
    saw_events = False
    try:
        with _open_text(path, gzip_module) as handle:
            stream = _TextStream(handle, str(path))
            opener = stream.expect("{[")
            if opener == "[":
                # The bare-array Chrome trace form: no metadata, events only.
                saw_events = True
                _read_event_array(stream, collector, already_open=True)
            else:
                saw_events = _read_top_object(stream, collector, record)
            if stream.peek():
                raise ShardlightError(f"{path}: not a JSON trace (extra data after the top-level value)")
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
    if not saw_events:
        raise ShardlightError(f"{path}: not a profiler trace (no traceEvents)")
    keep_own_rows(record)
    return record


def _read_top_object(stream: _TextStream, collector: Collector, record: TraceRecord) -> bool:
    saw_events = False
    if stream.peek() == "}":
        stream.pos += 1
        return False
    while True:
        key = stream.value()
        if not isinstance(key, str):
            raise ShardlightError(f"{record.path}: not a JSON trace (object key is not a string)")
        stream.expect(":")
        if key == "traceEvents":
            if stream.peek() != "[":
                raise ShardlightError(f"{record.path}: not a profiler trace (traceEvents is not a list)")
            saw_events = True
            _read_event_array(stream, collector)
        else:
            value = stream.value()
            if key == "distributedInfo":
                record.read_distributed_info(value)
            if key == "distributedInfo" and isinstance(value, dict) and "rank" in value:
                rank = as_int(value.get("rank"), default=-1)
                if rank < 0:
                    raise ShardlightError(f"{record.path}: distributedInfo.rank is not a rank: {value.get('rank')!r}")
                record.rank = rank
        if stream.expect(",}") == "}":
            return saw_events


def _read_event_array(stream: _TextStream, collector: Collector, already_open: bool = False) -> None:
    if not already_open:
        stream.expect("[")
    if stream.peek() == "]":
        stream.pos += 1
        return
    add = collector.add
    retry_at = 0  # absolute position in the file text before which batches are not tried again
    while True:
        retry_at = _decode_batch(stream, add, retry_at)
        event = event_of(stream.value())
        if event is not None:
            add(event)
        if stream.expect(",]") == "]":
            return


def _last_event_start(buf: str, start: int) -> int:
    """Index of the last "{" in buf after ``start`` that follows "}" "," (whitespace aside), else start."""
    index = len(buf)
    while True:
        index = buf.rfind("{", start + 1, index)
        if index < 0:
            return start
        before = index - 1
        while buf[before] in _WS_CHARS:
            before -= 1
        if buf[before] != ",":
            continue
        before -= 1
        while buf[before] in _WS_CHARS:
            before -= 1
        if buf[before] == "}":
            return index


def _decode_batch(stream: _TextStream, add: Callable[[Event], None], retry_at: int) -> int:
    """Decode the whole events from ``stream.pos`` (an event's "{") to the window's last event start.

    The region starts where an event starts, so when "[" + region + "]" decodes, its values are
    exactly the file's events and the cut is a real event start (a cut inside a string leaves
    that string open). When it does not decode, the events up to the cut are read one at a time
    (returns where batches may be tried again).
    """
    if stream.peek() != "{" or stream.consumed + stream.pos < retry_at:
        return retry_at
    buf, start = stream.buf, stream.pos
    cut = _last_event_start(buf, start)
    if cut <= start:
        return retry_at
    text = "[" + buf[start:buf.rindex("}", start, cut) + 1] + "]"
    try:
        try:
            events = _EVENTS_DECODER.decode(text)
        except msgspec.ValidationError:  # not in the shape of Event (or not JSON further on): as plain values
            events = None
        # A row whose whole args are kept: its name holds a prefix, or (escaped) a backslash.
        if events is None or (any(prefix in text for prefix in _ARGS_MARKS)
                              and needs_args_dict(events, CPU_ARGS_PREFIXES)):
            events = [event_of(value) for value in _VALUES_DECODER.decode(text)]
    except msgspec.DecodeError:
        return stream.consumed + cut
    for event in events:
        if event is not None:
            add(event)
    stream.pos = cut
    return retry_at
