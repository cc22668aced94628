"""The end-of-run verdict, on rank 0, after ``Trainer.fit``: where the bottleneck landed, with its evidence and
what to change.

Inputs: the last comm window's analysis (collectives matched across ranks: wait vs transfer), the latest memory
and throughput values (all kept by the callbacks in ``Findings``), the wrap report, and the planner's
alternatives for this recipe (does another strategy fit, what would it save). ``shardlight.diagnosis`` decides;
this module only hands it the facts and puts the result where the user looks:

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

from lightning.pytorch.loggers import CSVLogger

from shardlight.callbacks._common import wandb_runs
from shardlight.callbacks.rank_table import log_table
from shardlight.callbacks.registry import findings_of
from shardlight.diagnosis import Diagnosis, diagnose, render_panel, write_report
from shardlight.diagnosis.report import REPORT_IMAGES
from shardlight.errors import warn
from shardlight.files import write_json
from shardlight.recipe import RecipeConfig

DIAGNOSIS_JSON = "diagnosis.json"
ACTIONS_KEY = "diagnosis/actions"
ACTIONS_CSV = "diagnosis_actions.csv"


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
    diagnosis = diagnose(
        findings.analysis, memory=findings.memory or None, throughput=findings.throughput or None,
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
    rows = [[i + 1, action.text, action.effect] for i, action in enumerate(diagnosis.actions)]
    log_table(trainer, ACTIONS_KEY, ["priority", "action", "expected effect"], rows, csv_path=run_dir / ACTIONS_CSV)
