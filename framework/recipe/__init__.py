"""Recipes: the typed schema (``schema``; the instruments' sections in ``instrument_sections``), YAML + overrides
→ ``RecipeConfig`` (``load``), recipe files before the schema (``recipe_files``), the checks types cannot express
(``validate``), ``accelerate config`` import (``accelerate``), the reference table (``docs``).

The bottom of the training core: imports nothing of shardlight's but ``errors`` and the shipped
``shardlight.recipes`` data (an import contract), and no torch.
"""

from shardlight.recipe.load import load_recipe, to_dict, to_yaml
from shardlight.recipe.recipe_files import DEFAULT_RECIPE, RECIPES_DIR, resolve_recipe
from shardlight.recipe.schema import (
    CallbacksConfig,
    CheckpointConfig,
    DataConfig,
    FSDPConfig,
    LaunchConfig,
    LoggingConfig,
    MixtureSource,
    ModelConfig,
    OptimConfig,
    ParallelismConfig,
    PeftConfig,
    RecipeConfig,
    SourceConfig,
    TokenizerConfig,
    TrainerConfig,
    WandbConfig,
)
from shardlight.recipe.validate import get_key, validate

__all__ = [
    "DEFAULT_RECIPE", "RECIPES_DIR", "load_recipe", "resolve_recipe", "to_dict", "to_yaml", "validate", "get_key",
    "RecipeConfig", "ModelConfig", "TokenizerConfig", "DataConfig", "SourceConfig", "MixtureSource", "OptimConfig",
    "PeftConfig", "TrainerConfig",
    "FSDPConfig", "ParallelismConfig", "LoggingConfig", "WandbConfig", "CallbacksConfig", "CheckpointConfig",
    "LaunchConfig",
]
