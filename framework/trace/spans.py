"""Plain set arithmetic on time intervals, for the wait/transfer split.

Unlike :mod:`shardlight.trace.intervals` (HTA's exact merge, negative lengths and all, which the
HTA-compatible numbers depend on), these are textbook sets: an interval with ``end <= start`` is
empty, and every result is a sorted list of disjoint intervals, as ``(starts, ends)`` arrays.
Intersection and difference are one vectorized sweep over the boundaries of both sets.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

Spans = tuple  # (starts, ends): float arrays, sorted, disjoint, non-empty intervals

EMPTY: Spans = (np.array([], dtype=float), np.array([], dtype=float))


def union(starts: Iterable, ends: Iterable) -> Spans:
    """The union of the intervals ``[starts[i], ends[i]]``; empty ones are dropped."""
    starts, ends = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if not starts.size:
        return EMPTY
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    first = np.concatenate(([True], starts[1:] > reach[:-1]))  # touching intervals join
    groups = np.flatnonzero(first)
    return starts[groups], np.maximum.reduceat(ends, groups)


def from_pairs(pairs: Iterable) -> Spans:
    """Spans from ``[[start, end], ...]`` (the payload's JSON form)."""
    pairs = list(pairs)
    if not pairs:
        return EMPTY
    starts, ends = zip(*pairs)
    return union(starts, ends)


def to_pairs(spans: Spans) -> list[list[float]]:
    return [[start, end] for start, end in zip(spans[0].tolist(), spans[1].tolist())]


def size(spans: Spans) -> float:
    return float((spans[1] - spans[0]).sum())


def _sweep(first: Spans, second: Spans, keep_state: int) -> Spans:
    """Where the coverage state is ``keep_state``: 1 = only ``first``, 3 = both."""
    times = np.concatenate((first[0], first[1], second[0], second[1]))
    if not times.size:
        return EMPTY
    sizes = (first[0].size, first[0].size, second[0].size, second[0].size)
    weights = np.repeat(np.array([1, -1, 2, -2], dtype=np.int64), sizes)
    instants, where = np.unique(times, return_inverse=True)
    state = np.cumsum(np.bincount(where.ravel(), weights=weights, minlength=instants.size))
    chosen = np.flatnonzero(np.rint(state[:-1]).astype(np.int64) == keep_state)
    return union(instants[chosen], instants[chosen + 1])


def intersect(first: Spans, second: Spans) -> Spans:
    if not first[0].size or not second[0].size:
        return EMPTY
    return _sweep(first, second, 3)


def subtract(first: Spans, second: Spans) -> Spans:
    """``first`` minus ``second``."""
    if not first[0].size or not second[0].size:
        return first
    return _sweep(first, second, 1)


def join(first: Spans, second: Spans) -> Spans:
    return union(np.concatenate((first[0], second[0])), np.concatenate((first[1], second[1])))


def coarsen(spans: Spans, limit: int) -> Spans:
    """At most ``limit`` intervals: the smallest gaps are closed first (for drawing, never for measuring)."""
    starts, ends = spans
    if starts.size <= limit:
        return spans
    gaps = starts[1:] - ends[:-1]
    keep_gap = np.zeros(gaps.size, dtype=bool)
    keep_gap[np.argsort(gaps, kind="stable")[gaps.size - (limit - 1):]] = True  # the limit-1 widest gaps stay
    first = np.concatenate(([True], keep_gap))
    groups = np.flatnonzero(first)
    return starts[groups], np.maximum.reduceat(ends, groups)
