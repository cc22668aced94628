"""Fast pass over a Kineto trace: a few C-speed scans of the raw bytes instead of decoding events.

A GPU analysis needs a small part of a trace: GPU rows (events with ``args.stream``), the launch
calls that share their correlation ids, and the ``ProfilerStep`` markers. Decoding every event
with the json module costs about as much as the whole analysis may take, so the event array is
cut into chunks of whole events and each chunk gets:

* ``_ROWS``: one compiled regex that reads name, ts, dur and correlation of GPU rows (stream >= 0
  before the correlation) and of launch calls, in Kineto's key order: one pass over the chunk
  for both kinds of row;
* ``bytes.count`` of ``"stream"`` and ``"correlation"``: regex matches never overlap and each
  holds one such key, so equal counts prove that every event carrying one was read by a regex
  (which tokenizes strings and numbers exactly), and none was read twice;
* the events around each ``ProfilerStep`` are cut out and decoded with json, for their step part
  (there are a few per step).

:mod:`shardlight.trace.chunks` supplies the chunks and, per chunk, whether a float timestamp
occurs (one anywhere makes HTA round the whole file), where the array may end and where
``ProfilerStep`` occurs.

Two more kinds of rows are read only where a cheap ``bytes.find`` says a chunk has them, so
the common chunk pays one C search each:

* the args of NCCL kernels that describe their collective (``"Collective name"``, message sizes,
  process group; :data:`shardlight.trace.records.COMM_ARG_KEYS`): that chunk's regex runs as
  ``finditer`` and each such kernel's args object is decoded with json;
* the input pipeline's ``enumerate(DataLoader)`` annotations, decoded with json like the steps.

No other CPU rows are kept here: :mod:`shardlight.trace.reader` uses this pass only for a file
with device rows, which a device source analyses.

A chunk whose counts disagree (another key order, a negative id, an unexpected category) is
decoded event by event instead (``_scan_pieces``). Anything else unexpected -- a separator inside
a string, bad JSON, bad gzip -- abandons the pass with FastPathMiss and the file is read in full
by :mod:`shardlight.trace.reader`, which also words the errors.

A large file can be scanned by several processes at once (:func:`scan_part`, :func:`merge_parts`):
each inflates the whole file -- the chunks, and so the cuts into runs of events, are the same in
each -- and scans the runs that start in its blocks; the merged record equals ``scan_trace``'s.
"""

from __future__ import annotations

import json
import re
import sys
from bisect import bisect_left
from itertools import repeat
from pathlib import Path

from shardlight.trace.chunks import INFLATE_ERRORS, Chunks
from shardlight.trace.records import INPUT_PREFIX, Collector, TraceRecord, as_int, comm_args


class FastPathMiss(Exception):
    """The fast pass met something it cannot handle exactly; the file must be read in full."""


_WS = re.compile(rb"[ \t\n\r]*")
_WS_BYTES = b" \t\n\r"
_DECODER = json.JSONDecoder()
_NUM = rb"-?+\d++(?:\.\d++)?+(?:[eE][+-]?+\d++)?+"
# From the end of the phase to just past the ids, in Kineto's key order and spacing (json.dumps'
# too): GPU rows and launch calls are complete events, ``"ph": "X", "cat": ...``. Groups: the GPU
# row's category (empty for a launch call), name, ts, dur, correlation. A name is read up to the
# first quote: at an escaped quote what follows cannot match, so the counts disagree; other escapes
# are decoded with json. Before the ids, args are skipped token by token (strings may hold braces,
# as in "{lambda()#1}"), and no brace may occur outside a string, so every key read belongs to the
# same event.
# Speed (2 cores, the shared traces, 512 KiB chunks): re searches for a literal prefix one byte
# at a time for its first byte, so the prefix starts at the rare "X" rather than at '"', the
# commonest byte of JSON (0.45 against 0.81 ns a byte for the search alone); the possessive
# quantifiers (*+) keep no backtracking points the match cannot use. With both, the pass takes
# 2.0 ns a byte against 2.7, and finds the same rows.
_ROWS = re.compile(rb'X", "cat": "(?:(kernel|gpu_memcpy|gpu_memset|cuda_sync)|cuda_runtime|cuda_driver)'
                   rb'", "name": "([^"]*+)",\s*+"pid":[^,{}]*+,\s*+"tid":[^,{}]*+,\s*+"ts":\s*+(%s),\s*+"dur":\s*+(%s),'
                   rb'\s*+"args":\s*+\{[^{}"]*+(?:"[^"\\]*+(?:\\.[^"\\]*+)*+"[^{}"]*+)*?'
                   rb'(?(1)"stream":\s*+\d++,\s*+)"correlation":\s*+(\d++)[,}\s]' % (_NUM, _NUM))
_SEPARATOR = re.compile(rb"\}\s*,\s*\{")
_STEP = b"ProfilerStep"
_INPUT = INPUT_PREFIX.encode()
# Keys only NCCL kernels that describe their collective carry (records.COMM_ARG_KEYS).
_COMM_KEYS = (b'"Collective name"', b'"In msg nelems"')
# The rest of a flat JSON object after its "{": strings may hold braces, nothing else may.
_OBJECT_REST = re.compile(rb'(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


class _Window:
    """A growable byte window over the chunks, for reading one JSON token or value at a time."""

    def __init__(self, chunks: Chunks):
        self._chunks = chunks
        self.buf = b""
        self.pos = 0
        self.eof = False
        self.base = 0  # file offset of buf[0]
        # File offsets of "]" after "}" and of "ProfilerStep" (see chunks.py), ascending.
        self._ends: list[int] = []
        self._first_end = 0
        self.steps: list[int] = []

    def fill(self) -> bool:
        item = None if self.eof else self._chunks.next()
        if item is None:
            self.eof = True
            return False
        data, ends, steps = item
        self.base += self.pos
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        self._ends.extend(ends)
        self.steps.extend(steps)
        return True

    def array_end(self, start: int) -> int:
        """Index in buf of the first possible array end at or after buf[start], else len(buf)."""
        ends = self._ends
        self._first_end = bisect_left(ends, self.base + start, self._first_end)
        if self._first_end < len(ends):
            return min(ends[self._first_end] - self.base, len(self.buf))
        return len(self.buf)

    def peek(self) -> int:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return -1

    def expect(self, chars: bytes) -> int:
        char = self.peek()
        if char < 0 or char not in chars:
            raise FastPathMiss(f"expected {chars!r}")
        self.pos += 1
        return char

    def value(self):
        self.peek()
        size = 1 << 16
        while True:
            buf, pos = self.buf, self.pos
            raw = buf[pos:pos + size]
            try:
                text = raw.decode()
            except UnicodeDecodeError as exc:
                if exc.end < len(raw):
                    raise
                text = raw[:exc.start].decode()  # the window cut a character; try without it
            end = pos + len(raw)
            try:
                obj, used = _DECODER.raw_decode(text)
            except json.JSONDecodeError:
                used = -1
            # A value that ends at the window edge (a number, say) may go on past it.
            if used >= 0 and (used < len(text) or (end == len(buf) and self.eof)):
                self.pos = pos + (used if text.isascii() else len(text[:used].encode()))
                return obj
            if end < len(buf):
                size *= 8
            elif not self.fill() and used < 0:
                raise FastPathMiss("invalid JSON value")


def scan_trace(path: Path, chunk_chars: int) -> TraceRecord:
    """The TraceRecord of one file, or FastPathMiss when only a full read can be sure of it."""
    record = _scan(path, chunk_chars, None)
    _check(record)
    return record


# A part (scan_part) owns the events starting in every n-th block of this many decompressed bytes.
PART_BLOCK = 2 << 20


Part = tuple[TraceRecord, list[tuple[int, TraceRecord]]]  # what scan_part returns


def scan_part(path: Path, chunk_chars: int, index: int, parts: int) -> Part:
    """Part ``index`` of ``parts`` of scan_trace, for :func:`merge_parts` (FastPathMiss as scan_trace).

    Every part reads the whole file and cuts it into the same runs of events (the cuts depend on
    the bytes alone); a run belongs to the part that owns the block its first event starts in,
    blocks going round the parts in turn (so each gets its share of the dense stretches), and
    every event is read by exactly one part. A part looks for float timestamps only in the chunks
    that start in its blocks (any of them makes the file's float). Returns the file's record
    without events (rank, process groups, float timestamps) and, per block with runs of this part,
    (block, their record).
    """
    segments: list[tuple[int, TraceRecord]] = []
    header = _scan(path, chunk_chars, (index, parts, segments))
    return header, segments


def merge_parts(parts: list[Part]) -> TraceRecord:
    """One file's record from all its ``scan_part`` results: equal to its scan_trace record.

    The blocks' records are joined in file order: columns and rows concatenate, and the launch
    times keep the earliest per id (in first-seen order).
    """
    header = parts[0][0]
    merged = TraceRecord(path=header.path, rank=header.rank, world_size=header.world_size,
                         process_groups=header.process_groups)
    merged.float_timestamps = any(head.float_timestamps for head, _ in parts)
    launch_ts = merged.launch_ts
    for _, part in sorted((segment for _, segments in parts for segment in segments), key=lambda item: item[0]):
        offset = len(merged.gpu_name)
        merged.float_timestamps = merged.float_timestamps or part.float_timestamps
        merged.gpu_name.extend(part.gpu_name)
        merged.gpu_ts.extend(part.gpu_ts)
        merged.gpu_dur.extend(part.gpu_dur)
        merged.gpu_correlation.extend(part.gpu_correlation)
        merged.gpu_is_kernel.extend(part.gpu_is_kernel)
        merged.gpu_args.update((offset + row, args) for row, args in part.gpu_args.items())
        if launch_ts.keys().isdisjoint(part.launch_ts):
            launch_ts.update(part.launch_ts)
        else:
            for correlation, ts in part.launch_ts.items():
                earlier = launch_ts.get(correlation)
                if earlier is None or ts < earlier:
                    launch_ts[correlation] = ts
        merged.step_rows.extend(part.step_rows)
        merged.step_names.update(part.step_names)
        for prefix, rows in part.cpu_rows.items():
            merged.cpu_rows.setdefault(prefix, []).extend(rows)
    merged.cpu_rows.setdefault(INPUT_PREFIX, [])
    _check(merged)
    return merged


def _scan(path: Path, chunk_chars: int, part) -> TraceRecord:
    record = TraceRecord(path=str(path), rank=0)
    try:
        checks_float = None if part is None else (lambda offset: offset // PART_BLOCK % part[1] == part[0])
        chunks = Chunks(path, chunk_chars // 2, checks_float)  # see Chunks.__init__ on the size
    except OSError:
        raise FastPathMiss("cannot open") from None
    try:
        window = _Window(chunks)
        scanner = _Scanner(record, part)
        if window.expect(b"{[") == ord("["):
            scanner.events(window)
        elif not _top_object(window, scanner, record):
            raise FastPathMiss("no traceEvents")
        if window.peek() >= 0:
            raise FastPathMiss("extra data")
        record.float_timestamps = record.float_timestamps or chunks.float_ts
    # JSON and UTF-8 errors are ValueErrors; OSError, EOFError and INFLATE_ERRORS come from reading.
    except (ValueError, RecursionError, OSError, EOFError, *INFLATE_ERRORS) as exc:
        raise FastPathMiss(str(exc)) from None
    finally:
        chunks.close()
    return record


def _check(record: TraceRecord) -> None:
    if not record.float_timestamps and _fractional_durations(record):
        # An event without "ts" also makes HTA round (its ts column turns float), which
        # changes only fractional durations; finding such events takes the full read.
        raise FastPathMiss("fractional durations")


def _fractional_durations(record: TraceRecord) -> bool:
    durations = record.gpu_dur + [row.dur for row in record.step_rows]
    return any(type(dur) is float and not dur.is_integer() for dur in durations)


def _top_object(window: _Window, scanner: _Scanner, record: TraceRecord) -> bool:
    saw_events = False
    if window.peek() == ord("}"):
        return False
    while True:
        key = window.value()
        if not isinstance(key, str):
            raise FastPathMiss("object key is not a string")
        window.expect(b":")
        if key == "traceEvents":
            window.expect(b"[")
            scanner.events(window)
            saw_events = True
        else:
            value = window.value()
            if key == "distributedInfo":
                record.read_distributed_info(value)
            if key == "distributedInfo" and isinstance(value, dict) and "rank" in value:
                rank = as_int(value.get("rank"), default=-1)
                if rank < 0:
                    raise FastPathMiss("bad rank")
                record.rank = rank
        if window.expect(b",}") == ord("}"):
            return saw_events


def _last_event_start(buf: bytes, start: int, limit: int) -> int:
    """Index of the last "{" in (start, limit) that follows "}" "," (whitespace aside), else start.

    ``buf[start]`` is the "{" of an event, so the backward whitespace skips stop there.
    """
    index = limit
    while True:
        index = buf.rfind(b"{", start + 1, index)
        if index < 0:
            return start
        before = index - 1
        while buf[before] in _WS_BYTES:
            before -= 1
        if buf[before] != 44:  # ","
            continue
        before -= 1
        while buf[before] in _WS_BYTES:
            before -= 1
        if buf[before] == 125:  # "}"
            return index


def _numbers(raw) -> tuple[list, bool]:
    """JSON number tokens as json would give them, and whether any is a float."""
    try:
        return list(map(int, raw)), False
    except ValueError:
        pass
    if b" ".join(raw).count(b".") == len(raw):  # a token holds at most one ".": here each holds one
        return list(map(float, raw)), True
    return [float(x) if (b"." in x or b"e" in x or b"E" in x) else int(x) for x in raw], True


def _texts(raw: tuple[bytes, ...]) -> list[str]:
    """JSON string contents as str: one decode for all, unless one holds an escape."""
    joined = b"\0".join(raw)
    if b"\\" not in joined:
        texts = joined.decode().split("\0")
        if len(texts) == len(raw):  # else a name held a raw NUL (invalid JSON, but be exact)
            return texts
    return [name.decode() if b"\\" not in name else json.loads(b'"' + name + b'"') for name in raw]


class _Scanner:
    def __init__(self, record: TraceRecord, part: tuple[int, int, list] | None = None):
        self.record = record
        self.collector = Collector(record, cpu_prefixes=(INPUT_PREFIX,))
        self._part = part
        self._block = -1

    def _owns(self, offset: int) -> bool:
        """Whether the run of events starting at file ``offset`` is this part's (see scan_part);
        the events of each block of a part go to their own record."""
        if self._part is None:
            return True
        index, parts, segments = self._part
        block = offset // PART_BLOCK
        if block % parts != index:
            return False
        if block != self._block:
            self._block = block
            self.record = TraceRecord(path=self.record.path, rank=0)
            self.collector = Collector(self.record, cpu_prefixes=(INPUT_PREFIX,))
            segments.append((block, self.record))
        return True

    def events(self, window: _Window) -> None:
        """Everything from after traceEvents' "[" to after its "]"."""
        if window.peek() == ord("]"):
            window.pos += 1
            return
        while True:
            # Whole chunks of events while the window holds them...
            while window.peek() == ord("{"):
                buf, start = window.buf, window.pos
                limit = window.array_end(start)
                cut = _last_event_start(buf, start, limit)
                if cut > start:
                    if self._owns(window.base + start):
                        steps = window.steps
                        first = bisect_left(steps, window.base + start)
                        last = bisect_left(steps, window.base + cut, first)
                        self._scan_region(buf, start, cut, [at - window.base for at in steps[first:last]])
                    window.pos = cut
                elif limit < len(buf) or not window.fill():
                    break
            # ...then one event decoded in full: the last one, or one holding "}]".
            window.peek()
            owned = self._owns(window.base + window.pos)
            event = window.value()
            if owned:
                self.collector.add(event)
            if window.expect(b",]") == ord("]"):
                return

    def _scan_region(self, buf: bytes, start: int, end: int, steps: list[int]) -> None:
        """Events in ``buf[start:end]``: whole events, ``buf[end]`` is the next one's "{".

        ``steps``: where "ProfilerStep" occurs in that range.
        """
        streams = buf.count(b'"stream"', start, end)
        correlations = buf.count(b'"correlation"', start, end)
        matches = None
        if not correlations:
            rows = []
        elif streams and any(buf.find(key, start, end) >= 0 for key in _COMM_KEYS):
            matches = list(_ROWS.finditer(buf, start, end))  # positions, for the NCCL kernels' args
            rows = [match.groups() for match in matches]
        else:
            rows = _ROWS.findall(buf, start, end)
        kernels = [row for row in rows if row[0]]
        if len(kernels) != streams or len(rows) != correlations:
            self._scan_pieces(buf, start, end)
            return
        if kernels:
            if matches:
                self._add_comm_args(buf, [match for match in matches if match.group(1)])
            self._add_kernels(kernels)
        if len(kernels) < len(rows):
            self._add_launches([row for row in rows if not row[0]])
        self._add_steps(buf, start, end, steps)
        self._add_inputs(buf, start, end)

    def _add_comm_args(self, buf: bytes, matches: list) -> None:
        """The collective args of the NCCL kernels among the GPU rows ``matches`` (before they are added)."""
        first_row = len(self.record.gpu_name)
        for offset, match in enumerate(matches):
            if not match.group(2).startswith(b"nccl"):
                continue
            opening = buf.index(b"{", buf.rfind(b'"args":', match.start(), match.end()))
            rest = _OBJECT_REST.match(buf, opening + 1)
            if rest is None:
                raise FastPathMiss("nested args")  # the full reader decodes any shape
            kept = comm_args(json.loads(buf[opening:rest.end()]))
            if kept is not None:
                self.record.gpu_args[first_row + offset] = kept

    def _add_inputs(self, buf: bytes, start: int, end: int) -> None:
        """Decode each event mentioning the DataLoader annotation, for its CPU row only."""
        found = buf.find(_INPUT, start, end)
        while found >= 0:
            first = _last_event_start(buf, start, found)
            last = _SEPARATOR.search(buf, found, end + 1).start() + 1
            self.collector.add_cpu_row(json.loads(buf[first:last]))
            found = buf.find(_INPUT, last, end)

    def _add_kernels(self, kernels: list) -> None:
        _, names, stamps, durations, correlations = zip(*kernels)
        stamps, floats = _numbers(stamps)
        if floats:
            self.record.float_timestamps = True
        durations, _ = _numbers(durations)
        record = self.record
        record.gpu_name.extend(map(sys.intern, _texts(names)))  # kernel names repeat: share them
        record.gpu_ts.extend(stamps)
        record.gpu_dur.extend(durations)
        record.gpu_correlation.extend(map(int, correlations))
        record.gpu_is_kernel.extend(repeat(True, len(stamps)))

    def _add_launches(self, launches: list) -> None:
        _, _, stamps, _, correlations = zip(*launches)
        stamps, floats = _numbers(stamps)
        if floats:
            self.record.float_timestamps = True
        correlations = list(map(int, correlations))
        known = self.record.launch_ts
        fresh = dict(zip(correlations, stamps))
        if len(fresh) == len(correlations) and known.keys().isdisjoint(fresh):
            known.update(fresh)
            return
        for correlation, ts in zip(correlations, stamps):  # an id launched twice: keep the earliest
            earlier = known.get(correlation)
            if earlier is None or ts < earlier:
                known[correlation] = ts

    def _add_steps(self, buf: bytes, start: int, end: int, steps: list[int]) -> None:
        """Decode each event mentioning ProfilerStep, for its step part only."""
        last = start
        for found in steps:
            if found < last:
                continue  # the event was decoded already
            first = _last_event_start(buf, start, found)
            # buf[end] is "{" after a separator, so a separator is always found.
            last = _SEPARATOR.search(buf, found, end + 1).start() + 1
            self.collector.add(json.loads(buf[first:last]), step_only=True)

    def _scan_pieces(self, buf: bytes, start: int, end: int) -> None:
        """The exact fallback for a chunk: every event that may matter, decoded with json.

        A separator inside a string cuts an event wrongly; the piece then fails to decode, which
        ends the fast pass (ValueError becomes FastPathMiss).
        """
        add = self.collector.add
        for piece in _SEPARATOR.split(buf[start + 1:end + 1])[:-1]:
            if b'"stream"' in piece or b'"correlation"' in piece or _STEP in piece or _INPUT in piece:
                add(json.loads(b"{" + piece + b"}"))
