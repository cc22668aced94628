"""The instruments a run plugs into the training core: the measuring callbacks (``callbacks:``) during fit, and
after it, rank 0's verdict with the planner's other configurations for this recipe. ``shardlight.train`` imports
none of them; the CLI hands ``train()`` a list of instruments (``Instrument``: ``callbacks`` and ``after_fit``),
as Lightning takes callbacks.

The end-of-run verdict: the comm windows' analyses (collectives matched across ranks: wait vs transfer; judged
across the windows after warm-up, ``shardlight.diagnosis.across_windows``),
the latest memory and throughput values (all kept by the callbacks in ``Findings``), the wrap report and the
planner's alternatives go to ``shardlight.diagnosis``, which decides; this module puts the result where the
user looks:

* the console: a Rich panel (verdict, a one-line bar of the step split, the top actions);
* ``run_dir/diagnosis.json``; ``run_dir/report.md`` with its PNGs;
* every logger: the ``diagnosis/*`` keys (W&B run summary; one row of the CSV twin), the actions as a W&B table
  ``diagnosis/actions`` (CSV twin ``run_dir/diagnosis_actions.csv``), the report's PNGs as W&B images.

A run without a comm window (too short, or ``callbacks.comm.enabled: false``) has no verdict, and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from shardlight.callbacks._common import Shared, wandb_runs
from shardlight.callbacks.rank_table import log_table
from shardlight.callbacks.registry import build_enabled, findings_of
from shardlight.diagnosis import Diagnosis, render_panel, write_report
from shardlight.diagnosis.across_windows import diagnose_run
from shardlight.diagnosis.markdown_report import REPORT_IMAGES
from shardlight.errors import warn
from shardlight.files import write_json
from shardlight.planner.alternatives import alternatives_on_device
from shardlight.recipe import RecipeConfig
from shardlight.run_context import RunContext

DIAGNOSIS_JSON = "diagnosis.json"
ACTIONS_KEY = "diagnosis/actions"
ACTIONS_CSV = "diagnosis_actions.csv"


class Measurements:
    """The comm, memory and throughput callbacks the recipe enables, and the end-of-run verdict."""

    def callbacks(self, cfg: RecipeConfig, ctx: RunContext) -> List[Callback]:
        shared = Shared(trust_remote_code=cfg.model.trust_remote_code, diagnosis=cfg.diagnosis,
                        micro_batch_size=cfg.trainer.micro_batch_size, tp_size=cfg.parallelism.tp_size,
                        collective_timeout_s=cfg.trainer.collective_timeout_s)
        return build_enabled(cfg.callbacks, ctx, shared)

    def after_fit(self, trainer: Any, module: Any, cfg: RecipeConfig, run_dir: Path) -> Dict[str, Any]:
        """The summary's ``verdict`` (None on other ranks, or without one). Runs after the export's collectives:
        rank 0's verdict work (planner, plots, W&B images) keeps no rank waiting."""
        diagnosis = conclude(trainer, cfg, run_dir, alternatives=_planner_alternatives(cfg, trainer, module))
        if diagnosis is None:
            return {"verdict": None}
        return {"verdict": diagnosis.verdict, "verdict_label": diagnosis.label}


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


def conclude(trainer: Any, cfg: RecipeConfig, run_dir: Path,
             alternatives: Optional[List[Any]] = None) -> Optional[Diagnosis]:
    """Diagnose the run from what its callbacks found, and show and log it (rank 0; other ranks: None)."""
    findings = findings_of(trainer)
    if not trainer.is_global_zero or findings is None or not cfg.diagnosis.enabled:
        return None
    if findings.analysis is None:
        print("shardlight: no comm window was analysed (run too short or callbacks.comm disabled): no verdict",
              flush=True)
        return None
    try:  # a verdict that fails must not cost the user the run: it comes after the export, and only warns
        return _conclude(trainer, cfg, run_dir, findings, alternatives)
    except Exception as exc:  # noqa: BLE001
        warn(f"no end-of-run verdict ({type(exc).__name__}: {exc})")
        return None


def _conclude(trainer: Any, cfg: RecipeConfig, run_dir: Path, findings: Any,
              alternatives: Optional[List[Any]]) -> Diagnosis:
    diagnosis = diagnose_run(
        findings.windows or [(findings.run_start, findings.analysis)], run_start=findings.run_start,
        memory=findings.memory or None, throughput=findings.throughput or None,
        wrap=getattr(trainer.strategy, "wrap_report", None), alternatives=alternatives, config=cfg.diagnosis,
        micro_batch_size=cfg.trainer.micro_batch_size,
    )
    write_json(run_dir / DIAGNOSIS_JSON, diagnosis.to_dict())
    images: List[Path] = []
    try:
        report = write_report(run_dir, diagnosis, findings.analysis, memory=findings.memory or None,
                              throughput=findings.throughput or None)
        images = [report.parent / name for name in REPORT_IMAGES if (report.parent / name).exists()]
    except Exception as exc:  # noqa: BLE001
        warn(f"report.md not written ({type(exc).__name__}: {exc})")
    _print_panel(diagnosis)
    _log(trainer, run_dir, diagnosis, images)
    return diagnosis


def _print_panel(diagnosis: Diagnosis) -> None:
    from rich.console import Console

    Console(file=sys.stdout, soft_wrap=False).print(render_panel(diagnosis))
    sys.stdout.flush()


def _log(trainer: Any, run_dir: Path, diagnosis: Diagnosis, images: List[Path]) -> None:
    """The ``diagnosis/*`` keys to every logger (strings too: the CSV twin keeps the verdict's name), the W&B
    summary, the actions table and the report images."""
    metrics: Dict[str, Any] = dict(diagnosis.summary_metrics())
    step = trainer.global_step
    for logger in trainer.loggers:
        try:
            if isinstance(logger, CSVLogger):
                logger.log_metrics(metrics, step=step)
                logger.save()
        except Exception as exc:  # noqa: BLE001 - a logger must never cost the run
            warn(f"{type(logger).__name__} could not log the verdict: {type(exc).__name__}: {exc}")
    for run in wandb_runs(trainer):
        try:
            run.summary.update(metrics)
            if images:
                import wandb

                run.log({f"diagnosis/{p.stem}": wandb.Image(str(p)) for p in images} |
                        {"trainer/global_step": step})
        except Exception as exc:  # noqa: BLE001
            warn(f"W&B verdict logging failed: {type(exc).__name__}: {exc}")
    rows = [[i + 1, action.text, action.effect, action.change or ""] for i, action in enumerate(diagnosis.actions)]
    log_table(trainer, ACTIONS_KEY, ["priority", "action", "expected effect", "recipe change"], rows,
              csv_path=run_dir / ACTIONS_CSV)
