"""The recipe's ``diagnosis:`` section: when a share of the step time counts as a bottleneck.

Every threshold is a percentage of the step's wall time (the mean over ranks), except ``min_headroom_pct``
(of the device's memory capacity) and ``straggler_pct`` (of the median rank's time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Config:
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
