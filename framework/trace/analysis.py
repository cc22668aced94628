"""Public API: analyse one rank's trace file, or a set of files/directories across ranks.

Across ranks there is one implementation whether the traces are read here or on their ranks:
each rank's result carries a compact payload (:mod:`.payload`), and :func:`combine` turns the
results into the analysis with the wait/transfer split (:mod:`.split`). ``analyze_records``
does exactly that; the live callback analyses with ``payload=True`` on every rank, gathers the
results, and calls ``combine`` on rank 0.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

from shardlight.errors import ShardlightError
from shardlight.trace.events import TimeRules
from shardlight.trace.metrics import UNASSIGNED_STEP, collect_step_names, measure_record, prepare
from shardlight.trace.payload import ALL, build_payload
from shardlight.trace.reader import read_trace, read_traces
from shardlight.trace.records import ISSUED_SUFFIX, TraceRecord
from shardlight.trace.sources import source_for
from shardlight.trace.wait_transfer import TIMELINE, cross_rank

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
    """A trace file's name; not the collectives kept beside one (``records.issued_path``)."""
    return path.name.endswith(TRACE_SUFFIXES) and not path.name.endswith(ISSUED_SUFFIX)


def _directory_files(directory: Path) -> list[Path]:
    candidates = sorted(p for p in directory.iterdir() if p.is_file() and is_trace_name(p))
    if not candidates:
        raise ShardlightError(f"{directory}: no trace files (*.json, *.json.gz) in this directory")
    return candidates


def _load_directory(directory: Path, skipped: list[dict[str, str]],
                    read: dict[Path, TraceRecord | ShardlightError]) -> list[TraceRecord]:
    """The usable traces of ``directory``; ``read``: its files' records (or errors) read already."""
    candidates = _directory_files(directory)
    records = []
    for candidate in candidates:
        try:
            record = _take(read[candidate]) if candidate in read else read_trace(candidate)
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


def _take(result: TraceRecord | ShardlightError) -> TraceRecord:
    if isinstance(result, ShardlightError):
        raise ShardlightError(str(result)) from None
    return result


def load_traces(paths: Iterable[str | Path], workers: int | None = None,
                ) -> tuple[list[TraceRecord], list[dict[str, str]]]:
    """Read every trace named by ``paths`` (files, or directories scanned one level deep).

    Returns the records sorted by rank and the directory entries that were skipped, with why.
    A bad file named explicitly, or two files with the same rank, is an error.

    ``workers``: processes that decode the files (:func:`.reader.read_traces`): None decides
    from the files' sizes and the CPUs, 1 reads them here. The records, skips and errors are the
    same either way.
    """
    records, skipped, _ = _load_traces(paths, workers)
    return records, skipped


def _load_traces(paths: Iterable[str | Path], workers: int | None,
                 then: Callable[[TraceRecord], Any] | None = None,
                 ) -> tuple[list[TraceRecord], list[dict[str, str]], dict[str, Any]]:
    """``load_traces``, and ``then`` of the records a worker read (:func:`.reader.read_traces`), by
    their record's path."""
    skipped: list[dict[str, str]] = []
    paths = [Path(raw) for raw in paths]
    if not paths:
        raise ShardlightError("no trace path given")
    files: list[Path] = []
    for path in paths:
        try:
            files.extend(_directory_files(path) if path.is_dir() else [path] if path.is_file() else [])
        except (ShardlightError, OSError):
            pass  # worded below, in order
    read, thens = read_traces(files, workers, then)
    early = {str(path): value for path, value in thens.items()}
    records: list[TraceRecord] = []
    for path in paths:
        if path.is_dir():
            records.extend(_load_directory(path, skipped, read))
        elif path.exists():
            done = read.get(path)
            record = _take(done) if done is not None else read_trace(path)
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
    return [by_rank[rank] for rank in sorted(by_rank)], skipped, early


def _analyze(record: TraceRecord, include_last_step: bool, step_name_count: int | None,
             payload: bool = True) -> dict[str, Any]:
    mode, rules, events = prepare(record, include_last_step, step_name_count)
    result = measure_record(record, mode, rules, events)
    result["rank"] = record.rank
    if payload:
        result["payload"] = build_payload(record, rules, events, include_last_step)
    return result


def analyze_trace_file(path: str | Path, include_last_step: bool = False,
                       step_name_count: int | None = None, payload: bool = False) -> dict[str, Any]:
    """Metrics of one rank's trace file (the value of one ``ranks`` entry of ``analyze_traces``).

    ``payload=True`` adds ``result["payload"]``: what :func:`combine` needs of this rank to split
    its communication into wait and transfer across ranks (small, picklable, JSON-able).
    """
    return _analyze(read_trace(path), include_last_step, step_name_count, payload)


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


def combine(results: dict[str, dict[str, Any]], link_peak_gbps: float | None = None,
            skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The analysis of a run from per-rank ``analyze_trace_file(..., payload=True)`` results.

    ``results``: rank (a str) -> that rank's result. Returns what ``analyze_traces`` returns:
    ``ranks`` with ``split`` (and the split keys in every step), ``summary`` with ``clock``,
    ``collectives`` and ``bandwidth``; the payloads are dropped. Ranks of the world without a
    result are named in ``summary["collectives"]["missing_ranks"]``.
    """
    if not results:
        raise ShardlightError("no rank results to combine")
    by_rank: dict[int, dict[str, Any]] = {}
    for key, result in results.items():
        if not isinstance(result, dict) or not isinstance(result.get("payload"), dict):
            raise ShardlightError(f"rank {key}: result has no payload (analyse it with payload=True)")
        try:
            by_rank[int(key)] = result
        except (TypeError, ValueError):
            raise ShardlightError(f"rank {key!r}: results must be keyed by rank number") from None
    if link_peak_gbps is not None and not link_peak_gbps > 0:
        raise ShardlightError(f"link peak must be a positive GB/s figure, got {link_peak_gbps}")
    splits, parts = cross_rank(by_rank, link_peak_gbps)
    ranks = {}
    for rank in sorted(by_rank):
        result = {key: value for key, value in by_rank[rank].items() if key != "payload"}
        split = splits[rank]
        result["steps"] = {step: dict(metrics, **split[step]) for step, metrics in result["steps"].items()}
        result["split"] = split[ALL]
        if TIMELINE in split:
            result["timeline"] = split[TIMELINE]
        ranks[str(rank)] = result
    include_last = any(result["payload"].get("include_last_step") for result in by_rank.values())
    summary = summarize(ranks)
    summary["include_last_step"] = include_last
    summary["skipped"] = list(skipped or [])
    summary.update(parts)
    return {"ranks": ranks, "summary": summary}


def analyze_records(records: list[TraceRecord], include_last_step: bool = False,
                    skipped: list[dict[str, str]] | None = None,
                    link_peak_gbps: float | None = None, early: dict[str, Any] | None = None) -> dict[str, Any]:
    """``early``: record path -> :func:`_analysis_ahead` of it, used where it holds."""
    # HTA decides whether to drop the last step from the step names of all ranks together.
    step_name_count = collect_step_names(records)
    filters = TimeRules.filters_steps(step_name_count)
    results = {}
    for record in records:
        ahead = (early or {}).get(record.path)
        if ahead is not None and ahead[0] == filters:
            results[str(record.rank)] = ahead[1]
        else:
            results[str(record.rank)] = _analyze(record, include_last_step, step_name_count)
    return combine(results, link_peak_gbps, skipped)


def _analysis_ahead(record: TraceRecord, include_last_step: bool) -> tuple[bool, dict[str, Any]] | None:
    """A rank's analysis in the worker that read it, before the other ranks' step names are known: whether
    its own names make the last-step filter apply, and the result. It is the result of ``analyze_records``
    when the whole set's names decide the same (the filter uses only this rank's steps). None: the
    analysis fails (whatever the error), and ``analyze_records`` says why, or skips the record first (a
    duplicate rank)."""
    try:
        return TimeRules.filters_steps(len(record.step_names)), _analyze(record, include_last_step, None)
    except Exception:  # noqa: BLE001 - redone, where the error shows, by analyze_records if it needs the rank
        return None


def analyze_traces(paths: Iterable[str | Path] | str | Path, include_last_step: bool = False,
                   link_peak_gbps: float | None = None, workers: int | None = None) -> dict[str, Any]:
    """Analyse the traces of one run: ``{"ranks": {"<rank>": {...}}, "summary": {...}}``.

    ``paths`` are trace files or directories of them (one file per rank). This is the dict that
    ``shardlight analyze --json`` writes. ``link_peak_gbps``: a link's peak bandwidth, to report
    the bus bandwidth as a share of it. ``workers``: processes that decode the files (see
    :func:`load_traces`; None decides).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    # Each worker analyses the ranks it reads, so that work is shared as the reading is.
    ahead = partial(_analysis_ahead, include_last_step=include_last_step)
    records, skipped, early = _load_traces(paths, workers, ahead)
    return analyze_records(records, include_last_step, skipped, link_peak_gbps, early)
