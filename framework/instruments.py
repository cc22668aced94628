"""The instruments a run plugs into the training core: the measuring callbacks (``callbacks:``) during fit, and
after it, rank 0's verdict with the planner's other configurations for this recipe. ``shardlight.train`` imports
none of them; the CLI hands ``train()`` a list of instruments (``Instrument``: ``callbacks`` and ``after_fit``),
as Lightning takes callbacks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from lightning.pytorch.callbacks import Callback

from shardlight.callbacks._common import Shared
from shardlight.callbacks.registry import build_enabled, findings_of
from shardlight.planner.alternatives import alternatives_on_device
from shardlight.recipe import RecipeConfig
from shardlight.runtime import RunContext
from shardlight.verdict import conclude


class Measurements:
    """The comm, memory and throughput callbacks the recipe enables, and the end-of-run verdict."""

    def callbacks(self, cfg: RecipeConfig, ctx: RunContext) -> List[Callback]:
        shared = Shared(trust_remote_code=cfg.model.trust_remote_code, diagnosis=cfg.diagnosis,
                        micro_batch_size=cfg.trainer.micro_batch_size, tp_size=cfg.parallelism.tp_size)
        return build_enabled(cfg.callbacks, ctx, shared)

    def after_fit(self, trainer: Any, module: Any, cfg: RecipeConfig, run_dir: Path) -> Dict[str, Any]:
        """The summary's ``verdict`` (None on other ranks, or without one). Runs after the export's collectives:
        rank 0's verdict work (planner, plots, W&B images) keeps no rank waiting."""
        diagnosis = conclude(trainer, cfg, run_dir, alternatives=_planner_alternatives(cfg, trainer, module))
        return {"verdict": diagnosis.verdict if diagnosis is not None else None}


def _planner_alternatives(cfg: RecipeConfig, trainer: Any, module: Any) -> Optional[List[Dict[str, Any]]]:
    """The planner's other configurations for this recipe on the device the run had (rank 0; the verdict's
    effect estimates); None, with a note, when it cannot plan (never fatal)."""
    findings = findings_of(trainer)
    if not trainer.is_global_zero or findings is None or findings.analysis is None:
        return None
    alternatives, note = alternatives_on_device(cfg, module.model.config, findings.memory)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return alternatives or None
