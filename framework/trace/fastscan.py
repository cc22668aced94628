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

Two more kinds of rows are read only where a cheap ``bytes.find`` says a chunk has them:

* the args of NCCL kernels that describe their collective (``"Collective name"``, message sizes,
  process group; :data:`shardlight.trace.records.COMM_ARG_KEYS`): that chunk's regex runs as
  ``finditer`` and each such kernel's args object is decoded with json. Until a file has shown such
  args, only a chunk whose rows hold an NCCL kernel looks for them (then matched again, once);
* the input pipeline's ``enumerate(DataLoader)`` annotations, decoded with json like the steps.

No other CPU rows are kept here: :mod:`shardlight.trace.reader` uses this pass only for a file
with device rows, which a device source analyses.

A chunk whose counts disagree (another key order, a negative id, an unexpected category) is
decoded event by event instead (``_scan_pieces``). Anything else unexpected -- a separator inside
a string, bad JSON, bad gzip -- abandons the pass with FastPathMiss and the file is read in full
by :mod:`shardlight.trace.reader`, which also words the errors.

A large file can be scanned by several processes at once (:func:`scan_part`, :func:`merge_parts`):
each scans the events of the blocks it takes (the next one no process has taken, as it goes; or every
n-th), from the first event start at or after the block's start to the first at or after the next
block's, and between its blocks only inflates the bytes; the merged record equals ``scan_trace``'s.
"""

from __future__ import annotations

import json
import re
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import count, repeat
from pathlib import Path
from typing import Callable

from shardlight.trace.chunks import INFLATE_ERRORS, Chunks
from shardlight.trace.records import INPUT_PREFIX, Collector, TraceRecord, as_int, comm_args
from shardlight.trace.window import FastPathMiss, Window

__all__ = ["Block", "FastPathMiss", "Part", "merge_parts", "scan_part", "scan_trace"]


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


def scan_trace(path: Path, chunk_chars: int) -> TraceRecord:
    """The TraceRecord of one file, or FastPathMiss when only a full read can be sure of it."""
    scanned = _scan(path, chunk_chars, 0, 1)
    whole = scanned.blocks[0]
    # A float "ts" the regexes do not read (a CPU op's, say) makes HTA round every row too.
    whole.record.float_timestamps = whole.record.float_timestamps or scanned.float_timestamps
    _read_infos(whole.record, whole.infos)
    _check(whole.record, whole.int_durations)
    return whole.record


# A part (scan_part) scans every n-th block of this many decompressed bytes.
PART_BLOCK = 2 << 20


@dataclass
class Block:
    """The scan of one block's events (all the file's in a scan in one piece)."""

    record: TraceRecord  # its events (rank and process groups not set)
    begin: int = 0  # file offset of its first event (0: the file's start)
    end: int | None = None  # file offset of the next block's first event (None: the file's end)
    infos: list = field(default_factory=list)  # the distributedInfo values it read, in file order
    # From the file's start: how the top level opens ("{" or "["); to its end: "{" when the events
    # array is followed by the rest of an object, "[" when by the end of the file.
    form: str = ""
    # How many of its GPU rows (the first ones) were read with durations that are all ints: the
    # fractional-duration check (_check) need not look at those.
    int_durations: int = 0


@dataclass
class Part:
    """What :func:`scan_part` returns, for :func:`merge_parts`."""

    blocks: list[Block]
    float_timestamps: bool  # whether the chunks it looked at for one hold a float timestamp (see scan_part)


def scan_part(path: Path, chunk_chars: int, index: int, parts: int,
              claim: Callable[[], int | None] | None = None) -> Part:
    """Part ``index`` of ``parts`` of scan_trace, for :func:`merge_parts` (FastPathMiss as scan_trace).

    The part scans the events of blocks ``index``, ``index + parts``, ... of :data:`PART_BLOCK`
    decompressed bytes (so each gets its share of the dense stretches): a block's events run from
    the first event start at or after its start offset to the first at or after the next block's.
    Event starts are found from the bytes alone (a "{" after "}" and ","), so the part that ends a
    block and the one that begins the next find the same one, and the part that ends the block
    verifies that its scan reaches exactly it. Between its blocks a part only inflates the bytes,
    and it looks for float timestamps in the chunks that start in its blocks (any of them makes the
    file's float).

    ``claim``: the parts take their blocks as they go instead, each the next block no part has
    taken (``claim()`` gives its number, in increasing order across the parts; None: no more), so
    a part that runs slower -- denser blocks, or a busy CPU -- takes fewer. Every block must be
    claimed by one of the parts. Each part then looks for float timestamps in every chunk it
    looks at (it cannot know which blocks it will take); together they look at every chunk.
    """
    return _scan(path, chunk_chars, index, parts, claim)


def merge_parts(parts: list[Part]) -> TraceRecord:
    """One file's record from all its ``scan_part`` results: equal to its scan_trace record.

    The blocks must join from the file's start to its end (each begins where the one before ends,
    the top level the same at both ends); a block that begins after the last one's start was read by
    it already (an event start found past the events array) and is left out. Columns and rows
    concatenate in file order, the launch times keep the earliest per id (in first-seen order), and
    the distributedInfo values are read in file order.
    """
    # In file order; an empty block (an event spanning its whole block) before the one it begins.
    blocks = sorted((block for part in parts for block in part.blocks),
                    key=lambda block: (block.begin, float("inf") if block.end is None else block.end))
    chain: list[Block] = []
    for block in blocks:
        if chain and chain[-1].end is None:
            break  # the rest begin after the last block's start: it read them to the file's end
        if block.begin != (chain[-1].end if chain else 0):
            raise FastPathMiss("the parts' blocks do not join")
        chain.append(block)
    if not chain or chain[-1].end is not None or chain[0].form != chain[-1].form:
        raise FastPathMiss("the parts' blocks do not reach the file's end")
    merged = TraceRecord(path=chain[0].record.path, rank=0)
    _read_infos(merged, [info for block in chain for info in block.infos])
    merged.float_timestamps = any(part.float_timestamps for part in parts)
    launch_ts = merged.launch_ts
    for record in (block.record for block in chain):
        offset = len(merged.gpu_name)
        merged.float_timestamps = merged.float_timestamps or record.float_timestamps
        merged.gpu_name.extend(record.gpu_name)
        merged.gpu_ts.extend(record.gpu_ts)
        merged.gpu_dur.extend(record.gpu_dur)
        merged.gpu_correlation.extend(record.gpu_correlation)
        merged.gpu_is_kernel.extend(record.gpu_is_kernel)
        merged.gpu_args.update((offset + row, args) for row, args in record.gpu_args.items())
        if launch_ts.keys().isdisjoint(record.launch_ts):
            launch_ts.update(record.launch_ts)
        else:
            for correlation, ts in record.launch_ts.items():
                earlier = launch_ts.get(correlation)
                if earlier is None or ts < earlier:
                    launch_ts[correlation] = ts
        merged.step_rows.extend(record.step_rows)
        merged.step_names.update(record.step_names)
        for prefix, rows in record.cpu_rows.items():
            merged.cpu_rows.setdefault(prefix, []).extend(rows)
    merged.cpu_rows.setdefault(INPUT_PREFIX, [])
    _check(merged, 0 if any(block.int_durations < len(block.record.gpu_dur) for block in chain)
           else len(merged.gpu_dur))
    return merged


def _scan(path: Path, chunk_chars: int, index: int, parts: int,
          claim: Callable[[], int | None] | None = None) -> Part:
    """Part ``index`` of ``parts`` (0 of 1: the whole file in one block; see scan_part)."""
    try:
        checks_float = None if parts == 1 or claim else (lambda offset: offset // PART_BLOCK % parts == index)
        chunks = Chunks(path, chunk_chars // 2, checks_float)  # see Chunks.__init__ on the size
    except OSError:
        raise FastPathMiss("cannot open") from None
    blocks: list[Block] = []
    try:
        window, hints = Window(chunks), _Hints()
        last = None
        for number in count(index, parts) if claim is None else iter(claim, None):
            if last is not None and number == last + 1:
                begin = blocks[-1].end  # the window is there: where the block before stopped
            else:
                begin = window.seek_event(number * PART_BLOCK) if number else 0
            last = number
            if begin is None:
                break  # no event starts after this block's start: the file ended before it
            blocks.append(_scan_block(window, path, begin, None if parts == 1 else (number + 1) * PART_BLOCK, hints))
            if blocks[-1].end is None:
                break
    # JSON and UTF-8 errors are ValueErrors; OSError, EOFError and INFLATE_ERRORS come from reading.
    except (ValueError, RecursionError, OSError, EOFError, *INFLATE_ERRORS) as exc:
        raise FastPathMiss(str(exc)) from None
    finally:
        chunks.close()
    return Part(blocks, chunks.float_ts)


def _scan_block(window: Window, path: Path, begin: int, stop: int | None, hints: _Hints) -> Block:
    """The events from the window's position, the file's start (``begin`` 0) or an event start, to
    the first event start at or after ``stop`` (None: the end of the file)."""
    block = Block(TraceRecord(path=str(path), rank=0), begin)
    scanner = _Scanner(block.record, hints)
    window.end_at(stop)
    if begin:  # in the middle of the events array
        stopped = scanner.events(window)
        if not stopped:  # the array ended: the rest of the top level
            block.form = "{" if window.peek() >= 0 else "["
            if block.form == "{" and window.expect(b",}") == ord(","):
                stopped = _members(window, scanner, block.infos)[1]
    else:
        block.form = chr(window.expect(b"{["))
        if block.form == "[":
            stopped = scanner.events(window)
        else:
            saw_events, stopped = (False, False) if window.peek() == ord("}") else _members(
                window, scanner, block.infos)
            if not saw_events:
                raise FastPathMiss("no traceEvents")
    block.int_durations = scanner.int_durations
    if stopped:
        block.end = window.stop
    elif window.peek() >= 0:
        raise FastPathMiss("extra data")
    return block


def _read_infos(record: TraceRecord, infos: list) -> None:
    """World size, process groups and rank from the file's distributedInfo values, in file order."""
    for value in infos:
        record.read_distributed_info(value)
        if isinstance(value, dict) and "rank" in value:
            rank = as_int(value.get("rank"), default=-1)
            if rank < 0:
                raise FastPathMiss("bad rank")
            record.rank = rank


def _check(record: TraceRecord, int_durations: int) -> None:
    """``int_durations``: how many of the first GPU rows are known to have int durations."""
    if not record.float_timestamps and _fractional_durations(record, int_durations):
        # An event without "ts" also makes HTA round (its ts column turns float), which
        # changes only fractional durations; finding such events takes the full read.
        raise FastPathMiss("fractional durations")


def _fractional_durations(record: TraceRecord, int_durations: int) -> bool:
    durations = [row.dur for row in record.step_rows]
    if int_durations < len(record.gpu_dur):
        durations += record.gpu_dur[int_durations:]
    return any(type(dur) is float and not dur.is_integer() for dur in durations)


def _members(window: Window, scanner: _Scanner, infos: list) -> tuple[bool, bool]:
    """An object's members, from its first key to after its "}": whether one was traceEvents, and
    whether the scan stopped in its events at the block's end."""
    saw_events = False
    while True:
        key = window.value()
        if not isinstance(key, str):
            raise FastPathMiss("object key is not a string")
        window.expect(b":")
        if key == "traceEvents":
            window.expect(b"[")
            if scanner.events(window):
                return True, True
            saw_events = True
        else:
            value = window.value()
            if key == "distributedInfo":
                infos.append(value)
        if window.expect(b",}") == ord("}"):
            return saw_events, False


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
class _Hints:
    """What a scan has learnt of its file so far, for the regions after."""

    # Whether a region held NCCL kernels with their collective's args (records.COMM_ARG_KEYS): from then
    # on every region with GPU rows looks for those args before its regex pass (see _Scanner._scan_region).
    comm_args: bool = False


class _Scanner:
    def __init__(self, record: TraceRecord, hints: _Hints):
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
        # NCCL kernel (most regions of most traces hold none, and the two searches took an eighth of a scan);
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
