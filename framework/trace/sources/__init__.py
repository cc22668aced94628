"""The registry of trace sources: one per communication backend, tried in order.

A source (interface in :mod:`.interface`) says which records it analyses and turns their rows into
the events the metrics measure. To add a backend, write ``sources/<backend>.py`` with a
``Source`` subclass (a ``DeviceSource`` if its communication runs as GPU kernels) and add an
instance to ``SOURCES``.

Order matters: the first source that claims a record analyses it. Device sources come first:
a GPU trace is claimed from its device rows, whatever CPU rows it also holds.
"""

from __future__ import annotations

from shardlight.errors import ShardlightError
from shardlight.trace.records import INPUT_PREFIX, TraceRecord
from shardlight.trace.sources.gloo import GlooSource
from shardlight.trace.sources.interface import DeviceSource, Source
from shardlight.trace.sources.nccl import NcclSource

SOURCES: tuple[Source, ...] = (
    NcclSource(),
    GlooSource(),
)

# Every CPU row prefix some source needs, and the input annotation every record measures: what
# the full reader keeps (see records.Collector); and the prefixes whose rows keep their args.
CPU_PREFIXES = tuple(dict.fromkeys([prefix for source in SOURCES for prefix in source.cpu_prefixes] + [INPUT_PREFIX]))
CPU_ARGS_PREFIXES = tuple(dict.fromkeys(prefix for source in SOURCES for prefix in source.cpu_args_prefixes))

__all__ = ["CPU_ARGS_PREFIXES", "CPU_PREFIXES", "SOURCES", "DeviceSource", "Source", "keep_own_rows", "source_for"]


def source_for(record: TraceRecord) -> Source:
    """The source that analyses ``record``; ShardlightError if none can."""
    for source in SOURCES:
        if source.claims(record):
            return source
    wanted = " and no ".join(source.needs for source in SOURCES)
    raise ShardlightError(f"{record.path}: no {wanted} to analyse")


def keep_own_rows(record: TraceRecord) -> None:
    """Drop the CPU rows that only other sources than ``record``'s ask for (a GPU trace keeps its input
    annotations alone): the record stays compact, and cheap to send between processes. A record no
    source claims is left as it is."""
    for source in SOURCES:
        if source.claims(record):
            for prefix in set(record.cpu_rows) - set(source.cpu_prefixes) - {INPUT_PREFIX}:
                del record.cpu_rows[prefix]
            return
