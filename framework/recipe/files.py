"""Recipe files as YAML, before the schema: where the shipped recipes are, reading one file, finding a ``base:``,
and ``peek_ranks``, the local ranks a recipe asks for read from its files and overrides alone.

Light on purpose (yaml, no schema): the schema pulls in the callbacks and so Lightning and torch, and
``shardlight train`` starts the other local ranks (``shardlight.launch.standby``) before it imports them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

import shardlight.recipes
from shardlight.errors import ShardlightError

# The recipes ship inside the package (shardlight.recipes), so this is right for a wheel and a checkout alike.
RECIPES_DIR = Path(shardlight.recipes.__file__).resolve().parent
DEFAULT_RECIPE = RECIPES_DIR / "tiny-llama-sft.yaml"


def load_yaml(path: Path) -> dict:
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


def find_base(base: str, recipe: Path) -> Path:
    """``base:`` is looked up beside the recipe, then among the shipped recipes (``recipes/name.yaml`` as
    the repo spells it means the same), then in the current directory."""
    named = Path(os.path.expanduser(base))
    if named.is_absolute():
        if named.is_file():
            return named
        raise ShardlightError(f"base recipe '{base}' named in {recipe} not found")
    shipped = Path(*named.parts[1:]) if len(named.parts) > 1 and named.parts[0] == "recipes" else named
    places = {"beside the recipe": recipe.parent / named, "shipped recipes": RECIPES_DIR / shipped,
              "current directory": Path.cwd() / named}
    for path in places.values():
        if path.is_file():
            return path
    looked: Dict[Path, str] = {}  # the recipe's directory may be the current one: each path once
    for what, path in places.items():
        looked.setdefault(path, f"{path} ({what})")
    raise ShardlightError(f"base recipe '{base}' named in {recipe} not found; looked for {', '.join(looked.values())}")


def peek_ranks(path: Optional[str], overrides: List[str]) -> int:
    """The ranks per node a one-node recipe asks for (``trainer.devices``; 1 for several nodes), from the recipe
    file, its ``base:`` chain and ``trainer.*`` overrides alone, without the schema; 1 where that cannot tell
    (an unreadable file, a value that is no positive integer: ``load_recipe`` words those errors). A hint for
    starting ranks early: the loaded recipe decides."""
    trainer: Dict[str, Any] = {}
    try:
        recipe, chain, seen = Path(path) if path else DEFAULT_RECIPE, [], set()
        while recipe.resolve() not in seen and len(seen) < 32:
            seen.add(recipe.resolve())
            raw = load_yaml(recipe)
            chain.append(raw.get("trainer") if isinstance(raw.get("trainer"), dict) else {})
            if raw.get("base") is None:
                break
            recipe = find_base(str(raw["base"]), recipe.resolve())
        for section in reversed(chain):
            trainer.update(section)
    except ShardlightError:
        return 1
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("trainer.devices", "trainer.num_nodes"):
            trainer[key.split(".")[1]] = value
    devices, nodes = str(trainer.get("devices", 1)), str(trainer.get("num_nodes", 1))
    return int(devices) if devices.isdigit() and nodes == "1" and int(devices) > 0 else 1
