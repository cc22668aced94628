"""Checks on a merged recipe that its types alone cannot express. Allowed values and sign rules come from
the schema's field metadata (``allowed``, ``positive``, ``non_negative``); the rest are cross-field rules."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator, Tuple

from shardlight.errors import ShardlightError
from shardlight.recipe.schema import RecipeConfig


def get_key(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def schema_fields(schema: type = RecipeConfig, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field]]:
    """Every leaf field of the schema with its dotted key, in declaration order."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def _check_field(key: str, value: Any, meta: Any) -> None:
    allowed = meta.get("allowed")
    if allowed is not None and value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ShardlightError(f"{key}: '{value}' is not allowed; allowed values: {shown}")
    if value is None:
        return
    if meta.get("positive") and value <= 0:
        raise ShardlightError(f"{key} must be positive, got {value}")
    if meta.get("non_negative") and value < 0:
        raise ShardlightError(f"{key} must not be negative, got {value}")


def validate(cfg: RecipeConfig) -> None:
    for key, f in schema_fields():
        _check_field(key, get_key(cfg, key), f.metadata)
    if not 0 <= cfg.data.val_fraction < 1:
        raise ShardlightError(f"data.val_fraction must be in [0, 1), got {cfg.data.val_fraction}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ShardlightError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    if cfg.trainer.gradient_clip_val is not None and cfg.trainer.gradient_clip_val <= 0:
        raise ShardlightError(
            f"trainer.gradient_clip_val must be positive or null, got {cfg.trainer.gradient_clip_val}")
    if (cfg.model.name_or_path is None) == (cfg.model.config is None):
        raise ShardlightError("model: set exactly one of model.name_or_path (pretrained) or model.config (inline)")
    if cfg.model.config is not None and "model_type" not in cfg.model.config:
        raise ShardlightError("model.config must name its architecture with model_type (e.g. llama)")
    if not cfg.data.train_files and not cfg.data.dataset:
        raise ShardlightError("data: set data.train_files (local files) or data.dataset (hub dataset)")
    secrets = [k for k in cfg.launch.env if any(w in k.upper() for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))]
    if secrets:
        raise ShardlightError(
            f"launch.env.{secrets[0]} looks like a secret; recipes and job scripts are written to disk, so export "
            "it in the submitting shell instead (sbatch passes the environment through)"
        )
    if cfg.data.format == "instruction" and "{prompt}" not in cfg.data.prompt_template:
        raise ShardlightError("data.prompt_template must contain {prompt}")
