"""Trace analysis: communication vs computation from PyTorch profiler traces (``shardlight analyze``).

The layers, each importing only the ones above it:

* reading: ``reader`` (files, one or several in worker processes; errors) -> ``records`` (the
  backend-neutral TraceRecord, and the Collector that fills it from events);
* ``events``: the Events a source hands the metrics, and HTA's rounding and last-step filter;
* ``sources``: one module per communication backend (``nccl``, ``gloo``) behind one interface,
  and the registry that picks the source of a record;
* ``intervals`` and ``metrics``: HTA-compatible measures of one rank's events;
* ``sizes``, ``spans``, ``payload``, ``bandwidth``, ``wait_transfer``: the cross-rank wait/transfer split
  of communication (plain interval sets, nccl-tests' sizes and bus bandwidth, clock offsets);
* ``analysis``: the public API over files, directories and ranks (``combine`` joins per-rank
  results). The analyze command (``shardlight.cli.analyze_command``) shows them: table, JSON, plot.
"""

from shardlight.trace.analysis import analyze_trace_file, analyze_traces, combine
from shardlight.trace.live import analyze_profile

__all__ = ["analyze_profile", "analyze_trace_file", "analyze_traces", "combine"]
