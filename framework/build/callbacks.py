"""The run's callbacks: the one clear line for a collective a dead or hung rank broke (always), the
instruments' measuring callbacks (handed in: ``shardlight.instruments``), the garbage
collector's start-up heap frozen (``trainer.gc_freeze``), sharded
checkpoints (and resume), and preemption handling when a scheduler can requeue the job."""

from __future__ import annotations

from typing import List, Sequence

from lightning.pytorch.callbacks import Callback

from shardlight.callbacks import peer_failure
from shardlight.callbacks.gc_freeze import GcFreezeCallback
from shardlight.callbacks.preemption import PreemptionCallback
from shardlight.checkpoint import build_checkpoint_callback
from shardlight.launch import launcher_named
from shardlight.recipe import RecipeConfig
from shardlight.runtime import RunContext


def build_callbacks(cfg: RecipeConfig, ctx: RunContext, measuring: Sequence[Callback] = ()) -> List[Callback]:
    # First: its on_exception prints the clear line before any other callback's on_exception runs.
    callbacks: List[Callback] = [peer_failure.build()]
    callbacks += measuring
    if cfg.trainer.gc_freeze:
        callbacks.append(GcFreezeCallback())
    checkpoint = build_checkpoint_callback(cfg, ctx)  # sharded checkpoints and resume
    if ctx.launcher == "slurm":
        launcher = launcher_named(ctx.launcher)
        # SIGUSR1/SIGTERM: checkpoint at the next step boundary, requeue, exit.
        callbacks.append(PreemptionCallback(requeue=lambda: launcher.requeue(ctx.job_id),
                                            save_checkpoint=checkpoint.save if checkpoint is not None else None))
    return callbacks + ([checkpoint] if checkpoint is not None else [])
