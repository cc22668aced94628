"""What every command's parsing shares: recipe-plus-overrides words, number and on/off options, JSON out."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from shardlight.errors import ShardlightError
from shardlight.files import write_json  # noqa: F401  (re-exported: the commands' --json outputs)


def add_recipe_items(parser: Any) -> None:
    parser.add_argument("items", nargs="*", metavar="[RECIPE] [key=value ...]", help="recipe file, then overrides")


def split_recipe_and_overrides(items: List[str]) -> Tuple[Optional[str], List[str]]:
    """``[RECIPE] key=value ...`` → (recipe path or None for the default recipe, overrides)."""
    recipe, overrides = None, []
    for index, item in enumerate(items):
        if index == 0 and "=" not in item:
            recipe = item
        elif "=" not in item:
            raise ShardlightError(f"'{item}' is not an override of the form key.path=value")
        else:
            overrides.append(item)
    return recipe, overrides


def parse_number(name: str, value: Optional[str], kind=int, positive: bool = True) -> Any:
    """An option's text → int/float, or one clear error naming the option."""
    if value is None:
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ShardlightError(f"{name} must be a{'n integer' if kind is int else ' number'}, got '{value}'") from None
    if positive and not number > 0:
        raise ShardlightError(f"{name} must be positive, got {value}")
    return number


def parse_on_off(name: str, value: Optional[str]) -> Optional[bool]:
    if value is None or value == "auto":
        return None
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise ShardlightError(f"{name} must be on, off or auto, got '{value}'")
