"""What a diagnosis hands back: the verdict, its evidence and ranked actions, as plain JSON-able data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from shardlight.diagnosis.step_split import PARTS

# Every verdict a diagnosis can give, in the table's order; loggers that take numbers only get the index.
VERDICTS = ("communication-bound", "straggler-bound", "input-bound", "host-bound", "memory-bound", "compute-bound")


@dataclass(frozen=True)
class Action:
    """One thing to try, with what it should change. ``score`` orders the actions of one verdict: the expected
    saving in the verdict's unit (ms per step; GB of headroom for memory-bound); None when it cannot be costed.
    ``change``: the recipe overrides that do it (``key=value``, space-separated; ``load_recipe`` takes them),
    when the action is one recipe change; the text names the recipe key it is about in any case."""

    text: str
    effect: str
    score: Optional[float] = None
    change: Optional[str] = None


@dataclass
class Diagnosis:
    verdict: str
    headline: str
    lead: str                                   # the headline without the verdict: what window_line shows
    split: Dict[str, float]                     # overall ms per step (mean over ranks); PARTS + step_ms
    split_by_rank: Dict[int, Dict[str, float]]
    shares: Dict[str, float]                    # % of the step per part (compute_pct, ..., idle_pct)
    evidence: Dict[str, Any]
    actions: List[Action] = field(default_factory=list)
    secondary: List[str] = field(default_factory=list)
    straggler_rank: Optional[int] = None
    straggler_cause: Optional[str] = None
    missing_ranks: List[int] = field(default_factory=list)
    min_headroom_bytes: Optional[float] = None
    min_headroom_rank: Optional[int] = None
    steps: int = 0                              # ProfilerSteps analysed per rank
    scores: Dict[str, Optional[float]] = field(default_factory=dict)  # each class's share, % (verdicts.MEASURES)
    # Across windows (``across_windows.diagnose_run``); one window alone leaves the defaults.
    label: str = ""                             # the verdict, or "A or B" when two cannot be told apart
    certainty: Optional[str] = None             # what it was judged on, and each named class's mean ± spread
    windows: List[int] = field(default_factory=list)  # start steps of the windows judged
    run_start: int = 0                          # the run's first step (a resumed run's resume step)
    provisional: bool = False                   # judged on warm-up windows only
    spread: Dict[str, List[float]] = field(default_factory=dict)  # class -> [mean, spread] of its share, %

    def __post_init__(self) -> None:
        self.label = self.label or self.verdict

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["split_by_rank"] = {str(rank): split for rank, split in self.split_by_rank.items()}
        return data

    def summary_metrics(self) -> Dict[str, Any]:
        """A flat dict for loggers: ``diagnosis/verdict`` (str: the label, "A or B" when two cannot be told
        apart), ``diagnosis/verdict_code`` (the leading verdict's index in ``VERDICTS``), every share in %,
        ``diagnosis/step_ms``, ``diagnosis/straggler_rank`` (-1: none), ``diagnosis/missing_ranks`` (count)
        and, with memory numbers, ``diagnosis/min_headroom_gb``."""
        metrics: Dict[str, Any] = {"diagnosis/verdict": self.label,
                                   "diagnosis/verdict_code": float(VERDICTS.index(self.verdict))}
        for part in PARTS:
            key = part.replace("_ms", "_pct")
            metrics[f"diagnosis/{key}"] = self.shares[key]
            metrics[f"diagnosis/{part}"] = self.split[part]
        metrics["diagnosis/step_ms"] = self.split["step_ms"]
        metrics["diagnosis/straggler_rank"] = float(-1 if self.straggler_rank is None else self.straggler_rank)
        metrics["diagnosis/missing_ranks"] = float(len(self.missing_ranks))
        if self.min_headroom_bytes is not None:
            metrics["diagnosis/min_headroom_gb"] = self.min_headroom_bytes / 1e9
        return metrics
