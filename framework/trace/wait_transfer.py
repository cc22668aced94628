"""Wait vs transfer: the cross-rank split of each rank's communication time.

A blocking collective on a rank is two things: waiting for the last rank of its group to arrive
(skew: a straggler, uneven compute or input) and the transfer once everyone is there. From the
ranks' payloads (:mod:`.payload`):

1. **Matching.** A collective's instances on the ranks of its process group are matched by
   ``(group, seq)`` where every instance of the group carries a seq, otherwise by order within
   ``(group, kind)`` (the ranks trace the same steps). A group is matched only when all its
   ranks are present; with unequal counts the common prefix is matched. Everything else is
   *unmatched*: all transfer, no wait (there is no arrival to compare with), and counted.
2. **Clocks.** Ranks on different hosts have different clocks, but all ranks leave a collective
   within microseconds of each other, so each rank's offset to the reference rank (the lowest)
   is the median over matched collectives of ``end(rank) - end(reference)`` (through another
   rank when it shares none with the reference). The residual is what the offsets leave of
   those end differences (median and max of their absolute values).
3. **Split.** Per matched instance, ``last = max over ranks of the corrected start``; on each
   rank, wait = ``[start, min(last, end)]``, transfer = ``[max(start, last), end]``. Per rank
   (and step): ``wait_us = |union(wait) - union(transfer)|`` and ``transfer_us = comm_us -
   wait_us``, so the two add up to the HTA-compatible ``comm_us`` exactly (``|union(transfer)|``
   but for HTA's negative lengths of rounded sub-microsecond kernels); ``exposed_wait_us`` is
   wait not covered by computation, ``exposed_transfer_us = exposed_comm_us - exposed_wait_us``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from typing import Any

import numpy as np

import shardlight.trace.spans as spans
from shardlight.trace.bandwidth import bandwidth
from shardlight.trace.metrics import json_number
from shardlight.trace.payload import ALL

Match = dict  # rank -> index of its instance in that rank's payload
TIMELINE = "timeline"  # the key of a rank's one drawn step, next to the step numbers and ALL


def _columns(payload: dict[str, Any]) -> dict[str, np.ndarray]:
    instances = payload["instances"]
    return {"start": np.asarray(instances["start"], dtype=float), "end": np.asarray(instances["end"], dtype=float),
            "kind": instances["kind"], "group": instances["group"], "seq": instances["seq"],
            "step": np.asarray(instances["step"], dtype=object)}


def _members(group: str, payloads: dict[int, dict], world: int | None) -> list[int]:
    for payload in payloads.values():
        ranks = payload["groups"].get(group)
        if ranks:
            return sorted(ranks)
    return list(range(world)) if world else sorted(payloads)


def _keys(columns: dict, indices: list[int], by_seq: bool) -> dict[tuple, int]:
    """Matching key -> instance index: ``(seq, kind, n-th)`` or ``(kind, n-th)``, in start order."""
    seen: dict[tuple, int] = defaultdict(int)
    keys = {}
    for index in sorted(indices, key=lambda i: columns["start"][i]):
        base = (columns["seq"][index], columns["kind"][index]) if by_seq else (columns["kind"][index],)
        keys[base + (seen[base],)] = index
        seen[base] += 1
    return keys


def match(payloads: dict[int, dict], columns: dict[int, dict], world: int | None) -> tuple[list[Match], str]:
    """The matched collectives and how they were matched ("seq", "order" or "none")."""
    by_group: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, cols in columns.items():
        for index, group in enumerate(cols["group"]):
            by_group[group][rank].append(index)
    matches: list[Match] = []
    modes = set()
    for group in sorted(by_group):
        members = _members(group, payloads, world)
        if not members or not set(members) <= set(payloads):
            continue  # part of the group is not here: its collectives stay unmatched
        owned = by_group[group]
        by_seq = all(columns[rank]["seq"][i] is not None for rank in members for i in owned.get(rank, []))
        keyed = {rank: _keys(columns[rank], owned.get(rank, []), by_seq) for rank in members}
        common = set.intersection(*(set(keys) for keys in keyed.values()))
        if common:
            modes.add("seq" if by_seq else "order")
        for key in sorted(common, key=lambda k: columns[members[0]]["start"][keyed[members[0]][k]]):
            matches.append({rank: keyed[rank][key] for rank in members})
    mode = "order" if "order" in modes else ("seq" if modes else "none")
    return matches, mode


def clock_offsets(matches: list[Match], columns: dict[int, dict], ranks: list[int]) -> dict[str, Any]:
    """Offsets of each rank's clock to the reference rank's, from the ends of matched collectives."""
    reference = ranks[0]
    # end(rank) - end(anchor) per pair, the anchor being each match's lowest rank
    differences: dict[tuple[int, int], list[float]] = defaultdict(list)
    for found in matches:
        anchor = min(found)
        anchor_end = columns[anchor]["end"][found[anchor]]
        for rank, index in found.items():
            if rank != anchor:
                differences[(anchor, rank)].append(columns[rank]["end"][index] - anchor_end)
    links: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (anchor, rank), values in differences.items():
        middle = statistics.median(values)
        links[anchor].append((rank, middle))
        links[rank].append((anchor, -middle))
    offsets = {reference: 0.0}
    queue = deque([reference])
    while queue:  # breadth first: each rank through the fewest hops to the reference
        here = queue.popleft()
        for other, middle in sorted(links[here]):
            if other not in offsets:
                offsets[other] = offsets[here] + middle
                queue.append(other)
    residuals = []
    for found in matches:
        if all(rank in offsets for rank in found):
            anchor = min(found)
            anchor_end = columns[anchor]["end"][found[anchor]] - offsets[anchor]
            residuals += [abs(columns[rank]["end"][index] - offsets[rank] - anchor_end)
                          for rank, index in found.items() if rank != anchor]
    return {
        "reference_rank": reference,
        "offsets_us": {str(rank): round(float(offsets.get(rank, 0.0)), 3) for rank in ranks},
        "residual_us": round(float(statistics.median(residuals)), 3) if residuals else 0.0,
        "max_residual_us": round(float(max(residuals)), 3) if residuals else 0.0,
        "matched": len(matches),
    }


def _intervals(matches: list[Match], columns: dict[int, dict], offsets: dict[int, float]):
    """Per rank, the wait and transfer interval of every instance; and each collective's transfer."""
    cut = {rank: cols["start"].copy() for rank, cols in columns.items()}  # wait/transfer boundary
    collectives = []  # (rank, index or None for a match, mean transfer us)
    for found in matches:
        last = max(columns[rank]["start"][index] - offsets[rank] for rank, index in found.items())
        transfers = []
        for rank, index in found.items():
            start, end = columns[rank]["start"][index], columns[rank]["end"][index]
            cut[rank][index] = min(max(start, last + offsets[rank]), max(start, end))
            transfers.append(max(0.0, end - cut[rank][index]))
        anchor = min(found)
        collectives.append((anchor, found[anchor], float(np.mean(transfers)), found))
    return cut, collectives


def _rank_split(result: dict, payload: dict, cols: dict, cut: np.ndarray) -> dict[str, dict[str, Any]]:
    """The split keys of one rank, per step and for ``ALL``."""
    split = {}
    step_keys = [ALL] + list(result["steps"])
    for key in step_keys:
        chosen = np.ones(cols["start"].size, dtype=bool) if key == ALL else cols["step"] == key
        waiting = spans.union(cols["start"][chosen], cut[chosen])
        moving = spans.union(cut[chosen], cols["end"][chosen])
        pure_wait = spans.subtract(waiting, moving)
        measured = result if key == ALL else result["steps"][key]
        wait_us = spans.size(pure_wait)
        exposed_wait = spans.size(spans.subtract(pure_wait, spans.from_pairs(payload["covered"].get(key, []))))
        steps = payload["steps"]
        wall = sum(end - start for start, end in steps.values()) if key == ALL else (
            steps[key][1] - steps[key][0] if key in steps else 0)
        split[key] = {
            "wall_us": json_number(float(wall)),
            "wait_us": json_number(wait_us),
            "transfer_us": json_number(float(measured["comm_us"] - wait_us)),
            "exposed_wait_us": json_number(exposed_wait),
            "exposed_transfer_us": json_number(float(measured["exposed_comm_us"] - exposed_wait)),
            "input_us": json_number(float(payload["input"]["input_us"].get(key, 0.0))),
            "input_wait_us": json_number(float(payload["input"]["input_wait_us"].get(key, 0.0))),
        }
    return split


def _timeline(payloads: dict[int, dict], columns: dict[int, dict], cut: dict[int, np.ndarray],
              offsets: dict[int, float]) -> dict[int, dict[str, Any]]:
    """Per rank, one step on the reference clock, relative to the earliest rank's start of it: step, computation,
    wait, transfer and input intervals (what the report draws as a timeline; empty when the ranks' first
    analysed steps differ)."""
    names = {payload.get("timeline", {}).get("step") for payload in payloads.values()}
    name = names.pop() if len(names) == 1 else None
    if name is None or any(name not in payload["steps"] for payload in payloads.values()):
        return {}
    origin = min(payload["steps"][name][0] - offsets[rank] for rank, payload in payloads.items())
    timelines = {}
    for rank, payload in payloads.items():
        shift = offsets[rank] + origin
        cols = columns[rank]
        chosen = cols["step"] == name

        def pairs(starts, ends, shift=float(shift)):  # Python floats: the same differences, 5x faster
            starts, ends = (np.asarray(values, dtype=float).tolist() for values in (starts, ends))
            return [[round(a - shift, 1), round(b - shift, 1)] for a, b in zip(starts, ends) if b > a]

        start, end = payload["steps"][name]
        timelines[rank] = {
            "step": name, "start_us": round(float(start - shift), 1), "end_us": round(float(end - shift), 1),
            "compute": pairs(*zip(*payload["timeline"]["compute"])) if payload["timeline"]["compute"] else [],
            "wait": pairs(cols["start"][chosen], cut[rank][chosen]),
            "transfer": pairs(cut[rank][chosen], cols["end"][chosen]),
            "input": pairs(*zip(*payload["input"]["intervals"].get(name, []))) if
            payload["input"]["intervals"].get(name) else [],
        }
    return timelines


def cross_rank(results: dict[int, dict], link_peak_gbps: float | None = None) -> tuple[dict, dict]:
    """Per rank ``{step or ALL: split keys}`` plus matched/unmatched counts, and the summary parts."""
    payloads = {rank: result["payload"] for rank, result in results.items()}
    ranks = sorted(payloads)
    world = max((p["world_size"] for p in payloads.values() if p.get("world_size")), default=None)
    columns = {rank: _columns(payloads[rank]) for rank in ranks}
    matches, mode = match(payloads, columns, world)
    clock = clock_offsets(matches, columns, ranks)
    offsets = {rank: clock["offsets_us"][str(rank)] for rank in ranks}
    cut, matched = _intervals(matches, columns, offsets)
    is_matched = {rank: np.zeros(columns[rank]["start"].size, dtype=bool) for rank in ranks}
    sized = []
    for anchor, index, transfer_us, found in matched:
        for rank, own in found.items():
            is_matched[rank][own] = True
        instances = payloads[anchor]["instances"]
        sizes = [payloads[r]["instances"]["bytes"][i] for r, i in found.items()]
        known = [size for size in sizes if size is not None]
        sized.append((instances["kind"][index], known[0] if known else None, instances["group_size"][index],
                      transfer_us))
    unmatched = {}
    for rank in ranks:
        instances = payloads[rank]["instances"]
        alone = np.flatnonzero(~is_matched[rank]).tolist()
        unmatched[str(rank)] = len(alone)
        sized += [(instances["kind"][i], instances["bytes"][i], instances["group_size"][i],
                   max(0.0, instances["end"][i] - instances["start"][i])) for i in alone]
    splits = {}
    timelines = _timeline(payloads, columns, cut, offsets)
    for rank in ranks:
        splits[rank] = _rank_split(results[rank], payloads[rank], columns[rank], cut[rank])
        splits[rank][ALL].update(steps=len(payloads[rank]["steps"]), matched=int(is_matched[rank].sum()),
                                 unmatched=unmatched[str(rank)])
        if rank in timelines:
            splits[rank][TIMELINE] = timelines[rank]
    summary = {
        "clock": clock,
        "collectives": {"match": mode, "matched": len(matches), "unmatched": unmatched, "world_size": world,
                        "missing_ranks": sorted(set(range(world)) - set(ranks)) if world else []},
        "bandwidth": bandwidth(sized, link_peak_gbps),
    }
    return splits, summary
