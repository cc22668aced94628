"""GcFreezeCallback: keep Python's full garbage collections from pausing one rank while the others wait.

By the first training step a rank's Python heap holds millions of objects that live as long as the process
(torch, transformers and Lightning modules, the model's modules and parameters). CPython's cyclic collector
scans all of them in every full (generation 2) collection; on the default recipe's 2-rank CPU run one such
collection took 244 ms of one rank's CPU at its first logging step (measured with ``gc.callbacks``), and the
other rank waited for it at the next collective: a one-rank stall no profile of the model explains. So at
train start this callback collects once and moves everything alive into the permanent generation
(``gc.freeze()``): later full collections scan only what training allocates. Reference cycles made during
training are still collected; what was frozen is never freed before the callback unfreezes it at train end,
which is what those objects do anyway. ``trainer.gc_freeze: false`` leaves the collector as it is.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class GcFreezeCallback(Callback):
    """``gc.collect(); gc.freeze()`` at train start, ``gc.unfreeze()`` at train end (every rank)."""

    def __init__(self) -> None:
        self.frozen = 0  # objects moved to the permanent generation at train start

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.unfreeze()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        gc.unfreeze()
