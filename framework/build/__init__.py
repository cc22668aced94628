"""Builders: small keyword-light functions that turn a validated recipe (and the ``RunContext``) into the
objects a run needs — tokenizer and data module, model and LightningModule, optimizer, strategy, loggers,
callbacks, trainer. ``shardlight.train`` calls them in that order; nothing else constructs these."""

import importlib
from typing import Any

# Each builder from its module on first use: a command that needs only the model's config (plan, preflight's
# checks) does not load Lightning and the data stack with it.
_HOME = {
    "build_datamodule": "datamodule", "build_tokenizer": "datamodule", "build_loggers": "loggers",
    "build_hf_config": "training_model", "build_hf_model": "training_model", "build_module": "training_model",
    "build_optimizer": "optimizer", "check_optimizer": "optimizer",
    "build_callbacks": "trainer", "build_strategy": "trainer", "build_trainer": "trainer",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"shardlight.build.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "build_callbacks", "build_datamodule", "build_tokenizer", "build_loggers", "build_hf_config", "build_hf_model",
    "build_module", "build_optimizer", "check_optimizer", "build_strategy", "build_trainer",
]
