"""The run's Lightning loggers: W&B (offline unless an API key is set; its failures are warnings) and a CSV
twin that appends, so a resumed run keeps one ``metrics.csv``."""

from __future__ import annotations

import csv
import os
from typing import Any, List, Optional

from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import DummyExperiment, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from shardlight.errors import warn
from shardlight.recipe import RecipeConfig, to_dict
from shardlight.run_context import RunContext


class AppendingCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` deletes an existing metrics.csv; a resumed (e.g. requeued) run must append."""

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class _AppendingWriter(ExperimentWriter):
    @override
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as fh:
                self.metrics_keys = list(csv.DictReader(fh).fieldnames or [])


class SafeWandbLogger(WandbLogger):
    """``WandbLogger`` (same arguments) that turns itself off with one warning when ``wandb.init`` fails
    (misconfigured, its directory unwritable, no network) or a later log call fails. Only rank 0 ever starts
    a W&B run (``rank_zero_experiment``); other ranks get a ``DummyExperiment``."""

    _shardlight_failed = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Lightning always passes wandb.init(anonymous=None); wandb (0.31 here) warns "The anonymous setting has no
        # effect" whenever the key is there, even as None, so leave it out unless someone set it.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    def _disable(self, what: str, exc: BaseException) -> None:
        if not self._shardlight_failed:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            warn(f"W&B {what} failed ({type(exc).__name__}: {detail}); W&B logging is off for this run, "
                 "training continues and the CSV logger has every metric")
        self._shardlight_failed = True

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._shardlight_failed:
            return DummyExperiment()
        try:
            return WandbLogger.experiment.fget(self)
        except Exception as exc:  # noqa: BLE001 - W&B must never stop training
            self._experiment = None
            self._disable("start", exc)
            return DummyExperiment()

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        if self._shardlight_failed:
            return
        try:
            super().log_metrics(metrics, step)
        except Exception as exc:  # noqa: BLE001
            self._disable("log", exc)

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self._shardlight_failed:
            return
        try:
            super().log_hyperparams(params, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self._disable("config", exc)

    @override
    def finalize(self, status: str) -> None:
        try:
            super().finalize(status)
        except Exception as exc:  # noqa: BLE001
            self._disable("finalize", exc)


def build_wandb_logger(**kwargs: Any) -> Optional[SafeWandbLogger]:
    """``SafeWandbLogger(**kwargs)``, or None with a warning when W&B cannot be used at all (not installed)."""
    try:
        return SafeWandbLogger(**kwargs)
    except Exception as exc:  # noqa: BLE001 - e.g. ModuleNotFoundError: wandb is not installed
        warn(f"W&B logger unavailable ({type(exc).__name__}: {exc}); logging to CSV only")
        return None


def wandb_mode(cfg: RecipeConfig) -> str:
    """The recipe's mode, else W&B's own WANDB_MODE, else offline unless an API key is set."""
    if cfg.logging.wandb.mode:
        return cfg.logging.wandb.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def build_loggers(cfg: RecipeConfig, ctx: RunContext) -> List[Any]:
    loggers: List[Any] = []
    if cfg.logging.csv:
        loggers.append(AppendingCSVLogger(save_dir=str(ctx.run_dir), name="csv", version=""))
    if cfg.logging.wandb.enabled and wandb_mode(cfg) != "disabled":
        wb = cfg.logging.wandb
        # W&B failing (misconfigured, unwritable, unreachable) is a warning; the CSV twin keeps every metric.
        logger = build_wandb_logger(
            project=wb.project,
            entity=wb.entity,
            group=wb.group,
            name=wb.name or f"{cfg.name}/{ctx.run_dir.name}",
            tags=list(wb.tags) or None,
            save_dir=str(ctx.run_dir),  # its default "." would override WANDB_DIR
            mode=wandb_mode(cfg),
            config=to_dict(cfg),
            # A requeued Slurm job keeps its id (set in the sbatch script), so it continues the same W&B run.
            **({"id": ctx.wandb_run_id, "resume": "allow"} if ctx.wandb_run_id else {}),
        )
        if logger is not None:
            loggers.append(logger)
    return loggers
