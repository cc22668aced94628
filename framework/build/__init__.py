"""Builders: small keyword-light functions that turn a validated recipe (and the ``RunContext``) into the
objects a run needs — tokenizer and data module, model and LightningModule, optimizer, strategy, loggers,
callbacks, trainer. ``shardlight.train`` calls them in that order; nothing else constructs these."""

from shardlight.build.datamodule import build_datamodule, build_tokenizer
from shardlight.build.loggers import build_loggers
from shardlight.build.training_model import build_hf_config, build_hf_model, build_module
from shardlight.build.optimizer import build_optimizer, check_optimizer
from shardlight.build.trainer import build_callbacks, build_strategy, build_trainer

__all__ = [
    "build_callbacks", "build_datamodule", "build_tokenizer", "build_loggers", "build_hf_config", "build_hf_model",
    "build_module", "build_optimizer", "check_optimizer", "build_strategy", "build_trainer",
]
