"""The ``lightning.Trainer``: the recipe's ``trainer:`` section, the strategy, loggers and callbacks."""

from __future__ import annotations

import lightning.pytorch as pl

from shardlight.build.callbacks import build_callbacks
from shardlight.build.loggers import build_loggers
from shardlight.build.strategy import build_strategy
from shardlight.launch import launcher_named
from shardlight.recipe import RecipeConfig
from shardlight.runtime import RunContext


def build_trainer(cfg: RecipeConfig, ctx: RunContext) -> pl.Trainer:
    t = cfg.trainer
    return pl.Trainer(
        plugins=launcher_named(ctx.launcher).lightning_plugins() or None,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
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
        logger=build_loggers(cfg, ctx),
        callbacks=build_callbacks(cfg, ctx),
        default_root_dir=str(ctx.run_dir),
        use_distributed_sampler=True,
    )
