"""Recipe YAML → the typed ``RecipeConfig``: ``base:`` recipes first, then the recipe, an optional
``accelerate config`` file, then ``key.path=value`` overrides, merged onto the schema with OmegaConf and
validated before any rank is spawned, so bad input is one clear line instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardlight.errors import ShardlightError
from shardlight.recipe.accelerate import accelerate_config_overrides
from shardlight.recipe.recipe_files import DEFAULT_RECIPE, find_base, load_yaml, resolve_recipe
from shardlight.recipe.schema import FSDPConfig, RecipeConfig
from shardlight.recipe.validate import validate


@lru_cache(maxsize=None)
def nested_sections(schema: type) -> Dict[str, type]:
    """Field name → section dataclass, for the fields of ``schema`` that are sections themselves."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema) if dataclasses.is_dataclass(hints[f.name])}


@lru_cache(maxsize=None)
def section_lists(schema: type) -> Dict[str, type]:
    """Field name → item dataclass, for the fields of ``schema`` that are lists of sections (``data.datasets``)."""
    hints = typing.get_type_hints(schema)
    return {f.name: typing.get_args(hints[f.name])[0] for f in dataclasses.fields(schema)
            if typing.get_origin(hints[f.name]) is list and dataclasses.is_dataclass(typing.get_args(hints[f.name])[0])}


def _items(value: Any, full: str, source: str):
    """The mappings of a list-of-sections key, with their dotted prefixes; one error for anything else."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ShardlightError(f"recipe key '{full}' in {source} must be a list of mappings, got {value!r}")
    return [(f"{full}[{i}].", item) for i, item in enumerate(value)]


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
        elif key in section_lists(schema):
            for item_prefix, item in _items(value, full, source):
                _check_keys(item, section_lists(schema)[key], item_prefix, source)


def _strip_optional(hint: Any) -> Tuple[Any, bool]:
    """``Optional[X]`` → (X, True); anything else → (hint, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Any), True
    return hint, False


_SINGULAR = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_PLURAL = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}


def describe_type(hint: Any) -> str:
    """A schema type in words, for errors: ``Optional[List[str]]`` → 'a list of strings, or null'."""
    inner, optional = _strip_optional(hint)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin is list:
        text = f"a list of {_PLURAL.get(args[0], 'values') if args else 'values'}"
    elif origin is dict or dataclasses.is_dataclass(inner):
        text = f"a mapping of names to {_PLURAL[args[1]]}" if len(args) == 2 and args[1] in _PLURAL else "a mapping"
    else:
        text = _SINGULAR.get(inner, "any value")
    return f"{text}, or null" if optional else text


def _shown(value: Any) -> str:
    """A value as the user wrote it (YAML spelling), short enough for one line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = f"'{value}'" if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_error(key: str, value: Any, hint: Any, source: str) -> ShardlightError:
    return ShardlightError(f"recipe key '{key}' in {source}: expected {describe_type(hint)}, got {_shown(value)}")


def _fits_shape(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the shape ``hint`` needs: a scalar for a scalar, a list for a list, a mapping
    for a mapping; the scalar conversions themselves (``'3'`` → 3) are OmegaConf's."""
    inner, optional = _strip_optional(hint)
    if value is None:
        return optional or inner is Any
    origin = typing.get_origin(inner)
    if inner is Any:
        return True
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(value, (list, dict)):
        return False
    # OmegaConf reads any number as a bool (5 → true); only 0 and 1 mean one.
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return not (inner is bool and is_number and value not in (0, 1))


def _conform(raw: dict, schema: type, prefix: str, source: str) -> None:
    """Fit ``raw`` (already key-checked) to the schema's shapes in place: a scalar given for any list-typed
    key is a one-item list (``data.train_files=my.jsonl``); any other shape mismatch, down to a list's items
    and a mapping's values, is one error naming the key, the value and the expected type."""
    hints = typing.get_type_hints(schema)
    sections = nested_sections(schema)
    for key, value in list(raw.items()):
        full = f"{prefix}{key}"
        if key in sections:
            if value is None:  # `trainer:` with every key commented out: nothing to change
                del raw[key]
            elif isinstance(value, dict):
                _conform(value, sections[key], f"{full}.", source)
            continue
        if key in section_lists(schema):
            for item_prefix, item in _items(value, full, source):
                _conform(item, section_lists(schema)[key], item_prefix, source)
            continue
        hint = hints[key]
        inner, _ = _strip_optional(hint)
        if typing.get_origin(inner) is list and value is not None and not isinstance(value, (list, dict)):
            value = raw[key] = [value]
        if not _fits_shape(value, hint):
            raise _type_error(full, value, hint, source)
        args = typing.get_args(inner)
        if isinstance(value, list) and args:
            items = [(f"{full}[{i}]", item) for i, item in enumerate(value)]
        elif isinstance(value, dict) and len(args) == 2:
            items = [(f"{full}.{name}", item) for name, item in value.items()]
        else:
            continue
        item_hint = args[0] if isinstance(value, list) else args[1]
        for item_key, item in items:
            if not _fits_shape(item, item_hint):
                raise _type_error(item_key, item, item_hint, source)


def hint_at(dotted: str, schema: type = RecipeConfig) -> Any:
    """The schema type at an OmegaConf full key (``optim.betas[0]``, ``launch.env.NAME``); None if unknown."""
    hint: Any = schema
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", dotted):
        inner, _ = _strip_optional(hint)
        origin, args = typing.get_origin(inner), typing.get_args(inner)
        if dataclasses.is_dataclass(inner):
            hint = typing.get_type_hints(inner).get(part)
        elif origin is list and part.startswith("["):
            hint = args[0] if args else Any
        elif origin is dict:
            hint = args[1] if len(args) == 2 else Any
        else:
            return None
        if hint is None:
            return None
    return hint


# Paths in a recipe file are relative to that file, so a recipe works from any directory.
_FILE_LIST_KEYS = ("train_files", "val_files")
_LOCAL_OR_HUB_KEYS = (("model", "name_or_path"), ("tokenizer", "name_or_path"))


def _resolve_paths(raw: dict, base_dir: Path) -> None:
    """After ``_conform``: the file lists are lists by now."""
    data = raw.get("data")
    if isinstance(data, dict):
        for source in [data, *(data.get("datasets") or [])]:
            for key in _FILE_LIST_KEYS:
                value = source.get(key)
                if isinstance(value, list):
                    source[key] = [str(base_dir / v) if isinstance(v, str) and not os.path.isabs(v) else v
                                   for v in value]
        cache = data.get("cache_dir")
        if isinstance(cache, str) and not os.path.isabs(os.path.expanduser(cache)):
            data["cache_dir"] = str(base_dir / cache)
        template = data.get("chat_template")  # a file, unless it is a template itself or 'tokenizer'
        if isinstance(template, str) and "{" not in template and template != "tokenizer":
            data["chat_template"] = str(base_dir / os.path.expanduser(template))
    for section, key in _LOCAL_OR_HUB_KEYS:
        sub = raw.get(section)
        value = sub.get(key) if isinstance(sub, dict) else None
        if isinstance(value, str) and not os.path.isabs(value):
            candidate = base_dir / value
            if value.startswith((".", "~")) or candidate.exists():
                sub[key] = str(candidate)


def read_recipe_file(path: Path) -> dict:
    """One recipe file as checked sections, its relative paths made absolute (its ``base:`` left as written)."""
    raw = load_yaml(path)
    _check_keys(raw, RecipeConfig, "", str(path))
    _normalize_raw(raw)
    _conform(raw, RecipeConfig, "", str(path))
    _resolve_paths(raw, path.parent)
    return raw


def _recipe_chain(path: Path, seen: tuple = ()) -> List[tuple]:
    path = path.resolve()
    if path in seen:
        raise ShardlightError(f"recipe inheritance loop: {' -> '.join(str(p) for p in seen + (path,))}")
    raw = read_recipe_file(path)
    chain = []
    base = raw.pop("base", None)
    if base is not None:
        chain.extend(_recipe_chain(find_base(str(base), path), seen + (path,)))
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
    """Recipe file or shipped recipe name (or the default) [+ an ``accelerate config`` YAML] + overrides →
    validated ``RecipeConfig``."""
    recipe_path = resolve_recipe(path) if path else DEFAULT_RECIPE
    chain = _recipe_chain(recipe_path)
    for _, raw in chain[:-1]:
        raw.pop("name", None)  # a run is named after the recipe it was started from, not its base
    late = []
    if accelerate_config:
        late.append((f"accelerate config {accelerate_config}", accelerate_config_overrides(accelerate_config)))
    override_dict = _parse_overrides(list(overrides or []))
    _check_keys(override_dict, RecipeConfig, "", "command-line overrides")
    if "base" in override_dict:
        raise ShardlightError("base cannot be set on the command line; write 'base: ...' in a recipe file")
    late.append(("command-line overrides", override_dict))
    for source, raw in late:
        _normalize_raw(raw)
        _conform(raw, RecipeConfig, "", source)
    merged = OmegaConf.structured(RecipeConfig)
    for source, raw in chain + late:
        try:
            merged = OmegaConf.merge(merged, raw)
        except OmegaConfBaseException as exc:
            raise _merge_error(exc, source) from None
    cfg: RecipeConfig = OmegaConf.to_object(merged)
    if cfg.name is None:
        cfg.name = recipe_path.stem
    cfg.base = None
    _merge_fsdp_aliases(cfg.fsdp)
    validate(cfg)
    return cfg


def _merge_error(exc: OmegaConfBaseException, source: str) -> ShardlightError:
    """OmegaConf's conversion errors ("Value 'abc' of type 'str' could not be converted to Integer") in the
    recipe's words: the key, the value and the expected type."""
    key = getattr(exc, "full_key", None) or ""
    hint = hint_at(key) if key else None
    if hint is not None and hasattr(exc, "value"):
        return _type_error(key, exc.value, hint, source)
    return ShardlightError(f"recipe key '{key or '?'}' in {source}: {str(exc).splitlines()[0]}")


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


