"""Stream a PyTorch profiler (Kineto) chrome trace and keep only what the analysis needs.

The whole file is never held as Python objects: the top-level object is walked key by key and
``traceEvents`` is decoded one event at a time with the C JSON scanner, so peak memory is one
read chunk plus the compact event records below (a 1 GB trace does not become 10 GB of dicts).

Rows are kept the way HTA 0.5.0 keeps them: events without ``dur`` or ``cat`` and ``cat == "Trace"``
are dropped; ``args.stream`` that is missing or not an integer becomes -1, a missing
``args.correlation`` becomes -1. Timestamps are kept raw; :mod:`framework.trace.metrics` applies
HTA's float rounding once it knows whether the file has any float timestamp.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.errors import ShardlightError

# HTA classifies these as GPU rows for its last-step filter even though their stream is -1.
SYNC_EVENT_NAMES = frozenset({"Event Sync", "Context Sync"})

_CHUNK_CHARS = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
# Fast pass: cut the event array at "}, {" and decode only pieces that can matter.
_EVENT_SEPARATOR = re.compile(r"\}\s*,\s*\{")
_GPU_KEYWORDS = ('"stream"', '"correlation"', "ProfilerStep", "gloo:")
_FLOAT_TS = re.compile(r'"ts":\s*-?\d+\.')


class _FastPathMiss(Exception):
    """The fast pass met something it cannot skip safely; the file is re-read in full."""


@dataclass
class GpuRow:
    """A row with ``args.stream != -1``: what HTA's GPU analyses look at."""

    name: str
    ts: float
    dur: float
    correlation: int
    # HTA's filter treats a row as a GPU kernel only with stream >= 0 and correlation >= 0;
    # anything else on a stream is filtered like a CPU row, by its own timestamp.
    is_kernel: bool


@dataclass
class CpuRow:
    """A CPU-side row the gloo analysis or the step logic needs."""

    name: str
    cat: str
    ts: float
    dur: float
    tid: Any


@dataclass
class TraceRecord:
    path: str
    rank: int
    rank_from_metadata: bool
    # HTA rounds every timestamp of a file (ceil start, floor end) when its ts column is float.
    float_timestamps: bool = False
    gpu_rows: list[GpuRow] = field(default_factory=list)
    # correlation id -> earliest ts of a CPU-side row carrying it (the runtime launch call)
    launch_ts: dict[int, float] = field(default_factory=dict)
    # every non-GPU row whose name contains "ProfilerStep" (HTA's last-step filter input)
    step_rows: list[CpuRow] = field(default_factory=list)
    # names containing "ProfilerStep" on any kept row: HTA counts them to decide whether to filter
    step_names: set[str] = field(default_factory=set)
    gloo_rows: list[CpuRow] = field(default_factory=list)
    aten_rows: list[CpuRow] = field(default_factory=list)
    collective_rows: list[CpuRow] = field(default_factory=list)
    event_count: int = 0


def _as_int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return default


class _TextStream:
    """A growable text window over a file, for decoding one JSON value at a time."""

    def __init__(self, handle: io.TextIOBase, path: str, watch_float_ts: bool = False):
        self._handle = handle
        self._path = path
        self.buf = ""
        self.pos = 0
        self.eof = False
        self._watch_float_ts = watch_float_ts
        self.saw_float_ts = False

    def _fill(self, at_least: int = _CHUNK_CHARS) -> bool:
        if self.eof:
            return False
        data = self._handle.read(max(at_least, _CHUNK_CHARS))
        if not data:
            self.eof = True
            return False
        if self._watch_float_ts and not self.saw_float_ts:
            # Skipped events still decide HTA's rounding, which is per file.
            self.saw_float_ts = _FLOAT_TS.search(self.buf[-40:] + data) is not None
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


class _Collector:
    """Turns decoded events into the compact rows of a TraceRecord."""

    def __init__(self, record: TraceRecord):
        self.record = record

    def add(self, event: Any) -> None:
        record = self.record
        if not isinstance(event, dict):
            return
        record.event_count += 1
        ts = event.get("ts")
        if ts is None or isinstance(ts, float):
            record.float_timestamps = True
        dur = event.get("dur")
        cat = event.get("cat")
        if dur is None or cat is None or cat == "Trace" or ts is None:
            return
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            return
        name = event.get("name")
        if not isinstance(name, str):
            name = str(name)
        args = event.get("args")
        if isinstance(args, dict):
            stream = _as_int(args.get("stream", -1))
            correlation = _as_int(args.get("correlation", -1))
        else:
            stream = correlation = -1
        is_kernel = (stream >= 0 and correlation >= 0) or name in SYNC_EVENT_NAMES
        if "ProfilerStep" in name:
            record.step_names.add(name)
        if stream != -1:
            record.gpu_rows.append(GpuRow(name, ts, dur, correlation, is_kernel))
        if is_kernel:
            return
        if correlation >= 0:
            known = record.launch_ts.get(correlation)
            if known is None or ts < known:
                record.launch_ts[correlation] = ts
        if stream != -1:
            return
        if "ProfilerStep" in name:
            record.step_rows.append(CpuRow(name, cat, ts, dur, event.get("tid")))
        elif name.startswith("aten::"):
            record.aten_rows.append(CpuRow(name, cat, ts, dur, event.get("tid")))
        elif name.startswith("gloo:"):
            record.gloo_rows.append(CpuRow(name, cat, ts, dur, event.get("tid")))
        elif name.startswith(("c10d::", "FSDP::")):
            record.collective_rows.append(CpuRow(name, cat, ts, dur, event.get("tid")))


def read_trace(path: str | Path) -> TraceRecord:
    """Parse one trace file (``.json`` or gzip, detected by content) into a TraceRecord.

    A fast pass decodes only the events that can matter to a GPU analysis; when it cannot be
    sure (a CPU-only gloo trace, an event split in the wrong place), the file is read again in
    full. Raises ShardlightError with a one-line message naming the file for unreadable,
    corrupt, truncated or non-trace input.
    """
    try:
        record = _read_trace(Path(path), fast=True)
        if record.gpu_rows:
            return record
    except _FastPathMiss:
        pass
    return _read_trace(Path(path), fast=False)


def _read_trace(path: Path, fast: bool) -> TraceRecord:
    record = TraceRecord(path=str(path), rank=0, rank_from_metadata=False)
    collector = _Collector(record)
    saw_events = False
    try:
        with _open_text(path) as handle:
            stream = _TextStream(handle, str(path), watch_float_ts=fast)
            opener = stream.expect("{[")
            if opener == "[":
                # The bare-array Chrome trace form: no metadata, events only.
                saw_events = True
                _read_event_array(stream, collector, already_open=True, fast=fast)
            else:
                saw_events = _read_top_object(stream, collector, record, fast)
            if stream.peek():
                raise ShardlightError(f"{path}: not a JSON trace (extra data after the top-level value)")
            if stream.saw_float_ts:
                record.float_timestamps = True
    except (ShardlightError, _FastPathMiss):
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


def _read_top_object(stream: _TextStream, collector: _Collector, record: TraceRecord, fast: bool) -> bool:
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
            _read_event_array(stream, collector, fast=fast)
        else:
            value = stream.value()
            if key == "distributedInfo" and isinstance(value, dict) and "rank" in value:
                rank = _as_int(value.get("rank"), default=-1)
                if rank < 0:
                    raise ShardlightError(f"{record.path}: distributedInfo.rank is not a rank: {value.get('rank')!r}")
                record.rank = rank
                record.rank_from_metadata = True
        if stream.expect(",}") == "}":
            return saw_events


def _read_event_array(stream: _TextStream, collector: _Collector, already_open: bool = False,
                      fast: bool = False) -> None:
    if not already_open:
        stream.expect("[")
    if stream.peek() == "]":
        stream.pos += 1
        return
    add = collector.add
    if fast:
        _read_events_fast(stream, collector)
    while True:
        add(stream.value())
        if stream.expect(",]") == "]":
            return


_TS_RE = re.compile(r'"ts":\s*(-?[0-9][0-9.eE+-]*)')
_CORRELATION_RE = re.compile(r'"correlation":\s*(-?[0-9]+)[,}\s]')


def _read_events_fast(stream: _TextStream, collector: _Collector) -> None:
    """Consume all but the last event, window by window, decoding only pieces that can matter.

    The window is cut at "}, {"; CPU ops, flows and instants carry none of the keywords and are
    never decoded, and launch calls only give (correlation, ts), read with two small regexes.
    A separator inside a string would cut an event wrongly: the piece then fails to decode and
    the whole file is re-read without this pass (_FastPathMiss).
    """
    record = collector.record
    launch_ts = record.launch_ts
    add = collector.add
    while True:
        stream.peek()
        if not stream.buf.startswith("{", stream.pos):
            raise _FastPathMiss()
        pieces = _EVENT_SEPARATOR.split(stream.buf[stream.pos + 1:])
        if len(pieces) == 1:
            if stream.eof or not stream._fill(len(stream.buf)):
                return
            continue
        for piece in pieces[:-1]:
            if '"correlation"' in piece:
                if '"stream"' not in piece and "Sync" not in piece and "ProfilerStep" not in piece \
                        and "gloo:" not in piece and '"dur"' in piece and '"cat"' in piece:
                    ts_match = _TS_RE.search(piece)
                    corr_match = _CORRELATION_RE.search(piece)
                    if ts_match and corr_match:
                        text = ts_match.group(1)
                        is_float = "." in text or "e" in text or "E" in text
                        ts = float(text) if is_float else int(text)
                        if is_float:
                            record.float_timestamps = True
                        correlation = int(corr_match.group(1))
                        if correlation >= 0:
                            known = launch_ts.get(correlation)
                            if known is None or ts < known:
                                launch_ts[correlation] = ts
                        continue
            elif '"stream"' not in piece and "ProfilerStep" not in piece and "gloo:" not in piece:
                continue
            try:
                event = json.loads("{" + piece + "}")
            except json.JSONDecodeError:
                raise _FastPathMiss() from None
            add(event)
        stream.buf = "{" + pieces[-1]
        stream.pos = 0
