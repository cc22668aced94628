"""What every source hands the metrics: a rank's analysed events, and the time rules that pick them.

* ``Events``: the analysed events of one rank, by column, each with a kind (communication,
  computation, memory, other), a collective name for communication, a launch time, and for
  communication what the source knows of the collective (``info``: see ``CommInfo``);
* ``TimeRules``: HTA 0.5.0's rules every source applies to its rows: the float-timestamp rounding
  (start ``ceil``, end ``floor(ts + dur)``, for every row of a file with any float ``ts``) and the
  last-step filter. That filter applies when the ranks analysed together have at least two
  distinct ``ProfilerStep`` names: an event is kept only if its launch is before the last
  ``ProfilerStep`` start (or, with ``include_last_step``, not after the last ``ProfilerStep`` end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardlight.trace.records import TraceRecord

COMMUNICATION = "communication"
COMPUTATION = "computation"
MEMORY = "memory"
OTHER = "other"
UNKNOWN_COLLECTIVE = "unknown"

# int8 codes of the kinds in Events.kind: comparing small ints is what makes the metrics vectorize.
KIND_CODES = {COMPUTATION: 0, COMMUNICATION: 1, MEMORY: 2, OTHER: 3}
COMPUTATION_CODE = KIND_CODES[COMPUTATION]
COMMUNICATION_CODE = KIND_CODES[COMMUNICATION]


@dataclass
class Events:
    """The analysed events of a rank, by column; a missing launch time is NaN.

    Columns rather than a tuple per event: a large trace has 10^5 kernels, and every metric is
    a few array operations over them.
    """

    ts: np.ndarray
    end: np.ndarray
    kind: np.ndarray  # KIND_CODES values
    collective: np.ndarray  # objects: the collective of communication events, else None
    launch: np.ndarray
    info: np.ndarray | None = None  # objects: a CommInfo dict of communication events, else None

    def __post_init__(self) -> None:
        if self.info is None:
            self.info = np.full(self.ts.size, None, dtype=object)

    def __len__(self) -> int:
        return self.ts.size

    def take(self, which: np.ndarray) -> Events:
        return Events(self.ts[which], self.end[which], self.kind[which], self.collective[which], self.launch[which],
                      self.info[which])

    @classmethod
    def from_tuples(cls, events: list[tuple]) -> Events:
        """From ``(ts, end, kind, collective or None, launch or None[, info or None])`` tuples."""
        if not events:
            empty = np.array([], dtype=np.int64)
            return cls(empty, empty, empty.astype(np.int8), np.array([], dtype=object), empty.astype(float))
        events = [event if len(event) == 6 else (*event, None) for event in events]
        ts, end, kind, collective, launch, info = zip(*events)
        info_column = np.empty(len(info), dtype=object)
        info_column[:] = info  # element-wise: np.array would try to make the dicts a 2-D array
        return cls(np.array(ts), np.array(end), np.array([KIND_CODES[k] for k in kind], dtype=np.int8),
                   np.array(collective, dtype=object),
                   np.array([math.nan if x is None else x for x in launch], dtype=float), info_column)


def comm_info(kind: str | None = None, message_bytes: float = math.nan, group: str | None = None,
              ranks: tuple[int, ...] | None = None, group_size: int | None = None,
              seq: int | None = None) -> dict[str, Any]:
    """What a source knows of one communication event (every field may be unknown).

    ``kind``: the collective when the event's own ``collective`` could not say (RCCL's Generic
    kernels); ``message_bytes``: nccl-tests' size (:mod:`shardlight.trace.sizes`), NaN unknown;
    ``group``/``ranks``/``group_size``: its process group (None: the record's default group);
    ``seq``: the group's sequence number of the collective, when the trace has one.
    """
    return {"kind": kind, "bytes": message_bytes, "group": group, "ranks": ranks, "group_size": group_size,
            "seq": seq}


@dataclass(frozen=True)
class TimeRules:
    """How one record's raw times become event times, and which launches the last-step filter keeps."""

    rounded: bool  # the file has a float timestamp: HTA rounds every row of it
    include_last_step: bool
    cutoff: Any = None  # launch-time limit of the last-step filter; None keeps everything

    @staticmethod
    def filters_steps(step_name_count: int) -> bool:
        """Whether the last-step filter applies, from the distinct step names of the ranks analysed
        together: all that ``of`` uses of that count (HTA decides on it, not on the names)."""
        return step_name_count >= 2

    @classmethod
    def of(cls, record: TraceRecord, include_last_step: bool = False,
           step_name_count: int | None = None) -> TimeRules:
        """The rules for ``record``; ``step_name_count`` as in :func:`metrics.analyze_record`."""
        rules = cls(record.float_timestamps, include_last_step)
        count = len(record.step_names) if step_name_count is None else step_name_count
        if not cls.filters_steps(count) or not record.step_rows:
            return rules
        ranges = [rules.bounds(row.ts, row.dur) for row in record.step_rows]
        if include_last_step:
            cutoff = max(end for _, end in ranges)
        else:
            cutoff = max(start for start, _ in ranges)
        return cls(rules.rounded, include_last_step, cutoff)

    def bounds(self, ts: Any, dur: Any) -> tuple[Any, Any]:
        """``(start, end)`` of one row."""
        if self.rounded:
            return math.ceil(ts), math.floor(ts + dur)
        return ts, ts + dur

    def round_ts(self, ts: Any) -> Any:
        """A launch time, rounded like the starts."""
        return math.ceil(ts) if self.rounded else ts

    def array_bounds(self, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``bounds`` over arrays; rounded bounds are int64, so they sum exactly as Python ints do."""
        end = ts + dur
        if self.rounded:
            return np.ceil(ts).astype(np.int64), np.floor(end).astype(np.int64)
        return ts, end

    def round_array(self, ts: np.ndarray) -> np.ndarray:
        """``round_ts`` over a float array (NaN stays NaN)."""
        return np.ceil(ts) if self.rounded else ts

    def keeps(self, launch: Any) -> bool:
        """Whether the last-step filter keeps an event launched at ``launch`` (None: never launched)."""
        if self.cutoff is None:
            return True
        if launch is None:
            return False
        return launch <= self.cutoff if self.include_last_step else launch < self.cutoff

    def keep_mask(self, launch: np.ndarray) -> np.ndarray | None:
        """``keeps`` over an array of launch times (NaN compares false, so it is dropped); None: keep all."""
        if self.cutoff is None:
            return None
        return launch <= self.cutoff if self.include_last_step else launch < self.cutoff
