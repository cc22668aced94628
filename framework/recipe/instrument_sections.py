"""The recipe sections of the instruments: ``callbacks.comm``, ``callbacks.memory``, ``callbacks.throughput`` (the
measuring callbacks, ``shardlight.callbacks``) and ``diagnosis`` (its thresholds, ``shardlight.diagnosis``).

Plain dataclasses, so the schema and everything that loads a recipe import no instrument: each field's help
text and rules (``allowed``, ``positive``, ``non_negative``, ``fraction``, ``min`` / ``max``) in its metadata,
checked once by the recipe validator. ``every_n_steps: null`` means the trainer's ``log_every_n_steps``.

Adding a measuring callback: its module in ``callbacks/`` (a ``build(config, ctx, shared)``) and its section
here, one field of ``CallbacksConfig`` named as the module: the registry is that dataclass
(``shardlight.callbacks.registry``).

Diagnosis thresholds: every one is a percentage of the step's wall time (the mean over ranks), except
``min_headroom_pct`` (of the device's memory capacity) and ``straggler_pct`` (of the median rank's time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class CommConfig:
    """The recipe's ``callbacks.comm`` section."""

    enabled: bool = field(default=True, metadata={"help": "Profile collectives vs compute in short windows."})
    every_n_steps: int = field(
        default=50, metadata={"positive": True,
                              "help": "Steps between profiling windows (plus one early); the shortest interval."}
    )
    overhead_budget: Optional[float] = field(
        default=0.01,
        metadata={"fraction": True,
                  "help": "Largest share of training time the windows may cost: each window's measured cost "
                          "spaces the next one (null or 0: every every_n_steps, whatever they cost)."},
    )
    first_step: Optional[int] = field(
        default=5, metadata={"non_negative": True, "help": "Step of the early profiling window (null or 0: none)."}
    )
    wait: int = field(
        default=0, metadata={"non_negative": True, "help": "Profiler schedule: steps skipped at a window's start."}
    )
    warmup: int = field(
        default=1, metadata={"non_negative": True, "help": "Profiler schedule: warm-up steps (traced, not recorded)."}
    )
    active: int = field(
        default=4,
        metadata={"positive": True,
                  "help": "Profiler schedule: recorded steps; the last is dropped in analysis, as HTA drops it, "
                          "so the profiler stops as it begins (not recorded in full). Each analysed step is one "
                          "sample of the verdict's uncertainty."},
    )
    judged_windows: int = field(
        default=4,
        metadata={"positive": True,
                  "help": "Windows after warm-up that a run of 30 steps or more always gets, spread evenly over it, "
                          "whatever the budget (the budget's own count): the verdict is judged on them and how "
                          "they differ is its uncertainty."},
    )
    per_rank: bool = field(default=True, metadata={"help": "Also log comm/rank<R>/... keys for every rank."})
    keep_windows: Optional[int] = field(
        default=10,
        metadata={"non_negative": True,
                  "help": "Keep the traces of this many latest windows in run_dir/traces (null or 0: all)."},
    )
    record_shapes: bool = field(
        default=False,
        metadata={"help": "Record op input shapes: the bytes of each gloo collective (bus bandwidth on CPU), at "
                          "several times a window's cost (0.5-0.8 s against tens to hundreds of ms on the default "
                          "recipe's 2 CPU ranks); NCCL kernels carry their sizes without it."},
    )
    print_windows: bool = field(
        default=True, metadata={"help": "Print one line per window (its verdict) on rank 0's console."}
    )
    save_traces: bool = field(
        default=True,
        metadata={"help": "Write each window's trace to run_dir/traces/step_<N>/ (in the background, after its "
                          "analysis) for `shardlight analyze` / `diagnose`; false: metrics and verdict only."},
    )


@dataclass
class MemoryConfig:
    """The recipe's ``callbacks.memory`` section."""

    enabled: bool = field(default=True, metadata={"help": "Log memory headroom and shard bytes per rank."})
    every_n_steps: Optional[int] = field(
        default=None,
        metadata={"positive": True, "help": "Steps between memory logs (null: trainer.log_every_n_steps)."},
    )
    per_rank: bool = field(default=True, metadata={"help": "Also log memory/rank<R>/... keys for every rank."})


@dataclass
class ThroughputConfig:
    """The recipe's ``callbacks.throughput`` section."""

    enabled: bool = field(default=True, metadata={"help": "Log tokens/s per device, MFU, scaling efficiency."})
    peak_tflops: Optional[float] = field(
        default=None,
        metadata={"positive": True, "help": "Peak TFLOP/s per device for MFU (null: from the built-in table)."},
    )
    peak_tflops_table: Dict[str, float] = field(
        default_factory=dict,
        metadata={"positive": True, "help": "Device-name substring -> peak TFLOP/s; overrides/extends the built-in "
                                            "A100/H100/H200 table."},
    )
    baseline_file: Optional[str] = field(
        default=None,
        metadata={"help": "JSON with tokens_per_sec_per_device (shardlight profile) for scaling efficiency."},
    )
    every_n_steps: Optional[int] = field(
        default=None,
        metadata={"positive": True, "help": "Steps between throughput logs (null: trainer.log_every_n_steps)."},
    )
    measure_flops: bool = field(
        default=True, metadata={"help": "Count FLOPs/token with torch.utils.flop_counter (false: 6N + attention)."}
    )


@dataclass
class HangConfig:
    """The recipe's ``callbacks.hang`` section."""

    enabled: bool = field(
        default=True,
        metadata={"help": "When no step finishes for after_s, every rank dumps its flight recorder and stack, rank "
                          "0 names the rank and collective the run is stuck in, and the run exits 1."},
    )
    after_s: Optional[float] = field(
        default=None,
        metadata={"positive": True,
                  "help": "Seconds without a finished training step or validation batch (null: 10 x the median "
                          "step, at least min_after_s; 5 x min_after_s until 3 steps have finished)."},
    )
    min_after_s: float = field(
        default=60.0, metadata={"positive": True, "help": "The least after_s is when it follows the step time."}
    )
    grace_s: float = field(
        default=20.0,
        metadata={"positive": True,
                  "help": "Seconds rank 0 waits for the other ranks' dumps; a rank with none by then is named "
                          "as stopped."},
    )


@dataclass
class DiagnosisConfig:
    """The recipe's ``diagnosis`` section."""

    enabled: bool = field(
        default=True, metadata={"help": "Classify each profiled window (communication, straggler, input, ...)."}
    )
    exposed_transfer_pct: float = field(
        default=15.0,
        metadata={"min": 0, "max": 100,
                  "help": "Communication-bound when exposed collective transfer exceeds this % of the step."},
    )
    exposed_wait_pct: float = field(
        default=10.0,
        metadata={"min": 0, "max": 100,
                  "help": "Straggler-bound when the ranks' exposed wait for one rank (their mean wait less what "
                          "that rank waits itself) exceeds this % of the step."},
    )
    input_wait_pct: float = field(
        default=10.0,
        metadata={"min": 0, "max": 100,
                  "help": "Input-bound when waiting on the data loader exceeds this % of the step."},
    )
    host_idle_pct: float = field(
        default=20.0,
        metadata={"min": 0, "max": 100,
                  "help": "Host-bound when the device idles (no communication, no input wait) over this % of step."},
    )
    min_headroom_pct: float = field(
        default=5.0,
        metadata={"min": 0, "max": 100,
                  "help": "Memory-bound when the fullest rank's free memory is below this % of its capacity."},
    )
    straggler_pct: float = field(
        default=10.0,
        metadata={"non_negative": True,
                  "help": "A rank's compute or input counts as slow when it is this % above the other ranks' median."},
    )
    link_peak_gbps: Optional[float] = field(
        default=None,
        metadata={"positive": True,
                  "help": "Link bus bandwidth peak (GB/s) to compare measured collectives with (null: no comparison)."},
    )
    warmup_steps: int = field(
        default=10,
        metadata={"non_negative": True,
                  "help": "Windows starting within this many steps of the run's start are warm-up: the run's "
                          "verdict is judged on the windows after it (on warm-up alone only when there are none, "
                          "and then says it is provisional)."},
    )
    noise_pct: float = field(
        default=5.0,
        metadata={"min": 0, "max": 100,
                  "help": "The least uncertainty (percentage points of the step) a class's share is taken to have, "
                          "however alike the run's steps: what back-to-back runs of one recipe differ by. Classes "
                          "closer than that to their thresholds, or to each other, are named together ('X or Y') "
                          "instead of a coin flip."},
    )


@dataclass
class CallbacksConfig:
    """The recipe's ``callbacks`` section: one sub-section per measuring callback, built and run in this order."""

    comm: CommConfig = field(default_factory=CommConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    hang: HangConfig = field(default_factory=HangConfig)
