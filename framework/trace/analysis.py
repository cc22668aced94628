"""Public API: analyse one rank's trace file, or a set of files/directories across ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from shardlight.errors import ShardlightError
from shardlight.trace.metrics import UNASSIGNED_STEP, analyze_record, collect_step_names
from shardlight.trace.reader import read_trace
from shardlight.trace.records import TraceRecord
from shardlight.trace.sources import source_for

TRACE_SUFFIXES = (".json", ".json.gz")

SUMMARY_METRICS = (
    "overlap_pct",
    "comm_us",
    "compute_us",
    "exposed_comm_us",
    "idle_us",
    "non_compute_us",
    "span_us",
    "comm_to_compute",
)


def is_trace_name(path: Path) -> bool:
    return path.name.endswith(TRACE_SUFFIXES)


def _load_directory(directory: Path, skipped: list[dict[str, str]]) -> list[TraceRecord]:
    candidates = sorted(p for p in directory.iterdir() if p.is_file() and is_trace_name(p))
    if not candidates:
        raise ShardlightError(f"{directory}: no trace files (*.json, *.json.gz) in this directory")
    records = []
    for candidate in candidates:
        try:
            record = read_trace(candidate)
            source_for(record)  # a file no source can analyse is skipped here, not failed on later
        except ShardlightError as exc:
            # A directory may hold other JSON (configs, reports); skip those, but say so.
            skipped.append({"file": str(candidate), "reason": str(exc)})
            continue
        records.append(record)
    if not records:
        reasons = "; ".join(item["reason"] for item in skipped[-3:])
        raise ShardlightError(f"{directory}: no usable trace among {len(candidates)} file(s): {reasons}")
    return records


def load_traces(paths: Iterable[str | Path]) -> tuple[list[TraceRecord], list[dict[str, str]]]:
    """Read every trace named by ``paths`` (files, or directories scanned one level deep).

    Returns the records sorted by rank and the directory entries that were skipped, with why.
    A bad file named explicitly, or two files with the same rank, is an error.
    """
    records: list[TraceRecord] = []
    skipped: list[dict[str, str]] = []
    paths = list(paths)
    if not paths:
        raise ShardlightError("no trace path given")
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            records.extend(_load_directory(path, skipped))
        elif path.exists():
            record = read_trace(path)
            source_for(record)
            records.append(record)
        else:
            raise ShardlightError(f"{path}: no such file or directory")
    by_rank: dict[int, TraceRecord] = {}
    for record in records:
        other = by_rank.get(record.rank)
        if other is not None:
            raise ShardlightError(
                f"{record.path}: duplicate rank {record.rank} (also in {other.path}); "
                "analyse one run at a time"
            )
        by_rank[record.rank] = record
    return [by_rank[rank] for rank in sorted(by_rank)], skipped


def analyze_trace_file(path: str | Path, include_last_step: bool = False,
                       step_name_count: int | None = None) -> dict[str, Any]:
    """Metrics of one rank's trace file (the value of one ``ranks`` entry of ``analyze_traces``)."""
    record = read_trace(path)
    result = analyze_record(record, include_last_step, step_name_count)
    result["rank"] = record.rank
    return result


def _metric_extremes(ranks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    extremes = {}
    for metric in SUMMARY_METRICS:
        values = [(r[metric], rank) for rank, r in ranks.items() if r.get(metric) is not None]
        if not values:
            continue
        low = min(values, key=lambda v: v[0])
        high = max(values, key=lambda v: v[0])
        extremes[metric] = {"min": low[0], "min_rank": int(low[1]), "max": high[0], "max_rank": int(high[1])}
    return extremes


def _stragglers(ranks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per step, the rank whose step took longest (span of its events) and by how much."""
    per_step: dict[str, list[tuple[float, int]]] = {}
    for rank, result in ranks.items():
        for step, metrics in result["steps"].items():
            if step != UNASSIGNED_STEP:
                per_step.setdefault(step, []).append((metrics["span_us"], int(rank)))
    stragglers = {}
    for step in sorted(per_step, key=int):
        spans = per_step[step]
        slowest = max(spans)
        fastest = min(spans)
        stragglers[step] = {
            "rank": slowest[1],
            "span_us": slowest[0],
            "fastest_rank": fastest[1],
            "fastest_span_us": fastest[0],
            "slowdown_us": slowest[0] - fastest[0],
            "ranks": len(spans),
        }
    return stragglers


def summarize(ranks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "num_ranks": len(ranks),
        "metrics": _metric_extremes(ranks),
        "stragglers": _stragglers(ranks),
    }


def analyze_records(records: list[TraceRecord], include_last_step: bool = False,
                    skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
    # HTA decides whether to drop the last step from the step names of all ranks together.
    step_name_count = collect_step_names(records)
    ranks = {}
    for record in records:
        result = analyze_record(record, include_last_step, step_name_count)
        ranks[str(record.rank)] = result
    summary = summarize(ranks)
    summary["include_last_step"] = include_last_step
    summary["skipped"] = list(skipped or [])
    return {"ranks": ranks, "summary": summary}


def analyze_traces(paths: Iterable[str | Path] | str | Path, include_last_step: bool = False) -> dict[str, Any]:
    """Analyse the traces of one run: ``{"ranks": {"<rank>": {...}}, "summary": {...}}``.

    ``paths`` are trace files or directories of them (one file per rank). This is the dict that
    ``shardlight analyze --json`` writes.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records, skipped = load_traces(paths)
    return analyze_records(records, include_last_step, skipped)
