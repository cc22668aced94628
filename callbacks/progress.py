"""The console progress bar: one bar over the whole run, ``step N/max_steps``, with the loss, tokens/s per
device and exposed communication when they are known. ``shardlight.build`` adds it (with its
``LatestMetrics``) when ``trainer.progress_bar`` is true; it is not recipe-configured.

Lightning's own bars count batches per epoch and start again every epoch ("Epoch 5/-2" on a run driven by
``max_steps``, which has no epoch count), and show whatever was ``self.log``-ed with ``prog_bar=True``. The
observability callbacks hand their metrics to the trainer's loggers instead (``_common.log_metrics``), so
``LatestMetrics``, a logger that keeps each metric's latest value, is where the bar reads them: neither
side knows the other beyond the metric names. Rank 0 only, like the bar.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

TOKENS_PER_SEC = "throughput/tokens_per_sec_per_device"
EXPOSED_MS, STEP_MS = "comm/exposed_ms", "step/time_ms"
HEADROOM_GB = "memory/headroom_gb"  # the minimum over ranks


class LatestMetrics(Logger):
    """A Lightning logger that writes nothing anywhere: it keeps the latest value of every metric logged."""

    def __init__(self) -> None:
        super().__init__()
        self.values: Dict[str, float] = {}

    @property
    @override
    def name(self) -> str:
        return "latest"

    @property
    @override
    def version(self) -> str:
        return ""

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        for key, value in metrics.items():
            try:
                self.values[key] = float(value)
            except (TypeError, ValueError):
                pass  # not a number (a table, a string): nothing a bar shows

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _known(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def bar_metrics(progress_bar_metrics: Mapping[str, Any], latest: Mapping[str, float]) -> Dict[str, str]:
    """What the bar shows after ``step N/M``, each only once known: the training loss (and validation loss)
    the module logs for the bar, tokens/s per device, exposed communication as a share of the step time
    (the latest comm window's) and the smallest memory headroom over ranks."""
    shown: Dict[str, str] = {}
    for key, label in (("train/loss", "loss"), ("val/loss", "val_loss")):
        value = progress_bar_metrics.get(key)
        value = float(value) if value is not None else None
        if _known(value):
            shown[label] = f"{value:.4f}"
    if _known(latest.get(TOKENS_PER_SEC)):
        shown["tokens/s/device"] = f"{latest[TOKENS_PER_SEC]:,.0f}"
    exposed, step = latest.get(EXPOSED_MS), latest.get(STEP_MS)
    if _known(exposed) and _known(step) and step > 0:
        shown["exposed comm"] = f"{100.0 * exposed / step:.0f}%"
    if _known(latest.get(HEADROOM_GB)):
        shown["headroom"] = f"{latest[HEADROOM_GB]:.1f} GB"
    return shown


class StepProgressBar(TQDMProgressBar):
    """``step N/max_steps`` over the whole run (optimizer steps, so accumulation and resumes count right);
    the sanity-check and validation passes get no bar of their own (seconds, and the loss lands on this one).

    Arguments:
        latest: the ``LatestMetrics`` among the trainer's loggers.
        refresh_rate: redraw every this many optimizer steps.
    """

    BAR_FORMAT = "{desc}{n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}{postfix}]"

    def __init__(self, latest: LatestMetrics, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.latest = latest
        self._shown_step = -1

    @override
    def init_sanity_tqdm(self) -> Tqdm:
        return Tqdm(disable=True)

    @override
    def init_validation_tqdm(self) -> Tqdm:
        return Tqdm(disable=True)

    @override
    def init_train_tqdm(self) -> Tqdm:
        max_steps = self.trainer.max_steps
        return Tqdm(
            desc="step ",
            total=max_steps if max_steps and max_steps > 0 else None,
            initial=self.trainer.global_step,  # a resumed run starts where its checkpoint was
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        pass  # one bar for the whole run: epochs do not reset it

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        bar = self.train_progress_bar
        if step == self._shown_step or not self._should_update(step, bar.total):
            return  # accumulation: no optimizer step since the last redraw
        self._shown_step = step
        if not bar.disable:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.update(0)  # redraws at most every tqdm mininterval: fast steps do not flood a log file

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last step's loss and a window gathered at the end are logged after its redraw: show them.
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        super().on_train_end(trainer, pl_module)  # closing draws the final line

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Dict[str, Any]:
        return bar_metrics(trainer.progress_bar_metrics, self.latest.values)
