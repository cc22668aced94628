"""Fast pass over a Kineto trace: a few C-speed scans of the raw bytes instead of decoding events.

A GPU analysis needs a small part of a trace: GPU rows (events with ``args.stream``), the launch
calls that share their correlation ids, and the ``ProfilerStep`` markers. Decoding every event
with the json module costs about as much as the whole analysis may take, so the event array is
cut into chunks of whole events and each chunk gets (:class:`.regions.Scanner`):

* ``regions._ROWS``: one compiled regex that reads name, ts, dur and correlation of GPU rows (stream >= 0
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
decoded event by event instead (``Scanner._scan_pieces``). Anything else unexpected -- a separator inside
a string, bad JSON, bad gzip -- abandons the pass with FastPathMiss and the file is read in full
by :mod:`shardlight.trace.reader`, which also words the errors.

A large file can be scanned by several processes at once (:func:`scan_part`, :func:`merge_parts`):
each scans the events of the blocks it takes (the next one no process has taken, as it goes; or every
n-th), from the first event start at or after the block's start to the first at or after the next
block's, and between its blocks only inflates the bytes; the merged record equals ``scan_trace``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Callable

from shardlight.trace.chunks import INFLATE_ERRORS, Chunks
from shardlight.trace.records import INPUT_PREFIX, TraceRecord, as_int
from shardlight.trace.regions import Hints, Scanner
from shardlight.trace.window import FastPathMiss, Window

__all__ = ["Block", "FastPathMiss", "Part", "merge_parts", "scan_part", "scan_trace"]


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
        window, hints = Window(chunks), Hints()
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


def _scan_block(window: Window, path: Path, begin: int, stop: int | None, hints: Hints) -> Block:
    """The events from the window's position, the file's start (``begin`` 0) or an event start, to
    the first event start at or after ``stop`` (None: the end of the file)."""
    block = Block(TraceRecord(path=str(path), rank=0), begin)
    scanner = Scanner(block.record, hints)
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


def _members(window: Window, scanner: Scanner, infos: list) -> tuple[bool, bool]:
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
