"""gpu_check.sh's set-up check, run with the machine's python3 once the carried wheels and the project tree are on
its path (PYTHONPATH): are the wheels one version each, are their requirements there, do wandb, omegaconf and
datasets import (and work a little), does shardlight import from the laid-out tree, do the recipes the GPU steps
run load with their overrides, does the training stack import. Needs no GPU. Prints what it found and
``SETUP OK``, or the problems and exits 1.

    python3 benchmarks/gpu/setup_check.py --wheels .whl --site SITE/lib --tree SITE/src \
        [--overrides FILE ...] [--skip-carried-imports] [--wandb-run]

``--overrides FILE``: a recipe (first line, ``-`` for the default) and one override a line, as a GPU step runs it.
``--skip-carried-imports``: this interpreter is not the wheels' (CPython 3.12): they are not imported.
``--skip-project``: this interpreter has no torch: the tree, the recipes and the training stack are not checked
(a rehearsal checks them with another python).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import re
import sys
import tempfile
import time
from pathlib import Path

CARRIED_IMPORTS = {"wandb": "wandb", "omegaconf": "omegaconf", "datasets": "datasets", "pydantic": "pydantic"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_names(wheels: Path, problems: list) -> dict:
    """Distribution name -> wheel files; two versions of one name stop the machine's install."""
    found: dict = {}
    for path in sorted(wheels.glob("*.whl")):
        found.setdefault(norm(path.name.split("-")[0]), []).append(path.name)
    if not found:
        problems.append(f"no wheels in {wheels} (run benchmarks/gpu/fetch_wheels.sh where pip reaches a registry)")
    for name, files in found.items():
        if len(files) > 1:
            problems.append(f"{name}: {len(files)} wheels ({', '.join(files)}); keep one")
    return found


def requirement_problems(site: Path, problems: list, notes: list) -> None:
    """Every requirement of every carried distribution (markers evaluated here) is installed somewhere on the
    path; a version outside its specifier is a note (it may still work), a missing one a problem."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries one
        from pip._vendor.packaging.requirements import Requirement
    for dist in md.distributions(path=[str(site)]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                if norm(req.name) == "torch":  # a rehearsal's python without torch; the machine has torch 2.11
                    notes.append(f"{dist.metadata['Name']} needs {req}: not installed here (the machine has it)")
                else:
                    problems.append(f"{dist.metadata['Name']} needs {req}, which is neither carried nor installed")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                notes.append(f"{dist.metadata['Name']} asks {req}; {req.name} {version} is installed")


def check_carried_imports(site: Path, problems: list, found: dict) -> None:
    for dist, module in CARRIED_IMPORTS.items():
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
            continue
        where = Path(mod.__file__).resolve()
        found[module] = f"{md.version(dist)} ({'carried' if where.is_relative_to(site.resolve()) else where.parent})"


def check_project(tree: Path, problems: list, found: dict) -> None:
    """shardlight from the tree the script laid out, not from an installed copy; its recipe layer imports
    (which needs Lightning, hence torch)."""
    try:
        import shardlight
        import shardlight.recipe  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        problems.append(f"import shardlight.recipe: {type(exc).__name__}: {exc}")
        return
    if not Path(shardlight.__file__).resolve().is_relative_to(tree.resolve()):
        problems.append(f"shardlight imports from {shardlight.__file__}, not from the tree {tree}")
    found["shardlight"] = str(Path(shardlight.__file__).parent)


def check_recipes(override_files: list, problems: list, found: dict) -> None:
    from shardlight.recipe import load_recipe

    for path in override_files:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        recipe, overrides = (None if lines[0] == "-" else lines[0]), lines[1:]
        try:
            cfg = load_recipe(recipe, overrides)
            found[f"recipe {Path(path).name}"] = f"{cfg.name}: {cfg.trainer.accelerator} x{cfg.trainer.devices}, " \
                                               f"{cfg.trainer.precision}, {cfg.trainer.max_steps} steps"
        except Exception as exc:  # noqa: BLE001
            problems.append(f"recipe {recipe or '(default)'} with {Path(path).name}'s overrides: {exc}")


def check_runtime(problems: list, found: dict, wandb_run: bool) -> None:
    """The carried packages doing a little work: a datasets table, an offline W&B run (its service binary)."""
    import datasets

    table = datasets.Dataset.from_dict({"text": ["a", "b"]}).map(lambda row: {"n": len(row["text"])})
    if table["n"] != [1, 1]:
        problems.append(f"datasets map gave {table['n']}")
    if wandb_run:
        import wandb

        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            run = wandb.init(mode="offline", dir=tmp, project="gpu-check-setup")
            run.log({"x": 1.0})
            run.finish()
        found["wandb offline run"] = f"{time.perf_counter() - start:.1f}s"


def check_torch_stack(problems: list, found: dict) -> None:
    """With torch: the training stack imports (Lightning, transformers, peft, accelerate through shardlight)."""
    import torch

    found["torch"] = f"{torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}"
    for module in ("shardlight.cli.main", "shardlight.train", "shardlight.callbacks", "accelerate", "peft"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    try:
        import bitsandbytes

        found["bitsandbytes"] = bitsandbytes.__version__
    except Exception as exc:  # noqa: BLE001 - QLoRA only; a note where there is no GPU
        (problems if torch.cuda.is_available() else []).append(f"import bitsandbytes: {exc}")
        found["bitsandbytes"] = f"import failed: {type(exc).__name__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--site", type=Path, required=True, help="where the wheels were installed (--target)")
    parser.add_argument("--tree", type=Path, required=True, help="the folder holding the shardlight tree")
    parser.add_argument("--overrides", action="append", default=[])
    parser.add_argument("--skip-carried-imports", action="store_true")
    parser.add_argument("--skip-project", action="store_true")
    parser.add_argument("--wandb-run", action="store_true")
    args = parser.parse_args()

    problems: list = []
    notes: list = []
    found: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    found["wheels"] = len(wheel_names(args.wheels, problems))
    carried, project = not args.skip_carried_imports, not args.skip_project
    if carried:
        requirement_problems(args.site, problems, notes)
        check_carried_imports(args.site, problems, found)
        if not problems:
            check_runtime(problems, found, args.wandb_run)
    if project:
        check_project(args.tree, problems, found)
        if not problems:
            check_recipes(args.overrides, problems, found)
            check_torch_stack(problems, found)

    for key, value in found.items():
        print(f"  {key}: {value}")
    for note in notes:
        print(f"  note: {note}")
    if not carried:
        print(f"  note: the carried wheels were not imported by this python ({found['python']})")
    if not project:
        print("  note: the project tree and the recipes were not checked by this python")
    if problems:
        print("SETUP FAILED: " + "; ".join(problems))
        return 1
    print("SETUP OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
