"""When the comm callback's profiling windows start, so that what they cost stays within a budget.

A window costs training time: the profiler records every op of its steps, stopping it post-processes
the events on the training thread, and its analysis and trace export compete with training for the CPU
(a 2-core host with 2 ranks has none to spare). On a model whose steps take 80 ms that is a few hundred
milliseconds per window: a fixed ``every_n_steps: 50`` would cost 5-10% of the run. So the callback
measures each window's cost on every rank, the ranks agree on the largest (one all-reduce per window),
and the next window waits until that cost is at most ``overhead_budget`` of the training time between
window starts:

* cost of a window = the wall time of its steps (from its first step's start to the gather of its results,
  inclusive) above ``steps x typical step``, typical = the median of the ``AGREE_AFTER`` normal steps
  before the window and the ``AGREE_AFTER`` after its gather, when the ranks agree on it (both sides, so
  that a drift of the step time over the run cancels; an early window has only the run's first, slow, steps
  before it and uses the steps after; without a budget, the recent steps before the window). A checkpoint
  save or validation pass before its first step, or a validation pass before its gather, is the trainer's
  work, not the window's: it is left out;
* next start = the first multiple of ``every_n_steps`` after the window that is also at least
  ``cost / (overhead_budget x typical step)`` steps after its start; ``overhead_budget`` null or 0
  keeps the fixed schedule (``shardlight profile`` does: it calibrates on every window).

Windows count from the run's own first step (a resumed run's too: ``plan_run``). ``first_step``'s early
window always runs (it gives the first verdict); its measured cost spaces the next one. A run of at least
``JUDGED_MIN_STEPS`` steps also always gets ``judged_windows`` windows after warm-up, whatever the budget: the
end-of-run verdict is judged on them (``shardlight.diagnosis.across_windows``), never on the early one alone,
and how they differ is its uncertainty. Consecutive steps move together (on the 2-core test host a window's
3 steps vary by about 3.6 points of the step, its mean by 3 from window to window, where independent steps
would give 2.1), so the windows are spread over the run: each has a due step, evenly spaced up to the run's
last chance (the latest start whose results come before the end), and when fewer windows after warm-up have
started than are due, one starts at once (never recording across a validation pass). The budget's own windows
count, so a run long enough for the budget to give them pays nothing extra; a short one pays for its judged
windows (the default recipe's 200 steps: 2.8-4.9% of the run in all, against 1% for its budget). Every rank
takes the same decisions from the same agreed
numbers (:meth:`WindowSchedule.agree`), so the collectives of the windows stay matched.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

# Typical step: the median of this many latest steps outside windows.
_TYPICAL_STEPS = 32
# A window's cost is agreed this many steps after its gather (typical steps after it known too).
AGREE_AFTER = 8
# A run at least this long always gets its windows after warm-up, whatever the budget.
JUDGED_MIN_STEPS = 30


class WindowSchedule:
    """Window starts, and the wall time of each optimizer step (the callback calls :meth:`step_done`).

    Arguments:
        every_n_steps: windows start at multiples of it (the shortest interval).
        first_step: the early window's first step (None: none).
        length: steps a window records (wait + warmup + active).
        budget: the largest share of training time the windows may cost (None or 0: no budget).
    """

    def __init__(self, every_n_steps: int, first_step: Optional[int], length: int,
                 budget: Optional[float] = None) -> None:
        self.every_n_steps = every_n_steps
        self.first_step = first_step or None
        self.length = length
        self.budget = budget or None
        self.next_start: Optional[int] = None  # set after the first window's cost is known
        self.costs: Dict[int, float] = {}  # window start -> agreed cost (s)
        self.spent_s = 0.0  # the agreed costs so far
        self.run_start = 0  # the run's first step (a resumed run's resume step)
        self.warmup_steps = 0  # windows starting this many steps into the run are past warm-up
        self.judged_due: List[int] = []  # when each window after warm-up is due (plan_run), the last at the last chance
        self.judged_opened = 0  # windows after warm-up started so far
        self._begin: Optional[float] = None  # perf_counter when the open window began recording
        self._aside = 0.0  # validation time inside the open window's span, up to its gather: not its cost
        self.val_every: Optional[int] = None  # optimizer steps between validations (plan_run); None: none
        self._last: Optional[Tuple[int, float]] = None
        self._recent: Deque[float] = deque(maxlen=_TYPICAL_STEPS)
        self._open: Optional[int] = None  # start of the window whose steps are being timed
        self._t0: Optional[float] = None  # the first timed step's end
        self._gathered: Optional[Tuple[float, int]] = None  # the open window's wall time and steps
        self.agree_step: Optional[int] = None  # when the open window's cost is agreed
        self._before: List[float] = []  # the AGREE_AFTER normal steps before the open window (or none)
        self._after: List[float] = []  # the steps since the open window's gather

    # --- timing -----------------------------------------------------------------------------------------
    def step_done(self, step: int, now: Optional[float] = None) -> None:
        """Optimizer step ``step`` ended at ``now`` (perf_counter): time it, outside or inside a window."""
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, (step, now)
        if self._t0 is None:
            self._t0 = now
        if last is None or step != last[0] + 1:
            return
        if self._open is not None and self.agree_step is None:  # a window's step, up to its gather: its cost
            return
        self._recent.append(now - last[1])
        if self._open is not None:  # between a window's gather and the agreement on its cost
            self._after.append(now - last[1])

    def overhead_share(self, now: Optional[float] = None) -> Optional[float]:
        """The agreed costs so far over the wall time since the first timed step (this rank's clock)."""
        now = time.perf_counter() if now is None else now
        return self.spent_s / (now - self._t0) if self._t0 is not None and now > self._t0 else None

    @property
    def open_window(self) -> Optional[int]:
        """The start of the window being recorded or waiting for its cost to be agreed (None: none)."""
        return self._open

    def window_opened(self, start: int, now: Optional[float] = None) -> None:
        """A window starts recording at step ``start`` (at ``now``): its steps from here on count as its cost;
        what ran between the last step's end and now (a checkpoint save, a validation pass) does not."""
        now = time.perf_counter() if now is None else now
        if start - self.run_start >= self.warmup_steps:
            self.judged_opened += 1  # a window after warm-up: one more for the run's verdict
        self._open = start
        self._before = list(self._recent)[-AGREE_AFTER:] if len(self._recent) >= AGREE_AFTER else []
        self._begin = now if self._last is not None and self._last[0] == start else None
        self._aside = 0.0

    def window_gathered(self, now: Optional[float] = None) -> None:
        """The open window's results are gathered (at this step, ``now``): its wall time is known. With a budget,
        its cost is agreed ``AGREE_AFTER`` normal steps later (:meth:`agree_due`), when typical steps on both
        sides of it are known (a window early in the run has only the first, slow, steps before it); without
        one, at once (it is only logged)."""
        now = time.perf_counter() if now is None else now
        if self._open is None:
            return
        begin = self._begin
        last = self._last[0] if self._last is not None else self._open
        # Steps start+1 .. the gather's (whose hook runs the gather before ``now``).
        self._gathered = None if begin is None else (now - begin - self._aside, max(1, last - self._open))
        self.agree_step = last + (AGREE_AFTER if self.budget else 0)
        self._last = (last, now)  # the next step is timed from here, without the gather

    def set_aside(self, seconds: float) -> None:
        """A validation pass of ``seconds`` ran: inside an open window's span, up to its gather, it is no cost
        of the window (the trainer's own work, paid with or without windows)."""
        if self._open is not None and self.agree_step is None:  # not gathered yet
            self._aside += seconds

    def agree_due(self, step: int) -> bool:
        return self._open is not None and self.agree_step is not None and step >= self.agree_step

    def local_cost(self) -> Tuple[float, float]:
        """(cost, typical step) of the gathered window on this rank: its wall time above as many typical steps."""
        # The normal steps on both sides of the window when there are some after it (the step time drifts by
        # 10-20% over a run on a loaded host: steps on one side only misjudge every step of the window), else
        # the recent ones.
        samples = self._before + self._after if len(self._after) >= 3 else list(self._recent)
        typical = statistics.median(samples) if samples else 0.0
        if self._gathered is None:
            return 0.0, typical
        wall, steps = self._gathered
        return max(0.0, wall - steps * typical), typical

    # --- decisions ----------------------------------------------------------------------------------------
    def plan_run(self, run_start: int, max_steps: int, *, warmup_steps: int, gather_delay: int,
                 judged_windows: int = 1, val_every: Optional[int] = None) -> None:
        """The run trains from ``run_start`` to ``max_steps``: windows count from ``run_start``; and a run of at
        least ``JUDGED_MIN_STEPS`` gets ``judged_windows`` windows ``warmup_steps`` or more into it, due at evenly
        spaced steps that end at its last chance (the latest start whose results, ``gather_delay`` steps after
        it, come before the end). ``val_every``: optimizer steps between validation passes (a window does not
        record one: its steps would carry the pass's time)."""
        self.run_start, self.warmup_steps, self.val_every = run_start, warmup_steps, val_every or None
        length = max_steps - run_start
        self.judged_due, self.judged_opened = [], 0
        if length >= JUDGED_MIN_STEPS and judged_windows > 0:
            last = max(warmup_steps, length - self.length - gather_delay)
            gap = (last - warmup_steps) / judged_windows
            self.judged_due = [run_start + last - round(gap * (judged_windows - 1 - i)) for i in range(judged_windows)]

    def is_start(self, step: int, max_steps: int) -> bool:
        if step + self.length > max_steps or self._open is not None:
            return False  # a window that cannot finish, or the last one's cost is not known yet
        if self.val_every and self.val_every >= self.length > (step // self.val_every + 1) * self.val_every - step:
            return False  # a validation pass would run between two of its recorded steps (one fits between)
        if sum(due <= step for due in self.judged_due) > self.judged_opened:
            return True  # fewer windows after warm-up than are due by now
        into = step - self.run_start
        if self.next_start is not None:
            return step >= self.next_start and into % self.every_n_steps == 0
        return (into > 0 and into % self.every_n_steps == 0) or into == self.first_step

    def agree(self, start: int, device: torch.device) -> Tuple[float, float]:
        """Every rank's (cost, typical step) of the window at ``start``: the largest of each over the ranks
        (one all-reduce, every rank at the same step), then the next start from them. Returns the agreed pair."""
        cost_s, typical_s = self.local_cost()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            values = torch.tensor([cost_s, typical_s], dtype=torch.float64, device=device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            cost_s, typical_s = (float(v) for v in values.tolist())
        self.close(start, cost_s, typical_s)
        return cost_s, typical_s

    def close(self, start: int, cost_s: float, typical_s: float) -> None:
        """The window at ``start`` cost ``cost_s`` (agreed): space the next one."""
        self._open, self._begin, self._gathered, self.agree_step = None, None, None, None
        self._before, self._after = [], []
        self.costs[start] = cost_s
        self.spent_s += cost_s
        self.next_start = start + 1
        if self.budget and typical_s > 0:
            self.next_start = max(self.next_start, start + math.ceil(cost_s / (self.budget * typical_s) - 1e-9))
        # The first multiple of every_n_steps into the run at or after it (is_start also requires one).
        into = self.next_start - self.run_start
        self.next_start = self.run_start + -(-into // self.every_n_steps) * self.every_n_steps
