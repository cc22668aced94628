"""Interval arithmetic with HTA 0.5.0's exact semantics, in plain Python.

HTA merges kernels with ``group = (ts > end.shift().cummax()).cumsum()`` and takes each group's
``[min ts, max end]``. Two things follow that a textbook union would not do, and HTA's numbers
depend on them:

* touching intervals (``ts == previous end``) merge;
* a rounded sub-microsecond kernel can have ``end < ts``; alone in its group it adds a negative
  length, so "union length" here is ``sum(end - ts)`` over groups, not a clipped measure.

The overlap of two merged sets is HTA's sweep: +1/-1 for one set, +2/-2 for the other, sorted by
time; time spent with running total 3 is overlap. Ties are resolved by summing every change at
one instant before reading the total, which gives the same sum as HTA's (unstable) sort order.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Iterable, Sequence

Interval = tuple  # (ts, end, ...): extra fields are ignored here

_by_start = itemgetter(0)


def merge_intervals(intervals: Iterable[Interval]) -> list[list[float]]:
    """Merge like ``hta.utils.utils.merge_kernel_intervals``; returns ``[[ts, end], ...]`` by start."""
    merged: list[list[float]] = []
    running_max_end = None
    for item in sorted(intervals, key=_by_start):
        ts, end = item[0], item[1]
        if running_max_end is None or ts > running_max_end:
            merged.append([ts, end])
        elif end > merged[-1][1]:
            merged[-1][1] = end
        if running_max_end is None or end > running_max_end:
            running_max_end = end
    return merged


def total_length(merged: Sequence[Sequence[float]]) -> float:
    return sum(end - ts for ts, end in merged)


def span(merged: Sequence[Sequence[float]]) -> float:
    """HTA's ``kernel_time``: end of the last merged group minus start of the first."""
    if not merged:
        return 0
    return merged[-1][1] - merged[0][0]


def overlap_length(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]]) -> float:
    """Time during which both merged interval sets are active (HTA's status sweep)."""
    if not first or not second:
        return 0
    changes: dict[float, int] = {}
    for weight, merged in ((1, first), (2, second)):
        for ts, end in merged:
            changes[ts] = changes.get(ts, 0) + weight
            changes[end] = changes.get(end, 0) - weight
    total = 0
    running = 0
    previous_time = None
    for time in sorted(changes):
        if running == 3:
            total += time - previous_time
        running += changes[time]
        previous_time = time
    return total
