"""The shipped recipes as a catalog: ``shardlight recipes`` lists them (name, model, strategy, devices, what it
is, from the recipe's own first comment), ``shardlight recipes copy`` writes one for the user to edit, as
torchtune's ``tune ls`` / ``tune cp`` and LitGPT's ``config_hub``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import yaml

from shardlight.errors import ShardlightError
from shardlight.recipe.load import load_recipe, read_recipe_file
from shardlight.recipe.recipe_files import RECIPES_DIR, shipped_names, shipped_recipe


def opening_comments(path: Path) -> List[str]:
    """The comment lines a recipe file opens with."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def describe(path: Path) -> str:
    """A recipe's first sentence, from the comment block it opens with."""
    text = " ".join(line.lstrip("# ").strip() for line in opening_comments(path))
    return text.split(". ", 1)[0].rstrip(".") if text else ""


def catalog() -> List[Dict[str, str]]:
    """One row per shipped recipe: name, model, strategy, devices, what."""
    rows = []
    for name in shipped_names():
        path = RECIPES_DIR / f"{name}.yaml"
        cfg = load_recipe(str(path))
        model = cfg.model.name_or_path or f"{(cfg.model.config or {}).get('model_type', '?')} (inline config)"
        fsdp, t = cfg.fsdp, cfg.trainer
        strategy = f"FSDP{fsdp.fsdp_version} {fsdp.sharding_strategy}"
        if cfg.parallelism.tp_size > 1:
            strategy += f" x TP {cfg.parallelism.tp_size}"
        if cfg.peft.method:
            strategy += f" + {cfg.peft.method.upper() if cfg.peft.method == 'qlora' else 'LoRA'}"
        devices = f"{t.num_nodes} x {t.devices} {t.accelerator}" if t.num_nodes > 1 else f"{t.devices} {t.accelerator}"
        rows.append({"name": name, "model": model, "strategy": strategy, "devices": devices,
                     "what": describe(path)})
    return rows


def copy_recipe(name: str, dest: Optional[str] = None, force: bool = False) -> Path:
    """Write the shipped recipe ``name`` to ``dest`` (a file, or a directory to put ``NAME.yaml`` in; default:
    the current directory) for the user to edit: its ``base:`` stays the shipped name (a file of that name
    beside the copy would win, as for any recipe), its relative paths (data, tokenizer) point into the installed
    package, its opening comments are kept. Refuses to overwrite a file without ``force``."""
    source = shipped_recipe(name)
    if source is None:
        raise ShardlightError(f"no shipped recipe is named '{name}'; shipped recipes: {', '.join(shipped_names())}")
    out = Path(dest).expanduser() if dest else Path.cwd()
    if out.is_dir() or (dest or "").endswith("/"):
        out = out / source.name
    if out.exists() and not force:
        raise ShardlightError(f"{out} exists; pass --force to overwrite it")
    raw = read_recipe_file(source)
    head = opening_comments(source)
    head.append(f"# Copied from the shipped recipe {source.stem} by `shardlight recipes copy`: its relative paths "
                "now point into the installed package.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(head) + "\n" + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None))
    return out.resolve()
