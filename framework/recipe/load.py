"""Recipe YAML → the typed ``RecipeConfig``: ``base:`` recipes first, then the recipe, an optional
``accelerate config`` file, then ``key.path=value`` overrides, merged onto the schema with OmegaConf and
validated before any rank is spawned, so bad input is one clear line instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import shardlight.recipes
from shardlight.errors import ShardlightError
from shardlight.recipe.accelerate import accelerate_config_overrides
from shardlight.recipe.schema import FSDPConfig, RecipeConfig
from shardlight.recipe.validate import validate

# The recipes ship inside the package (shardlight.recipes), so this is right for a wheel and a checkout alike.
RECIPES_DIR = Path(shardlight.recipes.__file__).resolve().parent
DEFAULT_RECIPE = RECIPES_DIR / "tiny-llama-sft.yaml"


def _load_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ShardlightError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ShardlightError(f"YAML syntax error in {where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ShardlightError(f"YAML error in {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ShardlightError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return data


@lru_cache(maxsize=None)
def nested_sections(schema: type) -> Dict[str, type]:
    """Field name → section dataclass, for the fields of ``schema`` that are sections themselves."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema) if dataclasses.is_dataclass(hints[f.name])}


def _check_keys(raw: Any, schema: type, prefix: str, source: str) -> None:
    """Unknown keys get a did-you-mean; OmegaConf's own message names neither the file nor a fix."""
    if not isinstance(raw, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    sections = nested_sections(schema)
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; allowed: {', '.join(fields)}"
            raise ShardlightError(f"unknown recipe key '{full}' in {source}{hint}")
        if key in sections:
            if value is not None and not isinstance(value, dict):
                raise ShardlightError(f"recipe key '{full}' in {source} must be a mapping, got {value!r}")
            _check_keys(value, sections[key], f"{full}.", source)


# Paths in a recipe file are relative to that file, so a recipe works from any directory.
_FILE_LIST_KEYS = ("train_files", "val_files")
_LOCAL_OR_HUB_KEYS = (("model", "name_or_path"), ("tokenizer", "name_or_path"))


def _resolve_paths(raw: dict, base_dir: Path) -> None:
    data = raw.get("data")
    if isinstance(data, dict):
        for key in _FILE_LIST_KEYS:
            value = data.get(key)
            if isinstance(value, str):
                value = [value]
            if isinstance(value, list):
                data[key] = [str(base_dir / v) if isinstance(v, str) and not os.path.isabs(v) else v for v in value]
    for section, key in _LOCAL_OR_HUB_KEYS:
        sub = raw.get(section)
        value = sub.get(key) if isinstance(sub, dict) else None
        if isinstance(value, str) and not os.path.isabs(value):
            candidate = base_dir / value
            if value.startswith((".", "~")) or candidate.exists():
                sub[key] = str(candidate)


def _recipe_chain(path: Path, seen: tuple = ()) -> List[tuple]:
    path = path.resolve()
    if path in seen:
        raise ShardlightError(f"recipe inheritance loop: {' -> '.join(str(p) for p in seen + (path,))}")
    raw = _load_yaml(path)
    _check_keys(raw, RecipeConfig, "", str(path))
    _resolve_paths(raw, path.parent)
    chain = []
    base = raw.pop("base", None)
    if base is not None:
        base_path = Path(base) if os.path.isabs(base) else path.parent / base
        if not base_path.is_file() and (RECIPES_DIR / base).is_file():
            base_path = RECIPES_DIR / base
        if not base_path.is_file():
            raise ShardlightError(f"base recipe '{base}' named in {path} not found")
        chain.extend(_recipe_chain(base_path, seen + (path,)))
    chain.append((str(path), raw))
    return chain


def _parse_overrides(overrides: List[str]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ShardlightError(f"override '{item}' is not of the form key.path=value")
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as exc:
        raise ShardlightError(f"bad override: {str(exc).splitlines()[0]}") from None
    return parsed


def _normalize_raw(raw: dict) -> None:
    """Accelerate writes class lists as comma-separated strings; accept them as such."""
    fsdp = raw.get("fsdp")
    if isinstance(fsdp, dict):
        for key in ("transformer_cls_names_to_wrap", "transformer_layer_cls_to_wrap"):
            if isinstance(fsdp.get(key), str):
                fsdp[key] = [name.strip() for name in fsdp[key].split(",") if name.strip()]


def load_recipe(path: Optional[str] = None, overrides: Optional[List[str]] = None,
                accelerate_config: Optional[str] = None) -> RecipeConfig:
    """Recipe file (or the default) [+ an ``accelerate config`` YAML] + overrides → validated ``RecipeConfig``."""
    recipe_path = Path(path) if path else DEFAULT_RECIPE
    chain = _recipe_chain(recipe_path)
    if accelerate_config:
        chain.append((f"accelerate config {accelerate_config}", accelerate_config_overrides(accelerate_config)))
    override_dict = _parse_overrides(list(overrides or []))
    _check_keys(override_dict, RecipeConfig, "", "command-line overrides")
    for _, raw in chain + [("", override_dict)]:
        _normalize_raw(raw)
    for _, raw in chain[:-1]:
        raw.pop("name", None)  # a run is named after the recipe it was started from, not its base
    merged = OmegaConf.structured(RecipeConfig)
    for source, raw in chain + [("command-line overrides", override_dict)]:
        try:
            merged = OmegaConf.merge(merged, raw)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            detail = str(exc).splitlines()[0]
            raise ShardlightError(f"recipe key '{key}' in {source}: {detail}") from None
    cfg: RecipeConfig = OmegaConf.to_object(merged)
    if cfg.name is None:
        cfg.name = recipe_path.stem
    cfg.base = None
    _merge_fsdp_aliases(cfg.fsdp)
    validate(cfg)
    return cfg


def _merge_fsdp_aliases(fsdp: FSDPConfig) -> None:
    """Accelerate spells some options two ways; keep one spelling in the resolved recipe."""
    if fsdp.transformer_layer_cls_to_wrap and not fsdp.transformer_cls_names_to_wrap:
        fsdp.transformer_cls_names_to_wrap = list(fsdp.transformer_layer_cls_to_wrap)
    fsdp.transformer_layer_cls_to_wrap = None
    if fsdp.offload_params is not None:
        fsdp.cpu_offload = bool(fsdp.offload_params)
    fsdp.offload_params = None
    if fsdp.mixed_precision_policy is not None and fsdp.mixed_precision is None:
        fsdp.mixed_precision = str(fsdp.mixed_precision_policy).lower()
    fsdp.mixed_precision_policy = None
    for key in ("sharding_strategy", "auto_wrap_policy", "backward_prefetch", "state_dict_type"):
        value = getattr(fsdp, key)
        if isinstance(value, str):
            setattr(fsdp, key, value.upper())


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RecipeConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


