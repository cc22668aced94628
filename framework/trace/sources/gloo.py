"""gloo CPU traces: gloo work is communication, main-thread ATen ops are computation.

A gloo run has no device rows, so this rule stands in for HTA's kernel rules:

* communication = ``gloo:<op>`` user annotations (they run on gloo's worker threads);
* computation = ``aten::*`` ops on the main thread (the thread of ``ProfilerStep#N``, else the
  non-gloo thread with most ``aten::*`` ops); nested ops count once, through the union;
* each gloo work item is matched, first-in first-out, to the ``c10d::<op>`` call (or, without
  any, the ``FSDP::<op>`` annotation) that issued it; that call names the collective (gloo runs
  reduce-scatter as ``gloo:all_reduce``) and its start is the "launch" used by the last-step
  filter and the per-step split. Unmatched work keeps its own name and start;
* aten ops inside the DataLoader's ``enumerate(DataLoader)`` annotations are the input
  pipeline's (collate), not the model's, so they are not computation;
* a work item's size comes from its ``Input Dims`` / ``Input type`` (recorded with
  ``record_shapes=True``): this rank's input, which for ``gloo:all_reduce`` running a
  reduce-scatter is the full input;
* its process group: the annotation does not name one, and c10d's "Sequence number" is 0 for every
  gloo call (torch 2.13), but torch's flight recorder does: a run keeps, beside each trace, the
  collectives its rank issued while the trace recorded (``TraceRecord.issued``). They are matched to
  the issuing calls in order, from the last (the recorder may hold a few from before the trace began;
  a collective no call shows, a barrier, is passed over), so each work item gets its call's group
  and ranks; without them, or when any call finds no match, every item is in the default group.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter, defaultdict, deque
from typing import Any

from shardlight.trace.events import COMMUNICATION, COMPUTATION, UNKNOWN_COLLECTIVE, Events, TimeRules, comm_info
from shardlight.trace.records import INPUT_PREFIX, CpuRow, TraceRecord
from shardlight.trace.sizes import dtype_bytes, message_bytes
from shardlight.trace.sources.interface import Source, op_collective

_WORK, _ATEN = "gloo:", "aten::"
# The calls that issue gloo work, in order of preference: FSDP annotations only when no c10d call is seen.
_ISSUERS = ("c10d::", "FSDP::")


def work_matches(work_collective: str, issued_collective: str) -> bool:
    """Whether a gloo work item can be the one a c10d/FSDP op issued.

    gloo runs reduce-scatter as an all-reduce (its annotation says ``gloo:all_reduce``), so an
    all_reduce work item may belong to a reduce_scatter call.
    """
    if work_collective == issued_collective:
        return True
    return work_collective == "all_reduce" and issued_collective == "reduce_scatter"


def _main_thread(record: TraceRecord, gloo_threads: set) -> Any:
    step_threads = Counter(row.tid for row in record.step_rows if row.cat != "gpu_user_annotation")
    if step_threads:
        return step_threads.most_common(1)[0][0]
    aten_threads = Counter(row.tid for row in record.rows(_ATEN) if row.tid not in gloo_threads)
    return aten_threads.most_common(1)[0][0] if aten_threads else None


def _issuing_calls(record: TraceRecord, gloo_threads: set) -> list[tuple[float, str]]:
    """(start, collective) of the calls that issue gloo work, in start order."""
    calls = []
    for prefix in _ISSUERS:
        for row in record.rows(prefix):
            if row.tid not in gloo_threads:
                collective = op_collective(row.name)
                if collective:
                    calls.append((row.ts, collective))
        if calls:
            break
    calls.sort(key=lambda call: call[0])
    return calls


Group = tuple  # (name, ranks or None, size or None)


def call_groups(record: TraceRecord, calls: list[tuple[float, str]], default: Group) -> list[Group]:
    """The process group of each issuing call (in ``calls``' order), from the record's flight-recorder
    entries; every call in ``default`` when there are none or one of the calls matches none."""
    issued = [(op_collective(entry.get("op", "")), entry) for entry in record.issued or []]
    issued = [(collective, entry) for collective, entry in issued if collective]
    groups: list[Group] = []
    index = len(issued) - 1
    for _, collective in reversed(calls):
        while index >= 0 and not work_matches(issued[index][0], collective):
            index -= 1
        if index < 0:
            return [default] * len(calls)
        entry = issued[index][1]
        ranks = tuple(int(r) for r in entry["ranks"]) if entry.get("ranks") else None
        groups.append((str(entry.get("group")), ranks, len(ranks) if ranks else default[2]))
        index -= 1
    return groups[::-1]


def input_bytes(row: CpuRow) -> float:
    """Bytes of a work row's input tensors (its ``Input Dims`` and ``Input type``); NaN if not recorded."""
    args = row.args or {}
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or not dims:
        return math.nan
    total = 0.0
    for shape, dtype in zip(dims, types):
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            return math.nan  # a tensor list or an unrecorded shape: the size is not known exactly
        total += math.prod(shape) * dtype_bytes(dtype)
    return total


def _inside_input(rows: list[CpuRow]):
    """A test of whether ``[ts, ts + dur]`` lies inside one of the input annotations ``rows``."""
    spans = sorted((row.ts, row.ts + row.dur) for row in rows)
    starts = [start for start, _ in spans]
    reach = []  # the furthest end of the spans up to each one: nested or overlapping spans are fine
    for _, end in spans:
        reach.append(max(end, reach[-1]) if reach else end)

    def inside(ts: float, dur: float) -> bool:
        index = bisect_right(starts, ts) - 1
        return index >= 0 and ts + dur <= reach[index]
    return inside


class GlooSource(Source):
    name = "gloo"
    mode = "gloo"
    needs = "gloo communication (gloo:* annotations)"
    cpu_prefixes = (_WORK, _ATEN) + _ISSUERS
    cpu_args_prefixes = (_WORK,)

    def claims(self, record: TraceRecord) -> bool:
        return bool(record.rows(_WORK))

    def events(self, record: TraceRecord, rules: TimeRules) -> Events:
        work_rows = record.rows(_WORK)
        gloo_threads = {row.tid for row in work_rows}
        default = record.default_group()
        calls = _issuing_calls(record, gloo_threads)
        pending: dict[str, deque] = defaultdict(deque)
        for (start, collective), group in zip(calls, call_groups(record, calls, default)):
            pending[collective].append((start, group))

        events = []
        for row in sorted(work_rows, key=lambda r: r.ts):
            work = op_collective(row.name) or UNKNOWN_COLLECTIVE
            collective, raw_launch, (group, ranks, group_size) = work, row.ts, default
            # FIFO: the earliest still-unmatched compatible call that started before this work did.
            best = None
            for candidate, queue in pending.items():
                if queue and queue[0][0] <= row.ts and work_matches(work, candidate):
                    if best is None or queue[0][0] < pending[best][0][0]:
                        best = candidate
            if best is not None:
                collective, (raw_launch, (group, ranks, group_size)) = best, pending[best].popleft()
            launch = rules.round_ts(raw_launch)
            if rules.keeps(launch):
                ts, end = rules.bounds(row.ts, row.dur)
                size = message_bytes(collective, input_bytes(row), math.nan, group_size)
                info = comm_info(None, size, group, ranks, group_size)
                events.append((ts, end, COMMUNICATION, collective, launch, info))

        main_thread = _main_thread(record, gloo_threads)
        inside_input = _inside_input([row for row in record.rows(INPUT_PREFIX) if row.tid == main_thread])
        for row in record.rows(_ATEN):
            if row.tid != main_thread or inside_input(row.ts, row.dur):
                continue
            launch = rules.round_ts(row.ts)
            if rules.keeps(launch):
                ts, end = rules.bounds(row.ts, row.dur)
                events.append((ts, end, COMPUTATION, None, launch))
        return Events.from_tuples(events)
