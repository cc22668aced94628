"""Per-rank communication/computation metrics, HTA 0.5.0-compatible.

Definitions (one rank; all times in trace microseconds):

* ``comm_us`` / ``compute_us``: length of the union of communication / computation intervals;
* ``overlap_us``: time both are active; ``overlap_pct = 100 * overlap_us / comm_us``;
* ``exposed_comm_us = comm_us - overlap_us``; ``comm_to_compute = comm_us / compute_us``;
* ``span_us``: first start to last end of all analysed events (HTA's ``kernel_time``);
* ``idle_us = span_us - |union(all events)|``; ``non_compute_us = |union(all)| - compute_us``.

GPU traces: the analysed events are those with ``args.stream != -1``, classified by
:mod:`framework.trace.classify`. Float timestamps are rounded like HTA (start ``ceil``, end
``floor(ts + dur)``) for every row of a file that has any float ``ts``. HTA's last-step filter:
when the analysed set has at least two distinct ``ProfilerStep`` names, a GPU kernel is kept only
if a CPU row with its correlation id starts before the last ``ProfilerStep`` start (or, with
``include_last_step``, not after the last ``ProfilerStep`` end). Per step, a kernel belongs to the
CPU-side ``ProfilerStep#N`` whose ``[ts, ts + dur)`` holds its launch (same correlation id).

CPU traces from gloo runs (no stream-tagged events) use this rule instead:

* communication = ``gloo:<op>`` user annotations (they run on gloo's worker threads);
* computation = ``aten::*`` ops on the main thread (the thread of ``ProfilerStep#N``, else the
  non-gloo thread with most ``aten::*`` ops); nested ops count once, through the union;
* each gloo work item is matched, first-in first-out, to the ``c10d::<op>`` call (or, without
  any, the ``FSDP::<op>`` annotation) that issued it; that call names the collective (gloo runs
  reduce-scatter as ``gloo:all_reduce``) and its start is the "launch" used by the last-step
  filter and the per-step split. Unmatched work keeps its own name and start.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from framework.errors import ShardlightError
from framework.trace import classify
from framework.trace.intervals import length, merge, overlap, span_of
from framework.trace.records import TraceRecord

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)")
UNASSIGNED_STEP = "unassigned"
_KIND_CODES = {classify.COMPUTATION: 0, classify.COMMUNICATION: 1, classify.MEMORY: 2, classify.OTHER: 3}
_COMPUTATION, _COMMUNICATION = _KIND_CODES[classify.COMPUTATION], _KIND_CODES[classify.COMMUNICATION]


@dataclass
class Events:
    """The analysed events of a rank, by column; a missing launch time is NaN.

    Columns rather than a tuple per event: a large trace has 10^5 kernels, and every metric is
    a few array operations over them.
    """

    ts: np.ndarray
    end: np.ndarray
    kind: np.ndarray  # _KIND_CODES values
    collective: np.ndarray  # objects: the collective of communication events, else None
    launch: np.ndarray

    def __len__(self) -> int:
        return self.ts.size

    def take(self, which: np.ndarray) -> Events:
        return Events(self.ts[which], self.end[which], self.kind[which], self.collective[which], self.launch[which])

    @classmethod
    def from_tuples(cls, events: list[tuple]) -> Events:
        """From ``(ts, end, kind, collective or None, launch or None)`` tuples."""
        if not events:
            empty = np.array([], dtype=np.int64)
            return cls(empty, empty, empty.astype(np.int8), np.array([], dtype=object), empty.astype(float))
        ts, end, kind, collective, launch = zip(*events)
        return cls(np.array(ts), np.array(end), np.array([_KIND_CODES[k] for k in kind], dtype=np.int8),
                   np.array(collective, dtype=object),
                   np.array([math.nan if x is None else x for x in launch], dtype=float))


def _rounder(record: TraceRecord):
    if record.float_timestamps:
        def bounds(ts: float, dur: float) -> tuple[int, int]:
            return math.ceil(ts), math.floor(ts + dur)

        return bounds, math.ceil
    return (lambda ts, dur: (ts, ts + dur)), (lambda ts: ts)


def _number(value: float) -> float | int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return round(value, 3) if isinstance(value, float) else value


def _last_step_cutoff(record: TraceRecord, include_last_step: bool, bounds) -> float | None:
    """The launch-time limit of HTA's last-step filter, or None when nothing is filtered."""
    if not record.step_rows:
        return None
    ranges = [bounds(row.ts, row.dur) for row in record.step_rows]
    if include_last_step:
        return max(end for _, end in ranges)
    return max(start for start, _ in ranges)


def _keep(launch: float | None, cutoff: float | None, include_last_step: bool) -> bool:
    if cutoff is None:
        return True
    if launch is None:
        return False
    return launch <= cutoff if include_last_step else launch < cutoff


def _step_ranges(record: TraceRecord, bounds) -> list[tuple[float, float, str]]:
    steps = []
    for row in record.step_rows:
        match = _STEP_RE.match(row.name)
        # GPU-side copies of the step marker (gpu_user_annotation) do not define CPU step ranges.
        if match and row.cat != "gpu_user_annotation":
            start, end = bounds(row.ts, row.dur)
            steps.append((start, end, match.group(1)))
    steps.sort()
    return steps


def _gpu_events(record: TraceRecord, cutoff, include_last_step: bool) -> Events:
    names = record.gpu_name
    raw_ts = np.array(record.gpu_ts)
    raw_end = raw_ts + np.array(record.gpu_dur)
    launch_ts = record.launch_ts
    # A kernel is filtered by its launch call's time, anything else on a stream by its own.
    launch = np.array([launch_ts.get(correlation, math.nan) if kernel else ts for correlation, kernel, ts
                       in zip(record.gpu_correlation, record.gpu_is_kernel, record.gpu_ts)], dtype=float)
    if record.float_timestamps:
        # HTA: ceil(ts), floor(ts + dur); integer arrays then sum exactly, as Python ints did.
        raw_ts, raw_end = np.ceil(raw_ts).astype(np.int64), np.floor(raw_end).astype(np.int64)
        launch = np.ceil(launch)
    codes = {name: _KIND_CODES[classify.kernel_type(name)] for name in set(names)}
    kind = np.array([codes[name] for name in names], dtype=np.int8)
    collective = np.full(len(names), None, dtype=object)
    for index in np.flatnonzero(kind == _COMMUNICATION).tolist():
        collective[index] = classify.nccl_collective(names[index])
    events = Events(raw_ts, raw_end, kind, collective, launch)
    if cutoff is None:
        return events
    # NaN (no launch call) compares false: such kernels go, as in HTA's filter.
    return events.take(launch <= cutoff if include_last_step else launch < cutoff)


def _main_thread(record: TraceRecord, gloo_threads: set) -> Any:
    step_threads = Counter(row.tid for row in record.step_rows if row.cat != "gpu_user_annotation")
    if step_threads:
        return step_threads.most_common(1)[0][0]
    aten_threads = Counter(row.tid for row in record.aten_rows if row.tid not in gloo_threads)
    return aten_threads.most_common(1)[0][0] if aten_threads else None


def _issuing_calls(record: TraceRecord, gloo_threads: set) -> list[tuple[float, str]]:
    """(start, collective) of the calls that issue gloo work, in start order."""
    calls = []
    for prefix in ("c10d::", "FSDP::"):
        for row in record.collective_rows:
            if row.name.startswith(prefix) and row.tid not in gloo_threads:
                collective = classify.cpu_collective(row.name)
                if collective:
                    calls.append((row.ts, collective))
        if calls:
            break
    calls.sort(key=lambda call: call[0])
    return calls


def _gloo_events(record: TraceRecord, cutoff, include_last_step: bool, bounds, round_ts) -> Events:
    gloo_threads = {row.tid for row in record.gloo_rows}
    pending: dict[str, deque] = defaultdict(deque)
    for start, collective in _issuing_calls(record, gloo_threads):
        pending[collective].append(start)

    events = []
    for row in sorted(record.gloo_rows, key=lambda r: r.ts):
        work = classify.cpu_collective(row.name) or classify.UNKNOWN_COLLECTIVE
        collective, raw_launch = work, row.ts
        # FIFO: the earliest still-unmatched compatible call that started before this work did.
        best = None
        for candidate, queue in pending.items():
            if queue and queue[0] <= row.ts and classify.gloo_work_matches(work, candidate):
                if best is None or queue[0] < pending[best][0]:
                    best = candidate
        if best is not None:
            collective, raw_launch = best, pending[best].popleft()
        launch = round_ts(raw_launch)
        if _keep(launch, cutoff, include_last_step):
            ts, end = bounds(row.ts, row.dur)
            events.append((ts, end, classify.COMMUNICATION, collective, launch))

    main_thread = _main_thread(record, gloo_threads)
    for row in record.aten_rows:
        if row.tid != main_thread:
            continue
        launch = round_ts(row.ts)
        if _keep(launch, cutoff, include_last_step):
            ts, end = bounds(row.ts, row.dur)
            events.append((ts, end, classify.COMPUTATION, None, launch))
    return Events.from_tuples(events)


def trace_mode(record: TraceRecord) -> str:
    if record.gpu_ts:
        return "gpu"
    if record.gloo_rows:
        return "gloo"
    raise ShardlightError(
        f"{record.path}: no GPU kernels (events with args.stream) and no gloo communication "
        "(gloo:* annotations) to analyse"
    )


def analysed_events(record: TraceRecord, include_last_step: bool = False,
                    step_name_count: int | None = None) -> tuple[str, Events]:
    """The events one rank is measured on, after rounding and HTA's last-step filter.

    ``step_name_count`` is the number of distinct ``ProfilerStep`` names over the whole set of
    ranks analysed together (HTA decides to filter on that global count); default: this file's.
    """
    mode = trace_mode(record)
    bounds, round_ts = _rounder(record)
    count = len(record.step_names) if step_name_count is None else step_name_count
    cutoff = _last_step_cutoff(record, include_last_step, bounds) if count >= 2 else None
    if mode == "gpu":
        return mode, _gpu_events(record, cutoff, include_last_step)
    return mode, _gloo_events(record, cutoff, include_last_step, bounds, round_ts)


def _merged(events: Events, which: np.ndarray | None = None):
    if which is None:
        return merge(events.ts, events.end)
    return merge(events.ts[which], events.end[which])


def measure(events: Events) -> dict[str, Any]:
    """Overlap and temporal-breakdown metrics of one set of events."""
    is_comm = events.kind == _COMMUNICATION
    everything = _merged(events)
    compute = _merged(events, events.kind == _COMPUTATION)
    comm = _merged(events, is_comm)
    comm_us = length(comm)
    compute_us = length(compute)
    busy_us = length(everything)
    span_us = span_of(everything)
    overlap_us = overlap(comm, compute)
    return {
        "overlap_pct": round(100.0 * overlap_us / comm_us, 4) if comm_us else 0.0,
        "comm_us": _number(comm_us),
        "compute_us": _number(compute_us),
        "overlap_us": _number(overlap_us),
        "exposed_comm_us": _number(comm_us - overlap_us),
        "idle_us": _number(span_us - busy_us),
        "non_compute_us": _number(busy_us - compute_us),
        "span_us": _number(span_us),
        "busy_us": _number(busy_us),
        "comm_to_compute": (comm_us / compute_us) if compute_us else None,
        "n_events": len(events),
        "comm_count": int(is_comm.sum()),
    }


def by_collective(events: Events) -> dict[str, dict[str, Any]]:
    compute = _merged(events, events.kind == _COMPUTATION)
    comm = events.take(events.kind == _COMMUNICATION)
    names = np.array([name or classify.UNKNOWN_COLLECTIVE for name in comm.collective.tolist()], dtype=object)
    result = {}
    for collective in sorted(set(names.tolist())):
        items = comm.take(names == collective)
        merged = _merged(items)
        comm_us = length(merged)
        overlap_us = overlap(merged, compute)
        result[collective] = {
            "count": len(items),
            "sum_dur_us": _number(length((items.ts, items.end))),
            "comm_us": _number(comm_us),
            "overlap_us": _number(overlap_us),
            "exposed_comm_us": _number(comm_us - overlap_us),
        }
    return result


def by_step(record: TraceRecord, events: Events) -> dict[str, dict[str, Any]]:
    """Metrics per ``ProfilerStep#N``, events assigned by launch time; ``unassigned`` for the rest."""
    bounds, _ = _rounder(record)
    steps = _step_ranges(record, bounds)
    keys = np.full(len(events), UNASSIGNED_STEP, dtype=object)
    if steps:
        starts = np.array([start for start, _, _ in steps])
        ends = np.array([end for _, end, _ in steps])
        names = np.array([name for _, _, name in steps], dtype=object)
        # The last step starting at or before the launch, if the launch is inside it.
        index = np.searchsorted(starts, events.launch, side="right") - 1
        safe = np.maximum(index, 0)
        inside = (index >= 0) & (events.launch < ends[safe])
        keys[inside] = names[safe[inside]]
    groups = sorted(set(keys.tolist()), key=lambda k: (k == UNASSIGNED_STEP, int(k) if k.isdigit() else 0))
    return {key: measure(events.take(keys == key)) for key in groups}


def analyze_record(record: TraceRecord, include_last_step: bool = False,
                   step_name_count: int | None = None) -> dict[str, Any]:
    """All metrics of one rank: totals, ``by_collective`` and ``steps``."""
    mode, events = analysed_events(record, include_last_step, step_name_count)
    if not len(events):
        raise ShardlightError(f"{record.path}: no events left to analyse after the last-step filter")
    result = {"file": record.path, "mode": mode}
    result.update(measure(events))
    result["by_collective"] = by_collective(events)
    result["steps"] = by_step(record, events)
    return result


def collect_step_names(records: Iterable[TraceRecord]) -> int:
    names: set[str] = set()
    for record in records:
        names |= record.step_names
    return len(names)
