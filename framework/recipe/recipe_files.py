"""Recipe files as YAML, before the schema: where the shipped recipes are, reading one file, finding a ``base:``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

import yaml

import shardlight.recipes
from shardlight.errors import ShardlightError

# The recipes ship inside the package (shardlight.recipes), so this is right for a wheel and a checkout alike.
RECIPES_DIR = Path(shardlight.recipes.__file__).resolve().parent
DEFAULT_RECIPE = RECIPES_DIR / "tiny-llama-sft.yaml"


def shipped_names() -> List[str]:
    """The shipped recipes' names (file stems), sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def shipped_recipe(name: str) -> Optional[Path]:
    """The shipped recipe ``name`` (with or without ``.yaml``; ``recipes/NAME`` as the repo spells it means the
    same), or None."""
    named = Path(name)
    if len(named.parts) == 2 and named.parts[0] == "recipes":
        named = Path(named.parts[1])
    if len(named.parts) != 1:
        return None
    for candidate in (named.name, named.name + ".yaml"):
        path = RECIPES_DIR / candidate
        if candidate.endswith(".yaml") and path.is_file():
            return path
    return None


def resolve_recipe(name: str) -> Path:
    """A recipe argument → its file: the file the user names (or ``NAME.yaml``) when it exists, since a user's
    file always wins, else the shipped recipe of that name; one error listing the shipped names otherwise."""
    path = Path(os.path.expanduser(name))
    for local in (path, path.with_name(path.name + ".yaml")):
        if local.is_file():
            return local
    shipped = shipped_recipe(name)
    if shipped is not None:
        return shipped
    if len(Path(name).parts) > 1:  # a path, not a name: the file is what is missing
        raise ShardlightError(f"recipe file not found: {path}")
    raise ShardlightError(f"recipe file not found: {path.resolve()}, and no shipped recipe is named "
                          f"'{path.stem}'; shipped recipes: {', '.join(shipped_names())} (`shardlight recipes`)")


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
