"""Trace analysis: communication vs computation from PyTorch profiler traces (``shardlight analyze``)."""

from shardlight.trace.analysis import analyze_trace_file, analyze_traces

__all__ = ["analyze_trace_file", "analyze_traces"]
