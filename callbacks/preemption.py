"""Preemption-safe stopping: on SIGUSR1 (Slurm, 90 s before the time limit) or SIGTERM, checkpoint at the
next step boundary on all ranks, requeue the job from rank 0 (through its launcher), and exit cleanly.

The signal handler only sets a flag. Saving inside the handler (as Lightning's own SLURM requeue does)
runs collectives from whatever frame the signal interrupted and hangs intermittently (Lightning #21406).
"""

from __future__ import annotations

import signal
from typing import Any, Callable, Dict, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionCallback(pl.Callback):
    """Set ``trainer.shardlight_preempted`` after saving; train.py then skips final validation/export.

    Arguments:
        requeue: puts the job back in the queue and says what happened (the launcher's ``requeue``);
            called on rank 0 after the checkpoint is complete.
        save_checkpoint: ``(trainer, module) -> path``: the checkpoint callback's save, or None.
    """

    def __init__(self, requeue: Callable[[], str], save_checkpoint: Optional[Callable[..., Any]] = None) -> None:
        self._requeue = requeue
        self._save_checkpoint = save_checkpoint
        self.signal_received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._pending: Optional[tuple] = None

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signum

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._pending is not None:
            self._pending[1].wait()  # every rank started it; finish it before the process group goes
            self._pending = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _any_rank_signalled(self, trainer: pl.Trainer) -> bool:
        """Whether any rank had a signal one step ago. Ranks get the signal at slightly different times
        and must all stop at the same step boundary, so they agree through an all-reduce; it is started
        asynchronously and read a step later, so the training loop never waits on it."""
        flag = torch.tensor([1.0 if self.signal_received is not None else 0.0], device=trainer.strategy.root_device)
        if not (dist.is_available() and dist.is_initialized()):
            return bool(flag.item())
        previous, self._pending = self._pending, (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        if previous is None:
            return False
        previous[1].wait()
        return bool(previous[0].item())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # not a step boundary: gradients are half accumulated
        if not self._any_rank_signalled(trainer):
            return
        path = self._save_checkpoint(trainer, pl_module) if self._save_checkpoint is not None else None
        rank_zero_info(f"preempted at step {trainer.global_step}: checkpoint {path}")
        if trainer.is_global_zero:
            rank_zero_info(self._requeue())
        trainer.shardlight_preempted = True
        trainer.should_stop = True

