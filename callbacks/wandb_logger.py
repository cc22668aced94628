"""A W&B logger whose failures are warnings: training continues and the CSV logger keeps every metric."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.logger import DummyExperiment, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from shardlight.callbacks._common import warn


class SafeWandbLogger(WandbLogger):
    """``WandbLogger`` (same arguments) that turns itself off with one warning when ``wandb.init`` fails
    (misconfigured, its directory unwritable, no network) or a later log call fails. Only rank 0 ever starts
    a W&B run (``rank_zero_experiment``); other ranks get a ``DummyExperiment``."""

    _shardlight_failed = False

    def _disable(self, what: str, exc: BaseException) -> None:
        if not self._shardlight_failed:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            warn(f"W&B {what} failed ({type(exc).__name__}: {detail}); W&B logging is off for this run, "
                 "training continues and the CSV logger has every metric")
        self._shardlight_failed = True

    @property
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

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        if self._shardlight_failed:
            return
        try:
            super().log_metrics(metrics, step)
        except Exception as exc:  # noqa: BLE001
            self._disable("log", exc)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self._shardlight_failed:
            return
        try:
            super().log_hyperparams(params, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self._disable("config", exc)

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
