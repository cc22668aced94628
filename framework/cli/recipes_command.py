"""``shardlight recipes``: the shipped recipes as a table; ``shardlight recipes copy NAME [DEST]`` writes one to
edit. Any command that takes a recipe also takes a shipped recipe's name (``shardlight.recipe.resolve_recipe``).
"""

from __future__ import annotations

import argparse


def run_recipes(args: argparse.Namespace) -> int:
    from shardlight.recipe.catalog import catalog, copy_recipe

    if args.action == "copy":
        if not args.name:
            from shardlight.errors import ShardlightError

            raise ShardlightError("recipes copy needs a recipe name: shardlight recipes copy NAME [DEST]")
        out = copy_recipe(args.name, args.dest, force=args.force)
        print(f"shardlight: wrote {out}; train it with: shardlight train {out}")
        return 0
    rows = catalog()
    columns = ("name", "model", "strategy", "devices")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns) + "  what")
    for row in rows:  # the description last and whole: a terminal wraps it, a pipe keeps one line per recipe
        print("  ".join(row[c].ljust(widths[c]) for c in columns) + "  " + row["what"])
    print("Train one by name (shardlight train NAME), or copy it to edit: shardlight recipes copy NAME [DEST]")
    return 0


def add_parsers(subparsers) -> None:
    recipes = subparsers.add_parser(
        "recipes", help="list the shipped recipes, or copy one to edit",
        description="Without arguments: the shipped recipes (name, model, strategy, devices, what). "
                    "`copy NAME [DEST]` writes one (DEST: a file or a directory, default the current one) for "
                    "you to edit; every command also takes a shipped recipe's name where it takes a recipe file.")
    recipes.add_argument("action", nargs="?", choices=["list", "copy"], default="list")
    recipes.add_argument("name", nargs="?", help="copy: the shipped recipe's name")
    recipes.add_argument("dest", nargs="?", help="copy: where to write it (a file or a directory)")
    recipes.add_argument("--force", action="store_true", help="copy: overwrite DEST if it exists")
    recipes.set_defaults(func=run_recipes)
