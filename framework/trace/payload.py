"""One rank's share of the cross-rank split: its communication instances and the local intervals.

The wait/transfer split needs every rank's collectives side by side (:mod:`.split`), but not
every rank's trace: the live callback gathers one small dict per rank to rank 0. This module
builds that dict, the *payload*, from one rank's analysed events. It is plain lists and numbers
(picklable, JSON-able):

* ``instances``: one entry per communication event, by column: ``start``, ``end`` (after the
  time rules, as the events), ``kind`` (the collective), ``bytes`` (nccl-tests' size, None when
  unknown), ``group`` (process-group key), ``seq`` (None when the trace has none),
  ``group_size`` and ``step`` (the ProfilerStep of its launch, as ``metrics.by_step`` assigns);
* ``groups``: group key -> its ranks (None: the whole world);
* ``covered``: per step (and ``"all"``), computation that overlaps communication, as merged
  ``[start, end]`` pairs: all the split needs of computation, since waits lie inside
  communication;
* ``steps``: the analysed ``ProfilerStep`` ranges; ``input``: per step, the DataLoader's
  ``__next__`` intervals on the main thread, with ``input_us`` and ``input_wait_us`` (input time
  covered by neither computation nor communication) already measured, as they are local;
* ``timeline``: the first analysed step's computation as merged ``[start, end]`` pairs, at most
  ``TIMELINE_INTERVALS`` of them (the smallest gaps closed): what the report draws, never measured.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

import shardlight.trace.spans as spans
from shardlight.trace.events import COMMUNICATION_CODE, COMPUTATION_CODE, UNKNOWN_COLLECTIVE, Events, TimeRules
from shardlight.trace.metrics import UNASSIGNED_STEP, step_keys, step_order, step_ranges
from shardlight.trace.records import INPUT_PREFIX, TraceRecord

ALL = "all"  # the key of whole-rank values next to the step numbers
DEFAULT_GROUP = "default"  # the key of the default group when the trace does not name it
TIMELINE_INTERVALS = 400  # computation intervals of the one step the report draws (enough at plot width)


def _main_thread(record: TraceRecord) -> Any:
    threads = Counter(row.tid for row in record.step_rows if row.cat != "gpu_user_annotation")
    return threads.most_common(1)[0][0] if threads else None


def _instances(record: TraceRecord, events: Events, keys: np.ndarray) -> tuple[dict, dict]:
    default_name, default_ranks, default_size = record.default_group()
    default_key = default_name or DEFAULT_GROUP
    groups: dict[str, Any] = {}
    comm = np.flatnonzero(events.kind == COMMUNICATION_CODE)
    columns: dict[str, list] = {"start": events.ts[comm].tolist(), "end": events.end[comm].tolist()}
    columns.update((name, []) for name in ("kind", "bytes", "group", "seq", "group_size"))
    for info, collective in zip(events.info[comm].tolist(), events.collective[comm].tolist()):
        info = info or {}
        group = info.get("group") or default_key
        ranks = info.get("ranks") or (default_ranks if group == default_key else None)
        if groups.get(group) is None:
            groups[group] = list(ranks) if ranks else None
        size = info.get("bytes", math.nan)
        columns["kind"].append(info.get("kind") or collective or UNKNOWN_COLLECTIVE)
        columns["bytes"].append(None if size is None or math.isnan(size) else size)
        columns["group"].append(group)
        columns["seq"].append(info.get("seq"))
        columns["group_size"].append(info.get("group_size") or (len(ranks) if ranks else default_size))
    columns["step"] = keys[comm].tolist()
    return columns, groups


def _covered(events: Events, keys: np.ndarray) -> dict[str, list]:
    """Per step and in all: computation intersected with communication, merged."""
    is_comm = events.kind == COMMUNICATION_CODE
    is_compute = events.kind == COMPUTATION_CODE
    covered = {}
    for key in [ALL] + step_order(keys.tolist()):
        in_step = np.ones(len(events), dtype=bool) if key == ALL else keys == key
        comm = spans.union(events.ts[is_comm & in_step], events.end[is_comm & in_step])
        compute = spans.union(events.ts[is_compute & in_step], events.end[is_compute & in_step])
        covered[key] = spans.to_pairs(spans.intersect(comm, compute))
    return covered


def _input(record: TraceRecord, events: Events, rules: TimeRules, steps: list) -> dict[str, Any]:
    main = _main_thread(record)
    rows = [row for row in record.rows(INPUT_PREFIX) if main is None or row.tid == main]
    bounds = [rules.bounds(row.ts, row.dur) for row in rows if rules.keeps(rules.round_ts(row.ts))]
    starts = np.array([start for start, _ in bounds], dtype=float)
    ends = np.array([end for _, end in bounds], dtype=float)
    keys = step_keys(steps, starts)  # a DataLoader call belongs to the step it starts in
    busy = (events.kind == COMPUTATION_CODE) | (events.kind == COMMUNICATION_CODE)
    active = spans.union(events.ts[busy], events.end[busy])
    result: dict[str, Any] = {"intervals": {}, "input_us": {}, "input_wait_us": {}}
    for key in [ALL] + step_order(keys.tolist()):
        chosen = np.ones(starts.size, dtype=bool) if key == ALL else keys == key
        loading = spans.union(starts[chosen], ends[chosen])
        if key != ALL:
            result["intervals"][key] = spans.to_pairs(loading)
        result["input_us"][key] = spans.size(loading)
        result["input_wait_us"][key] = spans.size(spans.subtract(loading, active))
    return result


def _timeline(events: Events, keys: np.ndarray, analysed: list) -> dict[str, Any]:
    """The first analysed step's computation, merged and coarsened for drawing."""
    if not analysed:
        return {"step": None, "compute": []}
    name = analysed[0][2]
    chosen = (events.kind == COMPUTATION_CODE) & (keys == name)
    merged = spans.union(events.ts[chosen], events.end[chosen])
    return {"step": name, "compute": spans.to_pairs(spans.coarsen(merged, TIMELINE_INTERVALS))}


def build_payload(record: TraceRecord, rules: TimeRules, events: Events, include_last_step: bool) -> dict[str, Any]:
    """The payload of one rank's analysed events (see the module docstring)."""
    steps = step_ranges(record, rules)
    keys = step_keys(steps, events.launch)
    instances, groups = _instances(record, events, keys)
    analysed = [(start, end, name) for start, end, name in steps if rules.keeps(start)]
    return {
        "rank": record.rank,
        "world_size": record.world_size,
        "include_last_step": include_last_step,
        "instances": instances,
        "groups": groups,
        "covered": _covered(events, keys),
        "steps": {name: [start, end] for start, end, name in analysed},
        "input": _input(record, events, rules, steps),
        "timeline": _timeline(events, keys, analysed),
    }


def step_names(payload: dict[str, Any]) -> list[str]:
    """The analysed step numbers of a payload, in order."""
    return [key for key in step_order(payload["steps"]) if key != UNASSIGNED_STEP]
