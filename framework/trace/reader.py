"""Read a PyTorch profiler (Kineto) chrome trace into a compact TraceRecord.

:mod:`shardlight.trace.fastscan` reads GPU traces in one pass over the raw bytes. When it cannot
be sure of a file (a CPU-only gloo trace, an unusual layout, bad input) the file is read here
instead: the top-level object is walked key by key and ``traceEvents`` is decoded a window at
a time, so peak memory is one read window (1 Mi chars) and its events plus the compact records
(a 1 GB trace does not become 10 GB of dicts). This path also produces every error message, and keeps the CPU rows the
registered sources ask for (:data:`shardlight.trace.sources.CPU_PREFIXES`).

The whole events in the window (up to its last ``}, {``) are decoded with one msgspec call
(:func:`_decode_batch`); anything it does not accept -- bad JSON, a separator inside a string,
``NaN``, a number out of float range -- is decoded one event at a time with the json module
instead, which words the errors. msgspec gives the same values as json for what it accepts
(arbitrary-size ints included, unlike orjson), so the two give identical records.

:mod:`shardlight.trace.parallel` reads several files (or one large file in parts) in worker processes.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from pathlib import Path
from typing import Any

try:  # see pyproject.toml: the CPU-trace path decodes events ~2x faster with it
    import msgspec
except ImportError:  # pragma: no cover - a declared dependency; the json path is exact without it
    msgspec = None

from shardlight.errors import ShardlightError
from shardlight.trace.fastscan import FastPathMiss, scan_trace
from shardlight.trace.records import Collector, TraceRecord, as_int
from shardlight.trace.sources import CPU_ARGS_PREFIXES, CPU_PREFIXES

__all__ = ["read_trace"]

# Chunk size of both paths (decompressed bytes or chars); tests shrink it to hit chunk edges.
_CHUNK_CHARS = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_BATCH_DECODER = msgspec.json.Decoder() if msgspec is not None else None
_BATCH_ERRORS = (msgspec.DecodeError,) if msgspec is not None else ()
_WS_CHARS = " \t\n\r"


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


def _open_text(path: Path) -> io.TextIOBase:
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    binary = gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw
    return io.TextIOWrapper(binary, encoding="utf-8")


def read_trace(path: str | Path) -> TraceRecord:
    """Parse one trace file (``.json`` or gzip, detected by content) into a TraceRecord.

    The fast scanner handles GPU traces; a file it is not sure of, or one without device rows
    (the fast scanner keeps no CPU rows), is read again in full. Raises ShardlightError with a
    one-line message naming the file for unreadable, corrupt, truncated or non-trace input.
    """
    try:
        record = scan_trace(Path(path), _CHUNK_CHARS)
        if record.gpu_ts:
            return record
    except FastPathMiss:
        pass
    return _read_trace(Path(path))


def _read_trace(path: Path) -> TraceRecord:
    record = TraceRecord(path=str(path), rank=0)
    collector = Collector(record, CPU_PREFIXES, CPU_ARGS_PREFIXES)
    saw_events = False
    try:
        with _open_text(path) as handle:
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
    except EOFError:
        raise ShardlightError(f"{path}: truncated gzip data") from None
    except (gzip.BadGzipFile, zlib.error):
        raise ShardlightError(f"{path}: corrupt gzip data") from None
    except UnicodeDecodeError:
        raise ShardlightError(f"{path}: not a JSON trace (not UTF-8 text)") from None
    except OSError as exc:
        raise ShardlightError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not saw_events:
        raise ShardlightError(f"{path}: not a profiler trace (no traceEvents)")
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
        if _BATCH_DECODER is not None:
            retry_at = _decode_batch(stream, add, retry_at)
        add(stream.value())
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


def _decode_batch(stream: _TextStream, add, retry_at: int) -> int:
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
    try:
        events = _BATCH_DECODER.decode("[" + buf[start:buf.rindex("}", start, cut) + 1] + "]")
    except _BATCH_ERRORS:
        return stream.consumed + cut
    for event in events:
        add(event)
    stream.pos = cut
    return retry_at
