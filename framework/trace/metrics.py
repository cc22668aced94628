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
from bisect import bisect_right
from collections import Counter, defaultdict, deque
from typing import Any, Iterable

from framework.errors import ShardlightError
from framework.trace import classify
from framework.trace.intervals import merge_intervals, overlap_length, span, total_length
from framework.trace.reader import TraceRecord

_STEP_RE = re.compile(r"^ProfilerStep#(\d+)")
UNASSIGNED_STEP = "unassigned"

# An analysed event: (ts, end, kind, collective or None, launch ts or None)
Event = tuple


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


def _gpu_events(record: TraceRecord, cutoff, include_last_step: bool, bounds, round_ts) -> list[Event]:
    events = []
    launch_ts = record.launch_ts
    for row in record.gpu_rows:
        if row.is_kernel:
            raw_launch = launch_ts.get(row.correlation)
            launch = None if raw_launch is None else round_ts(raw_launch)
        else:
            launch = round_ts(row.ts)
        if not _keep(launch, cutoff, include_last_step):
            continue
        kind = classify.kernel_type(row.name)
        collective = classify.nccl_collective(row.name) if kind == classify.COMMUNICATION else None
        ts, end = bounds(row.ts, row.dur)
        events.append((ts, end, kind, collective, launch))
    return events


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


def _gloo_events(record: TraceRecord, cutoff, include_last_step: bool, bounds, round_ts) -> list[Event]:
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
    return events


def trace_mode(record: TraceRecord) -> str:
    if record.gpu_rows:
        return "gpu"
    if record.gloo_rows:
        return "gloo"
    raise ShardlightError(
        f"{record.path}: no GPU kernels (events with args.stream) and no gloo communication "
        "(gloo:* annotations) to analyse"
    )


def analysed_events(record: TraceRecord, include_last_step: bool = False,
                    step_name_count: int | None = None) -> tuple[str, list[Event]]:
    """The events one rank is measured on, after rounding and HTA's last-step filter.

    ``step_name_count`` is the number of distinct ``ProfilerStep`` names over the whole set of
    ranks analysed together (HTA decides to filter on that global count); default: this file's.
    """
    mode = trace_mode(record)
    bounds, round_ts = _rounder(record)
    count = len(record.step_names) if step_name_count is None else step_name_count
    cutoff = _last_step_cutoff(record, include_last_step, bounds) if count >= 2 else None
    build = _gpu_events if mode == "gpu" else _gloo_events
    return mode, build(record, cutoff, include_last_step, bounds, round_ts)


def measure(events: list[Event]) -> dict[str, Any]:
    """Overlap and temporal-breakdown metrics of one set of events."""
    everything = merge_intervals(events)
    compute = merge_intervals(e for e in events if e[2] == classify.COMPUTATION)
    comm = merge_intervals(e for e in events if e[2] == classify.COMMUNICATION)
    comm_us = total_length(comm)
    compute_us = total_length(compute)
    busy_us = total_length(everything)
    span_us = span(everything)
    overlap_us = overlap_length(comm, compute)
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
        "comm_count": sum(1 for e in events if e[2] == classify.COMMUNICATION),
    }


def by_collective(events: list[Event]) -> dict[str, dict[str, Any]]:
    compute = merge_intervals(e for e in events if e[2] == classify.COMPUTATION)
    groups: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        if event[2] == classify.COMMUNICATION:
            groups[event[3] or classify.UNKNOWN_COLLECTIVE].append(event)
    result = {}
    for collective in sorted(groups):
        items = groups[collective]
        merged = merge_intervals(items)
        comm_us = total_length(merged)
        overlap_us = overlap_length(merged, compute)
        result[collective] = {
            "count": len(items),
            "sum_dur_us": _number(sum(e[1] - e[0] for e in items)),
            "comm_us": _number(comm_us),
            "overlap_us": _number(overlap_us),
            "exposed_comm_us": _number(comm_us - overlap_us),
        }
    return result


def by_step(record: TraceRecord, events: list[Event]) -> dict[str, dict[str, Any]]:
    """Metrics per ``ProfilerStep#N``, events assigned by launch time; ``unassigned`` for the rest."""
    bounds, _ = _rounder(record)
    steps = _step_ranges(record, bounds)
    starts = [start for start, _, _ in steps]
    groups: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        key = UNASSIGNED_STEP
        launch = event[4]
        if launch is not None and steps:
            index = bisect_right(starts, launch) - 1
            if index >= 0 and launch < steps[index][1]:
                key = steps[index][2]
        groups[key].append(event)
    ordered = sorted(groups, key=lambda k: (k == UNASSIGNED_STEP, int(k) if k.isdigit() else 0))
    return {key: measure(groups[key]) for key in ordered}


def analyze_record(record: TraceRecord, include_last_step: bool = False,
                   step_name_count: int | None = None) -> dict[str, Any]:
    """All metrics of one rank: totals, ``by_collective`` and ``steps``."""
    mode, events = analysed_events(record, include_last_step, step_name_count)
    if not events:
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
