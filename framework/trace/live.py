"""A rank's TraceRecord straight from a finished ``torch.profiler`` window, without a trace file.

``prof.export_chrome_trace(path)`` writes every activity of the window as JSON and ``read_trace``
parses it back; the live comm callback needs neither to analyse the window. Here the same
activities are read from the profiler's memory (``kineto_results.trace_activities()``: the
objects Kineto's chrome-trace writer serialises) and handed to the same :class:`Collector` as the
reader, as the events the file would decode to, so :func:`analyze_profile` is
``analyze_trace_file(path)`` of the file the profiler would export, through the same ``_analyze``.

What the file has that memory does not, and how it is made up here:

* **the clock base**: a file's ``ts`` is ``(start_ns - baseTimeNanoseconds) / 1000``, Kineto's
  base being the epoch floored to 7889238-second intervals (``KINETO_BASE_PERIOD_S``); the same
  base is computed from the window's start. Only a window that starts in another interval than
  Kineto's base was taken in (once every three months, for a process that started before the
  boundary) gets a base one interval off: every time shifts by a whole number of microseconds, so
  the rounding and every duration, hence every metric, are unchanged; only absolute times differ.
* **``distributedInfo``** (rank, world size, process groups): the profiler adds it at the window's
  start from ``torch.distributed``; here it is asked of ``torch.distributed`` when the record is
  built, or passed in (:func:`distributed_info`, taken when the window closes, say).
* **``args``**: the file's ``args`` are an activity's ``External id`` (its linked or own
  correlation id) and its ``metadata_json()``, and for a device kernel linked to
  ``record_param_comms`` that op's metadata too; they are rebuilt so, but only for the rows whose
  args the Collector reads (device rows, launch calls, the rows a source keeps args of). Rows the
  Collector would drop without effect (no kept prefix, no step name, no stream or correlation)
  are not built at all.

Checked against the file path on real CPU/gloo windows (``tests/test_trace_live.py``); the GPU
rows follow the same rules (the exporter's), unchecked without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardlight.errors import ShardlightError
from shardlight.trace.analysis import _analyze
from shardlight.trace.records import SYNC_EVENT_NAMES, Collector, Event, TraceRecord
from shardlight.trace.sources import CPU_ARGS_PREFIXES, CPU_PREFIXES, keep_own_rows

__all__ = ["KINETO_BASE_PERIOD_S", "analyze_profile", "distributed_info", "kineto_base_ns", "profile_record"]

# libkineto's ChromeTraceBaseTime: the epoch floored to this many seconds (about three months).
KINETO_BASE_PERIOD_S = 7889238
_PARAM_COMMS = "record_param_comms"
# The args the Collector reads of a row that is neither kept by prefix nor a step marker.
_STREAM, _CORRELATION = '"stream"', '"correlation"'
_ASK = object()
# Activity types whose own correlation id the exporter does not write as "External id".
_NO_EXTERNAL_ID = frozenset({"gpu_memcpy", "gpu_memset", "kernel", "cuda_runtime", "cuda_driver",
                             "privateuse1_runtime", "privateuse1_driver"})


def kineto_base_ns(start_ns: int) -> int:
    """``baseTimeNanoseconds`` of a trace that starts at ``start_ns`` (epoch nanoseconds)."""
    period = KINETO_BASE_PERIOD_S * 1_000_000_000
    return (int(start_ns) // period) * period


def distributed_info() -> dict | None:
    """The ``distributedInfo`` torch.profiler writes into a trace, as the file holds it (JSON values);
    None without an initialised process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    info = {"backend": dist.get_backend(), "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "pg_count": dist.get_pg_count(), "pg_config": dist.distributed_c10d._get_all_pg_configs()}
    return json.loads(json.dumps(info, default=_plain))


def _plain(value: Any) -> Any:
    try:  # numpy scalars and arrays, as torch's _NumpyEncoder writes them
        return value.tolist()
    except AttributeError:
        return str(value)


def has_live_events(prof: Any) -> bool:
    """Whether this torch keeps a stopped window's trace activities in memory (``trace_activities()``: torch
    2.13 does, 2.11 does not; there the window must be exported and read back)."""
    try:
        _results(prof)
    except ShardlightError:
        return False
    return True


def _results(prof: Any) -> Any:
    """The ``_ProfilerResult`` of a ``torch.profiler.profile``, a ``torch.autograd.profiler.profile``, or itself."""
    results = prof
    if hasattr(results, "profiler"):  # torch.profiler.profile
        results = results.profiler
    if hasattr(results, "kineto_results"):  # torch.autograd.profiler.profile
        results = results.kineto_results
    if results is None or not hasattr(results, "trace_activities") or not hasattr(results, "trace_start_ns"):
        raise ShardlightError("the profiler holds no finished Kineto window (stop it first; "
                              "or this torch has no trace_activities())")
    return results


def _tid(tid: int) -> int:
    return 0 if tid == -(2**63) else abs(tid)  # as the exporter writes thread ids


def _args(act: Any, cat: str, md: str, linked: Any = None) -> dict:
    """The file's ``args`` of an activity: its ``External id``, its metadata, a linked comms op's metadata."""
    args: dict = {}
    external = act.linked_correlation_id()
    if not external and cat not in _NO_EXTERNAL_ID:
        external = act.correlation_id()
    if external:
        args["External id"] = external
    if linked is not None:
        extra = linked.metadata_json()
        if extra:
            md = f"{md}, {extra}" if md else extra
    if md:
        args.update(json.loads("{" + md + "}"))
    return args


def profile_record(prof: Any, path: str | Path = "<memory>", dist_info: Any = _ASK,
                   issued: list[dict] | None = None) -> TraceRecord:
    """The TraceRecord ``read_trace`` would make of the trace ``prof`` would export (see the module docstring).

    ``prof``: a stopped profiler (or its ``kineto_results``); ``path``: the record's name (what results call
    ``file``); ``dist_info``: the window's ``distributedInfo`` (default: :func:`distributed_info` now);
    ``issued``: the collectives the window issued (``TraceRecord.issued``, kept beside the file).
    """
    results = _results(prof)
    record = TraceRecord(path=str(path), rank=0, issued=issued)
    record.read_distributed_info(distributed_info() if dist_info is _ASK else dist_info)
    # Every file has float timestamps (Kineto writes "<us>.<ns>", its metadata rows too): HTA rounds them.
    record.float_timestamps = True
    collector = Collector(record, CPU_PREFIXES, CPU_ARGS_PREFIXES)
    add = collector.add
    base = kineto_base_ns(results.trace_start_ns())
    kept, with_args = CPU_PREFIXES, CPU_ARGS_PREFIXES + ("nccl",)
    for act in results.trace_activities():
        name = act.name()
        md = act.metadata_json()
        marked = _STREAM in md or _CORRELATION in md
        if not (marked or name.startswith(kept) or "ProfilerStep" in name):
            continue  # the Collector keeps nothing of it
        cat = act.type()
        ts, dur = max(act.timestamp() - base, 0) / 1000, max(act.duration(), 0) / 1000
        if not marked and cat not in ("kernel", "Trace") and not name.startswith(with_args) \
                and "ProfilerStep" not in name and name not in SYNC_EVENT_NAMES:
            # Most of a CPU window's rows (its operators): a CPU row and nothing else, without an event dict.
            collector.add_plain_cpu_row(name, cat, ts, dur, _tid(act.resource_id()))
            continue
        linked = None
        if cat == "kernel":
            linked = act.linked_activity()
            if linked is not None and linked.name() != _PARAM_COMMS:
                linked = None
        args = _args(act, cat, md, linked) if marked or linked is not None or name.startswith(with_args) else {}
        add(Event(name, cat, ts, dur, _tid(act.resource_id()), args))
    keep_own_rows(record)  # as read_trace does
    return record


def analyze_profile(prof: Any, include_last_step: bool = False, step_name_count: int | None = None,
                    payload: bool = False, path: str | Path = "<memory>", dist_info: Any = _ASK,
                    issued: list[dict] | None = None) -> dict[str, Any]:
    """``analyze_trace_file`` of the trace ``prof`` would export, from memory: the same dict (``file`` is
    ``path``), by the same analysis. Arguments as ``analyze_trace_file`` and :func:`profile_record`."""
    return _analyze(profile_record(prof, path, dist_info, issued), include_last_step, step_name_count, payload)
