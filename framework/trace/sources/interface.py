"""The interface of a communication backend's source, and what backends share.

Every trace is read into one backend-neutral TraceRecord (:mod:`shardlight.trace.reader`). A
source is what differs per backend after that: which records it analyses, which of their rows
are communication and which collective each one is. It hands the metrics an ``Events``.

* ``Source``: the interface (``name``, ``mode``, ``needs``, ``cpu_prefixes``, ``claims``, ``events``);
* ``DeviceSource``: a source whose events are the device rows (``args.stream != -1``), as in
  HTA's GPU analyses; a backend supplies only ``kernel_type`` and ``collective`` of a kernel name;
* ``op_collective``: the collective named by a ``c10d::<op>`` / ``FSDP::<op>`` call or a
  ``<backend>:<op>`` annotation, in the snake_case names the device backends report too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from shardlight.trace.events import COMMUNICATION_CODE, KIND_CODES, Events, TimeRules
from shardlight.trace.records import TraceRecord


class Source(ABC):
    """One communication backend. Instances are registered in :mod:`shardlight.trace.sources`."""

    name: str = ""  # the registry's name for it: "nccl", "gloo"
    mode: str = ""  # the "mode" of the results of the records it analyses: "gpu", "gloo"
    # What a file must hold for this source, as the error words it when no source claims a file.
    needs: str = ""
    # CPU rows the reader must keep for this source (TraceRecord.rows(prefix)), by name prefix.
    cpu_prefixes: tuple[str, ...] = ()
    # Of those, the rows whose args are kept too (CpuRow.args): few rows, so records stay compact.
    cpu_args_prefixes: tuple[str, ...] = ()

    @abstractmethod
    def claims(self, record: TraceRecord) -> bool:
        """Whether this source analyses ``record`` (the first registered source that claims it does)."""

    @abstractmethod
    def events(self, record: TraceRecord, rules: TimeRules) -> Events:
        """The events ``record`` is measured on: rounded by ``rules`` and passed by its last-step filter."""


class DeviceSource(Source):
    """Events from the device rows; subclasses classify kernel names (HTA's kinds, collectives)."""

    cpu_prefixes = ()  # launch times and step rows are in every record already

    @abstractmethod
    def kernel_type(self, name: str) -> str:
        """The kind of a device row: COMMUNICATION, COMPUTATION, MEMORY or OTHER (events.py)."""

    @abstractmethod
    def collective(self, name: str) -> str:
        """The collective of a communication kernel, or UNKNOWN_COLLECTIVE."""

    def kernel_info(self, collective: str, args: dict) -> dict | None:
        """The ``events.comm_info`` of a communication kernel from its kept args (records.COMM_ARG_KEYS)."""
        return None

    def claims(self, record: TraceRecord) -> bool:
        return bool(record.gpu_ts)

    def events(self, record: TraceRecord, rules: TimeRules) -> Events:
        names = record.gpu_name
        ts = np.array(record.gpu_ts)
        # A kernel is filtered by its launch call's time (NaN: none recorded; numpy turns get's None
        # into NaN), anything else on a stream by its own.
        launch = np.array(list(map(record.launch_ts.get, record.gpu_correlation)), dtype=float)
        if not all(record.gpu_is_kernel):
            launch = np.where(np.array(record.gpu_is_kernel, dtype=bool), launch, np.array(record.gpu_ts, dtype=float))
        start, end = rules.array_bounds(ts, np.array(record.gpu_dur))
        launch = rules.round_array(launch)
        # Classify each distinct name once: a trace repeats a few hundred names 10^5 times.
        codes = {name: KIND_CODES[self.kernel_type(name)] for name in set(names)}
        kind = np.array(list(map(codes.__getitem__, names)), dtype=np.int8)
        collective = np.full(len(names), None, dtype=object)
        info = np.full(len(names), None, dtype=object)
        described = record.gpu_args
        for index in np.flatnonzero(kind == COMMUNICATION_CODE).tolist():
            collective[index] = self.collective(names[index])
            if index in described:
                info[index] = self.kernel_info(collective[index], described[index])
                if info[index] and info[index].get("kind"):  # RCCL's Generic kernel: its args name it
                    collective[index] = info[index]["kind"]
        events = Events(start, end, kind, collective, launch, info)
        keep = rules.keep_mask(launch)
        return events if keep is None else events.take(keep)


# c10d / FSDP / backend-annotation op names (lower case, underscores stripped at both ends) -> collective
_OP_COLLECTIVES = {
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "allgather_base": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "post_backward_reduce": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allreduce_sparse": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "recv_any_source": "send_recv",
    "barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
}


def op_collective(name: str) -> str | None:
    """The collective named by ``gloo:<op>``, ``c10d::<op>`` or ``FSDP::<op>``; None if it names none."""
    _, sep, op = name.partition(":")
    op = op.lstrip(":") if sep else name
    op = op.strip("_").lower()
    return _OP_COLLECTIVES.get(op)
