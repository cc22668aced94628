"""Interval arithmetic with HTA 0.5.0's exact semantics, vectorized with numpy.

HTA merges kernels with ``group = (ts > end.shift().cummax()).cumsum()`` and takes each group's
``[min ts, max end]``. Two things follow that a textbook union would not do, and HTA's numbers
depend on them:

* touching intervals (``ts == previous end``) merge;
* a rounded sub-microsecond kernel can have ``end < ts``; alone in its group it adds a negative
  length, so "union length" here is ``sum(end - ts)`` over groups, not a clipped measure.

The overlap of two merged sets is HTA's sweep: +1/-1 for one set, +2/-2 for the other, sorted by
time; time spent with running total 3 is overlap. Ties are resolved by summing every change at
one instant before reading the total, which gives the same sum as HTA's (unstable) sort order.

Sorting is stable, so equal starts keep trace order. Integer arrays sum exactly; float arrays
are summed left to right like Python's ``sum``, so results do not depend on numpy's pairwise
summation.
"""

from __future__ import annotations

import numpy as np

Merged = tuple  # (starts, ends): numpy arrays, ordered by start


def total(values: np.ndarray) -> float | int:
    """Sum as a Python number: exact for integers, left to right for floats."""
    if values.dtype.kind == "f":
        return sum(values.tolist())
    return int(values.sum())


def merge(ts: np.ndarray, end: np.ndarray) -> Merged:
    """Merge like ``hta.utils.utils.merge_kernel_intervals``: group starts and ends, by start."""
    if not ts.size:
        return ts, end
    order = np.argsort(ts, kind="stable")
    ts, end = ts[order], end[order]
    # A new group starts where ts exceeds every earlier end.
    starts_group = np.empty(ts.size, dtype=bool)
    starts_group[0] = True
    np.greater(ts[1:], np.maximum.accumulate(end)[:-1], out=starts_group[1:])
    first = np.flatnonzero(starts_group)
    return ts[first], np.maximum.reduceat(end, first)


def length(merged: Merged) -> float | int:
    starts, ends = merged
    return total(ends - starts)


def span_of(merged: Merged) -> float | int:
    """HTA's ``kernel_time``: end of the last merged group minus start of the first."""
    starts, ends = merged
    if not starts.size:
        return 0
    return (ends[-1] - starts[0]).item()


def overlap(first: Merged, second: Merged) -> float | int:
    """Time during which both merged interval sets are active (HTA's status sweep)."""
    if not first[0].size or not second[0].size:
        return 0
    times = np.concatenate((first[0], first[1], second[0], second[1]))
    sizes = (first[0].size, first[0].size, second[0].size, second[0].size)
    weights = np.repeat(np.array([1, -1, 2, -2], dtype=np.int64), sizes)
    instants, where = np.unique(times, return_inverse=True)
    running = np.cumsum(np.bincount(where.ravel(), weights=weights, minlength=instants.size))
    # The stretch up to each instant counts when the total after the previous one is 3.
    both = np.flatnonzero(running[:-1] == 3)
    return total(instants[both + 1] - instants[both])

