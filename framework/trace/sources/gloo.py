"""gloo CPU traces: gloo work is communication, main-thread ATen ops are computation.

A gloo run has no device rows, so this rule stands in for HTA's kernel rules:

* communication = ``gloo:<op>`` user annotations (they run on gloo's worker threads);
* computation = ``aten::*`` ops on the main thread (the thread of ``ProfilerStep#N``, else the
  non-gloo thread with most ``aten::*`` ops); nested ops count once, through the union;
* each gloo work item is matched, first-in first-out, to the ``c10d::<op>`` call (or, without
  any, the ``FSDP::<op>`` annotation) that issued it; that call names the collective (gloo runs
  reduce-scatter as ``gloo:all_reduce``) and its start is the "launch" used by the last-step
  filter and the per-step split. Unmatched work keeps its own name and start.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Any

from shardlight.trace.events import COMMUNICATION, COMPUTATION, UNKNOWN_COLLECTIVE, Events, TimeRules
from shardlight.trace.records import TraceRecord
from shardlight.trace.sources.base import Source, op_collective

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


class GlooSource(Source):
    name = "gloo"
    mode = "gloo"
    needs = "gloo communication (gloo:* annotations)"
    cpu_prefixes = (_WORK, _ATEN) + _ISSUERS

    def claims(self, record: TraceRecord) -> bool:
        return bool(record.rows(_WORK))

    def events(self, record: TraceRecord, rules: TimeRules) -> Events:
        work_rows = record.rows(_WORK)
        gloo_threads = {row.tid for row in work_rows}
        pending: dict[str, deque] = defaultdict(deque)
        for start, collective in _issuing_calls(record, gloo_threads):
            pending[collective].append(start)

        events = []
        for row in sorted(work_rows, key=lambda r: r.ts):
            work = op_collective(row.name) or UNKNOWN_COLLECTIVE
            collective, raw_launch = work, row.ts
            # FIFO: the earliest still-unmatched compatible call that started before this work did.
            best = None
            for candidate, queue in pending.items():
                if queue and queue[0] <= row.ts and work_matches(work, candidate):
                    if best is None or queue[0] < pending[best][0]:
                        best = candidate
            if best is not None:
                collective, raw_launch = best, pending[best].popleft()
            launch = rules.round_ts(raw_launch)
            if rules.keeps(launch):
                ts, end = rules.bounds(row.ts, row.dur)
                events.append((ts, end, COMMUNICATION, collective, launch))

        main_thread = _main_thread(record, gloo_threads)
        for row in record.rows(_ATEN):
            if row.tid != main_thread:
                continue
            launch = rules.round_ts(row.ts)
            if rules.keeps(launch):
                ts, end = rules.bounds(row.ts, row.dur)
                events.append((ts, end, COMPUTATION, None, launch))
        return Events.from_tuples(events)
