"""The ``lightning.Trainer``: the recipe's ``trainer:`` section, the strategy (``fsdp:``, ``parallelism:``), the
loggers and the core's callbacks: the one clear line for a collective a dead or hung rank broke (always), the
instruments' measuring callbacks (handed in: ``shardlight.instruments``), the garbage collector's start-up heap
frozen (``trainer.gc_freeze``), sharded checkpoints (and resume), and preemption handling when a scheduler can
requeue the job."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import List, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from shardlight.build.loggers import build_loggers
from shardlight.callbacks import peer_failure
from shardlight.callbacks.gc_freeze import GcFreezeCallback
from shardlight.callbacks.preemption import PreemptionCallback
from shardlight.callbacks.progress import LatestMetrics, StepProgressBar
from shardlight.checkpoint import build_checkpoint_callback
from shardlight.launch import launcher_named
from shardlight.recipe import RecipeConfig
from shardlight.run_context import RunContext
from shardlight.strategy import ShardlightFSDPStrategy, resolve_recipe_fsdp

# Where Lightning's rank_zero_info lands (fabric's name until lightning.pytorch re-points it).
_LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
# Where ``_init_dist_connection`` logs "Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/n" on every rank.
_LIGHTNING_DIST_LOGGER = "lightning.fabric.utilities.distributed"
# Info records of Lightning's that tell a user nothing: the litlogger advertisement the Trainer logs on every
# run without its LitLogger, and the process-group banners (each rank's "Initializing distributed: ..." and
# rank 0's "distributed_backend=gloo / All distributed processes registered" block), the accelerator inventory
# ("GPU available: False, used: False", TPU, HPU: the plan line says what the run uses) and the "`Trainer.fit`
# stopped: `max_steps=N` reached." line (the summary says the steps).
_CHATTER = ("litlogger", "Initializing distributed:", "All distributed processes registered", "GPU available:",
            "TPU available:", "HPU available:", "`Trainer.fit` stopped:")


def _not_chatter(record: logging.LogRecord) -> bool:
    """Drops Lightning's info-level ``_CHATTER``; warnings and errors always pass, whatever they say."""
    if record.levelno >= logging.WARNING:
        return True
    message = str(record.msg)
    return not any(chatter in message for chatter in _CHATTER)


def build_strategy(cfg: RecipeConfig) -> ShardlightFSDPStrategy:
    t = cfg.trainer
    return ShardlightFSDPStrategy(
        resolve_recipe_fsdp(cfg), precision=t.precision, num_nodes=t.num_nodes, devices=t.devices,
        num_threads=t.num_threads, timeout=timedelta(seconds=t.collective_timeout_s),
        startup_timeout=timedelta(seconds=t.startup_timeout_s),
    )


def build_callbacks(cfg: RecipeConfig, ctx: RunContext, measuring: Sequence[Callback] = ()) -> List[Callback]:
    # First: its on_exception prints the clear line before any other callback's on_exception runs.
    callbacks: List[Callback] = [peer_failure.build(ctx)]
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


def build_trainer(cfg: RecipeConfig, ctx: RunContext, measuring: Sequence[Callback] = ()) -> pl.Trainer:
    """``measuring``: the instruments' callbacks (``shardlight.instruments``), placed among the core's."""
    t = cfg.trainer
    for name in (*_LIGHTNING_INFO_LOGGERS, _LIGHTNING_DIST_LOGGER):
        logging.getLogger(name).addFilter(_not_chatter)  # once: a logger keeps a filter only once
    strategy = build_strategy(cfg)
    loggers = build_loggers(cfg, ctx)
    callbacks = build_callbacks(cfg, ctx, measuring)
    if t.progress_bar:
        # The observability callbacks log through the loggers; the bar reads their latest values from this one.
        latest = LatestMetrics()
        loggers.append(latest)
        callbacks.append(StepProgressBar(latest))
    return pl.Trainer(
        plugins=launcher_named(ctx.launcher).lightning_plugins() or None,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        precision=t.precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        # val_check_interval counts micro-batches; the recipe counts optimizer steps.
        val_check_interval=t.val_every_n_steps * t.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1 if t.limit_val_batches != 0 else 0,  # the pass before step 1 = first_val_loss
        limit_val_batches=t.limit_val_batches,
        enable_checkpointing=False,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        logger=loggers,
        callbacks=callbacks,
        default_root_dir=str(ctx.run_dir),
        use_distributed_sampler=True,
    )
