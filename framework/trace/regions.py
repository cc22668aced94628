"""The fast scan's work on one region of whole events (:class:`Scanner`): the GPU rows and launch calls one
regex pass reads, checked by counts of their keys, and the few CPU rows decoded with json. What the pass reads
and why it is exact is :mod:`shardlight.trace.fastscan`'s docstring; this module holds the regexes and the
scanner that :func:`.fastscan._scan_block` runs over a block's events."""

from __future__ import annotations

import json
import re
import sys
from bisect import bisect_left
from dataclasses import dataclass
from itertools import repeat

from shardlight.trace.records import INPUT_PREFIX, Collector, TraceRecord, comm_args
from shardlight.trace.window import FastPathMiss, Window

__all__ = ["Hints", "Scanner"]


_WS_BYTES = b" \t\n\r"
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


@dataclass
class Hints:
    """What a scan has learnt of its file so far, for the regions after."""

    # Whether a region held NCCL kernels with their collective's args (records.COMM_ARG_KEYS): from then
    # on every region with GPU rows looks for those args before its regex pass (see Scanner._scan_region).
    comm_args: bool = False


class Scanner:
    def __init__(self, record: TraceRecord, hints: Hints):
        self.record = record
        self.hints = hints
        self.collector = Collector(record, cpu_prefixes=(INPUT_PREFIX,))
        # GPU rows read so far whose durations are all ints, while every row was (then it stops counting).
        self.int_durations = 0

    def events(self, window: Window) -> bool:
        """Everything from after traceEvents' "[" to after its "]" (False), or up to the event at the
        window's stop, the block's end (True)."""
        if window.peek() == ord("]"):
            window.pos += 1
            return False
        while True:
            # Whole chunks of events while the window holds them...
            while window.peek() == ord("{"):
                buf, start = window.buf, window.pos
                if window.stop is not None and window.base + start >= window.stop:
                    if window.base + start > window.stop:
                        raise FastPathMiss("the block's end is inside an event")
                    return True
                limit = window.array_end(start)
                stop = -1 if window.stop is None else window.stop - window.base
                cut = stop if start < stop < limit else _last_event_start(buf, start, limit)
                if cut > start:
                    steps = window.steps
                    first = bisect_left(steps, window.base + start)
                    last = bisect_left(steps, window.base + cut, first)
                    self._scan_region(buf, start, cut, [at - window.base for at in steps[first:last]])
                    window.pos = cut
                elif limit < len(buf) or not window.fill():
                    break
            # ...then one event decoded in full: the last one, or one holding "}]".
            self.collector.add(window.value())
            if window.expect(b",]") == ord("]"):
                return False

    def _scan_region(self, buf: bytes, start: int, end: int, steps: list[int]) -> None:
        """Events in ``buf[start:end]``: whole events, ``buf[end]`` is the next one's "{".

        ``steps``: where "ProfilerStep" occurs in that range.
        """
        streams = buf.count(b'"stream"', start, end)
        correlations = buf.count(b'"correlation"', start, end)
        matches = None
        if not correlations:
            rows = []
        elif streams and self.hints.comm_args and self._has_comm_args(buf, start, end):
            matches = list(_ROWS.finditer(buf, start, end))  # positions, for the NCCL kernels' args
            rows = [match.groups() for match in matches]
        else:
            rows = _ROWS.findall(buf, start, end)
        kernels = [row for row in rows if row[0]]
        if len(kernels) != streams or len(rows) != correlations:
            self._scan_pieces(buf, start, end)
            return
        # Until a file shows NCCL kernels with args, a region looks for the args only where its rows hold an
        # NCCL kernel (most regions of most traces hold none, and the two searches took about 6% of a scan);
        # the first such region is matched again, for the positions.
        columns = list(zip(*kernels))  # category, name, ts, dur, correlation (none: no kernels)
        if (matches is None and not self.hints.comm_args and columns
                and any(map(bytes.startswith, columns[1], repeat(b"nccl"))) and self._has_comm_args(buf, start, end)):
            self.hints.comm_args = True
            matches = list(_ROWS.finditer(buf, start, end))
            rows = [match.groups() for match in matches]
        if columns:
            if matches:
                self._add_comm_args(buf, [match for match in matches if match.group(1)])
            self._add_kernels(columns)
        if len(kernels) < len(rows):  # (rows matched again are the same rows)
            self._add_launches([row for row in rows if not row[0]])
        self._add_steps(buf, start, end, steps)
        self._add_inputs(buf, start, end)

    @staticmethod
    def _has_comm_args(buf: bytes, start: int, end: int) -> bool:
        return any(buf.find(key, start, end) >= 0 for key in _COMM_KEYS)

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

    def _add_kernels(self, columns: list) -> None:
        _, names, stamps, durations, correlations = columns
        stamps, floats = _numbers(stamps)
        if floats:
            self.record.float_timestamps = True
        durations, floats = _numbers(durations)
        record = self.record
        if not floats and self.int_durations == len(record.gpu_dur):
            self.int_durations += len(durations)
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
