"""Recipes: the typed schema (``schema``), YAML + overrides → ``RecipeConfig`` (``load``), recipe files before the
schema (``files``), the checks types cannot express (``validate``), ``accelerate config`` import
(``accelerate``), the README table (``docs``).

The bottom layer: imports nothing of shardlight's but ``errors`` and the shipped ``shardlight.recipes`` data.
The names below load on first use (PEP 562): the schema imports the callbacks' configs and with them Lightning
and torch, and ``shardlight.recipe.files`` is read before those are imported (``shardlight train`` starts its
other ranks first).
"""

import importlib

# Exported name -> the module of this package that defines it.
_EXPORTS = {
    "DEFAULT_RECIPE": "files", "RECIPES_DIR": "files",
    "load_recipe": "load", "to_dict": "load", "to_yaml": "load",
    "validate": "validate", "get_key": "validate",
    **{name: "schema" for name in (
        "RecipeConfig", "ModelConfig", "TokenizerConfig", "DataConfig", "OptimConfig", "PeftConfig", "TrainerConfig",
        "FSDPConfig", "ParallelismConfig", "LoggingConfig", "WandbConfig", "CallbacksConfig", "CheckpointConfig",
        "LaunchConfig")},
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardlight.recipe' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"shardlight.recipe.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = list(_EXPORTS)
