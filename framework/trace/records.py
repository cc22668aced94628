"""The compact per-file records the analysis works on, and the rules that fill them from events.

Rows are kept the way HTA 0.5.0 keeps them: events without ``dur`` or ``cat`` and ``cat == "Trace"``
are dropped; ``args.stream`` that is missing or not an integer becomes -1, a missing
``args.correlation`` becomes -1. Timestamps are kept raw; :class:`shardlight.trace.events.TimeRules`
applies HTA's float rounding once the whole file is read.

A record holds what any source (:mod:`shardlight.trace.sources`) may need, whatever the backend:
device rows (``args.stream != -1``), launch times by correlation id, ``ProfilerStep`` rows, and
the CPU rows whose names start with a prefix some source asked for (``cpu_rows``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shardlight.errors import ShardlightError

# HTA classifies these as GPU rows for its last-step filter even though their stream is -1.
SYNC_EVENT_NAMES = frozenset({"Event Sync", "Context Sync"})
# torch's DataLoader wraps each ``__next__`` in this annotation: the input pipeline's time.
INPUT_PREFIX = "enumerate(DataLoader)"
# What NCCL communication kernels carry about their collective (torch's record_param_comms); only
# these args are kept, and only for rows that have them, so the records stay compact.
COMM_ARG_KEYS = ("Collective name", "Process Group Name", "Process Group Ranks", "Group size", "Seq",
                 "In msg nelems", "Out msg nelems", "dtype")


@dataclass
class CpuRow:
    """A CPU-side row a source or the step logic needs."""

    name: str
    cat: str
    ts: float
    dur: float
    tid: Any
    args: dict | None = None  # only for the prefixes a source asked args of (Collector's args_prefixes)


def comm_args(args: dict) -> dict | None:
    """The COMM_ARG_KEYS of a device row's args, or None if it has none of them."""
    if "Collective name" not in args and "In msg nelems" not in args:
        return None
    return {key: args[key] for key in COMM_ARG_KEYS if key in args}


@dataclass
class TraceRecord:
    path: str
    rank: int  # distributedInfo.rank; 0 when the file has none
    # HTA rounds every timestamp of a file (ceil start, floor end) when its ts column is float.
    float_timestamps: bool = False
    # Device rows (args.stream != -1: what HTA's GPU analyses look at) by column: the sources
    # turn them into arrays without a Python object per kernel. HTA's filter treats a row as a GPU kernel only with
    # stream >= 0 and correlation >= 0 (gpu_is_kernel); anything else on a stream is filtered
    # like a CPU row, by its own timestamp.
    gpu_name: list[str] = field(default_factory=list)
    gpu_ts: list[float] = field(default_factory=list)
    gpu_dur: list[float] = field(default_factory=list)
    gpu_correlation: list[int] = field(default_factory=list)
    gpu_is_kernel: list[bool] = field(default_factory=list)
    # correlation id -> earliest ts of a CPU-side row carrying it (the runtime launch call)
    launch_ts: dict[int, float] = field(default_factory=dict)
    # every non-GPU row whose name contains "ProfilerStep" (HTA's last-step filter input)
    step_rows: list[CpuRow] = field(default_factory=list)
    # names containing "ProfilerStep" on any kept row: HTA counts them to decide whether to filter
    step_names: set[str] = field(default_factory=set)
    # name prefix -> the CPU rows (stream -1, not ProfilerStep) starting with it, in trace order;
    # only the prefixes the Collector was given.
    cpu_rows: dict[str, list[CpuRow]] = field(default_factory=dict)
    # index into the gpu_* columns -> comm_args of that row (NCCL kernels that say their collective)
    gpu_args: dict[int, dict] = field(default_factory=dict)
    # distributedInfo: world_size (None when absent) and pg_config ([{pg_name, pg_size, ranks, ...}])
    world_size: int | None = None
    process_groups: list[dict] = field(default_factory=list)
    # The collectives this rank issued while the trace recorded, in issue order ({"op", "group", "desc",
    # "ranks"}), from torch's flight recorder: a gloo trace names no process group. None: not known.
    issued: list[dict] | None = None

    def read_distributed_info(self, info: Any) -> None:
        """rank, world_size and pg_config of a distributedInfo value."""
        if not isinstance(info, dict):
            return
        if "rank" in info:
            self.rank = as_int(info["rank"], default=-1)
            if self.rank < 0:
                raise ShardlightError(f"{self.path}: distributedInfo.rank is not a rank: {info['rank']!r}")
        world = as_int(info.get("world_size"), default=-1)
        self.world_size = world if world > 0 else None
        groups = info.get("pg_config")
        if isinstance(groups, list):
            self.process_groups = [group for group in groups if isinstance(group, dict)]

    def default_group(self) -> tuple[str | None, tuple[int, ...] | None, int | None]:
        """(name, ranks, size) of the default process group: pg_config's ``default_pg`` (or the one
        spanning the world), else the world of distributedInfo (name and ranks unknown)."""
        for group in self.process_groups:
            ranks = group.get("ranks")
            spans_world = self.world_size is not None and group.get("pg_size") == self.world_size
            if group.get("pg_desc") == "default_pg" or (spans_world and len(self.process_groups) == 1):
                size = as_int(group.get("pg_size"), default=-1)
                ranks = tuple(as_int(r) for r in ranks) if isinstance(ranks, list) and ranks else None
                return str(group.get("pg_name", "0")), ranks, size if size > 0 else self.world_size
        return None, None, self.world_size

    def rows(self, prefix: str) -> list[CpuRow]:
        """The CPU rows whose name starts with ``prefix`` (empty if it was not collected)."""
        return self.cpu_rows.get(prefix, [])

    def add_gpu_row(self, name: str, ts: float, dur: float, correlation: int, is_kernel: bool) -> None:
        self.gpu_name.append(name)
        self.gpu_ts.append(ts)
        self.gpu_dur.append(dur)
        self.gpu_correlation.append(correlation)
        self.gpu_is_kernel.append(is_kernel)


def as_int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return default


class Args(msgspec.Struct, gc=False):
    """The keys of an event's ``args`` the Collector reads, as the reader decodes them (:class:`Event`): an
    absent stream or correlation is -1 (as ``args.get(key, -1)``), another absent key ``UNSET``. Rows that
    keep their whole args (``Collector``'s ``args_prefixes``) are decoded as dicts instead."""

    stream: Any = -1
    correlation: Any = -1
    collective: Any = msgspec.field(default=msgspec.UNSET, name="Collective name")
    group_name: Any = msgspec.field(default=msgspec.UNSET, name="Process Group Name")
    group_ranks: Any = msgspec.field(default=msgspec.UNSET, name="Process Group Ranks")
    group_size: Any = msgspec.field(default=msgspec.UNSET, name="Group size")
    seq: Any = msgspec.field(default=msgspec.UNSET, name="Seq")
    in_nelems: Any = msgspec.field(default=msgspec.UNSET, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=msgspec.UNSET, name="Out msg nelems")
    dtype: Any = msgspec.UNSET

    def comm(self) -> dict | None:
        """:func:`comm_args` of the dict these args came from."""
        if self.collective is msgspec.UNSET and self.in_nelems is msgspec.UNSET:
            return None
        values = (self.collective, self.group_name, self.group_ranks, self.group_size, self.seq, self.in_nelems,
                  self.out_nelems, self.dtype)
        return {key: value for key, value in zip(COMM_ARG_KEYS, values) if value is not msgspec.UNSET}


class Event(msgspec.Struct, gc=False):
    """The fields of a trace event the Collector reads (None: absent). ``args``: an :class:`Args`, the
    decoded ``args`` value (a dict, or anything), or None."""

    name: Any = None
    cat: Any = None
    ts: Any = None
    dur: Any = None
    tid: Any = None
    args: Any = None


def event_of(value: Any) -> Event | None:
    """The Event of a decoded JSON value (None: not an object, which the Collector ignores)."""
    if not isinstance(value, dict):
        return None
    get = value.get
    return Event(get("name"), get("cat"), get("ts"), get("dur"), get("tid"), get("args"))


def needs_args_dict(events: list[Event], args_prefixes: tuple[str, ...]) -> bool:
    """Whether a row of ``events`` may keep its whole args (its name starts with one of ``args_prefixes``)."""
    if not args_prefixes:
        return False
    return any((name if isinstance(name, str) else str(name)).startswith(args_prefixes)
               for name in (event.name for event in events))


class Collector:
    """Turns decoded events into the compact rows of a TraceRecord.

    ``cpu_prefixes``: the CPU rows to keep, by name prefix; a row goes to every prefix it starts with.
    ``args_prefixes``: of those, the rows that keep their args too (gloo work: its input shapes).
    """

    def __init__(self, record: TraceRecord, cpu_prefixes: tuple[str, ...] = (), args_prefixes: tuple[str, ...] = ()):
        self.record = record
        self._prefixes = tuple(dict.fromkeys(cpu_prefixes))
        self._args_prefixes = tuple(args_prefixes)
        for prefix in self._prefixes:
            record.cpu_rows.setdefault(prefix, [])
        self._lists_of: dict[str, tuple[tuple[list, ...], bool]] = {}  # a name -> _lists(name)

    def add(self, event: Event) -> None:
        """Apply one event. Its ``args`` are an :class:`Args` only where no row needs its whole args dict."""
        record = self.record
        ts = event.ts
        if ts is None or isinstance(ts, float):
            record.float_timestamps = True
        dur = event.dur
        cat = event.cat
        if dur is None or cat is None or cat == "Trace" or ts is None:
            return
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            return
        name = event.name
        if not isinstance(name, str):
            name = str(name)
        args = event.args
        if isinstance(args, Args):
            stream, correlation = args.stream, args.correlation
            if type(stream) is not int:
                stream = as_int(stream)
            if type(correlation) is not int:
                correlation = as_int(correlation)
        elif isinstance(args, dict):
            stream = as_int(args.get("stream", -1))
            correlation = as_int(args.get("correlation", -1))
        else:
            stream = correlation = -1
        is_kernel = (stream >= 0 and correlation >= 0) or name in SYNC_EVENT_NAMES
        if "ProfilerStep" in name:
            record.step_names.add(name)
        if stream != -1:
            if name.startswith("nccl"):
                kept = args.comm() if isinstance(args, Args) else comm_args(args) if isinstance(args, dict) else None
                if kept is not None:
                    record.gpu_args[len(record.gpu_name)] = kept
            record.add_gpu_row(name, ts, dur, correlation, is_kernel)
        if is_kernel:
            return
        if correlation >= 0:
            known = record.launch_ts.get(correlation)
            if known is None or ts < known:
                record.launch_ts[correlation] = ts
        if stream != -1:
            return
        if "ProfilerStep" in name:
            record.step_rows.append(CpuRow(name, cat, ts, dur, event.tid))
        elif self._prefixes and name.startswith(self._prefixes):  # one C call rejects most rows
            lists, keeps_args = self._lists(name)
            row = CpuRow(name, cat, ts, dur, event.tid, args if keeps_args and isinstance(args, dict) else None)
            for rows in lists:
                rows.append(row)

    def add_plain_cpu_row(self, name: str, cat: str, ts: float, dur: float, tid: Any) -> None:
        """``add`` of an event with float ``ts`` and ``dur``, a ``cat`` other than "Trace" and no args the
        Collector reads (no stream, no correlation), whose name holds no "ProfilerStep", is no sync event
        and starts with no ``args_prefixes``: a CPU row, kept under the prefixes its name starts with. The
        live reader calls this for most of a window's operators, without building their events."""
        lists = self._lists(name)[0]
        if lists:
            row = CpuRow(name, cat, ts, dur, tid)
            for rows in lists:
                rows.append(row)

    def _lists(self, name: str) -> tuple[tuple[list, ...], bool]:
        """The cpu_rows lists a row named ``name`` goes to, and whether it keeps its args."""
        kept = self._lists_of.get(name)
        if kept is None:
            lists = tuple(self.record.cpu_rows[prefix] for prefix in self._prefixes if name.startswith(prefix))
            kept = self._lists_of[name] = lists, bool(self._args_prefixes) and name.startswith(self._args_prefixes)
        return kept


# Beside a trace file ``rankR.pt.trace.json``: ``rankR.collectives.json``, the record's ``issued``.
_TRACE_SUFFIX, ISSUED_SUFFIX = ".pt.trace.json", ".collectives.json"


def issued_path(trace: str | Path) -> Path:
    """Where the collectives a trace's rank issued are kept, beside the trace (``.gz`` or not)."""
    trace = Path(trace)
    name = trace.name.removesuffix(".gz")
    stem = name.removesuffix(_TRACE_SUFFIX) if name.endswith(_TRACE_SUFFIX) else name.rsplit(".", 1)[0]
    return trace.with_name(stem + ISSUED_SUFFIX)


def write_issued(trace: str | Path, issued: list[dict] | None) -> None:
    """Keep ``issued`` (``TraceRecord.issued``) beside the trace file ``trace``; nothing for None."""
    if issued is not None:
        issued_path(trace).write_text(json.dumps(issued))


def read_issued(trace: str | Path) -> list[dict] | None:
    """The ``issued`` kept beside ``trace``; None when there is none or it is unreadable (the trace stands
    without it: its collectives are then in the default group)."""
    try:
        issued = json.loads(issued_path(trace).read_text())
    except (OSError, ValueError):
        return None
    return issued if isinstance(issued, list) and all(isinstance(i, dict) for i in issued) else None
