"""The wheel: built from this checkout, installed (not editable) into a fresh venv, it trains the shipped default
recipe from an unrelated directory, and installs no top-level import name but ``shardlight``."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
# Folder in the repository → its package (pyproject's package-dir mapping).
PACKAGE_ROOTS = {"framework": "shardlight", "callbacks": "shardlight.callbacks", "launch": "shardlight.launch",
                 "recipes": "shardlight.recipes"}


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in PACKAGE_ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert found == listed, f"pyproject packages: missing {sorted(found - listed)}, extra {sorted(listed - found)}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of the files git would commit: what a clean clone holds, and no stale build/ dir.
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    files = subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, text=True).split()
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    # No build isolation: setuptools from this venv, so building needs no download.
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(out), str(source)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.glob("shardlight-*.whl")
    return path


def test_wheel_installs_only_the_shardlight_namespace_and_ships_the_recipes(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"shardlight"}, sorted(top)
    for shipped in ("shardlight/recipes/tiny-llama-sft.yaml", "shardlight/recipes/data/tiny_sft_train.jsonl",
                    "shardlight/recipes/assets/tiny-tokenizer/tokenizer.json", "shardlight/callbacks/comm.py",
                    "shardlight/launch/slurm.py", "shardlight/cli/main.py"):
        assert shipped in names, shipped
    assert not any(name.startswith(("tests/", "benchmarks/", "framework/")) for name in names)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed into a fresh venv; returns (its ``shardlight`` script, its site-packages, an
    environment without this checkout on the path)."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c", purelib], text=True).strip())
    # torch and the other dependencies come from this venv (a path, so its editable-install hook is not run);
    # shardlight itself only from the wheel, unpacked into the fresh venv's own site-packages, which comes first.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # This venv's pip installs into the fresh one (--python): the wheel alone, no index, console script included.
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "--no-deps", "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "SHARDLIGHT_RUN_DIR")}
    return venv / "bin" / "shardlight", site, env


def test_installed_wheel_trains_from_another_directory(installed, tmp_path):
    shardlight, site, env = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(shardlight.parent / "python"), "-c", "import shardlight; print(shardlight.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    result = subprocess.run(
        [str(shardlight), "train", "trainer.max_steps=3", "trainer.val_every_n_steps=3",
         "output_dir=runs",
         "callbacks.comm.enabled=false", "trainer.progress_bar=false"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shardlight: 3 steps" in result.stdout
    (run_dir,) = (work / "runs" / "tiny-llama-sft").iterdir()
    assert (run_dir / "model" / "config.json").is_file() and (run_dir / "summary.json").is_file()


def test_installed_wheel_names_lists_and_copies_the_shipped_recipes(installed, tmp_path):
    """From a directory outside the checkout: ``recipes`` lists every shipped recipe, ``plan`` and ``train
    --print-config`` take a shipped recipe by name, ``recipes copy`` writes a file that ``train --print-config``
    takes unchanged, a local file of the same name wins, and a second copy is refused without --force."""
    shardlight, site, env = installed
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args):
        return subprocess.run([str(shardlight), *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)

    shipped = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    listed = run("recipes")
    assert listed.returncode == 0, listed.stderr[-3000:]
    names = [line.split()[0] for line in listed.stdout.splitlines()[1:] if line and not line.startswith("Train")]
    assert names == shipped, listed.stdout
    plan = run("plan", "llama-3-8b-sft", "--gpu-memory", "80GB")
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert plan.stdout.startswith("model: llama-3-8b-sft"), plan.stdout[-2000:]
    by_name = run("train", "tiny-llama-lora", "--print-config")
    assert by_name.returncode == 0, by_name.stderr[-3000:]
    assert by_name.stdout.splitlines()[0] == f"# recipe: {site / 'shardlight' / 'recipes' / 'tiny-llama-lora.yaml'}"
    assert "method: lora" in by_name.stdout

    copied = run("recipes", "copy", "tiny-llama-sft")
    assert copied.returncode == 0, copied.stderr[-3000:]
    local = work / "tiny-llama-sft.yaml"
    shipped_config = run("train", "tiny-llama-sft.yaml", "--print-config")
    assert shipped_config.returncode == 0, shipped_config.stderr[-3000:]
    local.write_text(local.read_text().replace("max_steps: 200", "max_steps: 7"))
    for name in ("tiny-llama-sft", "tiny-llama-sft.yaml"):  # the user's file wins over the shipped one
        mine = run("train", name, "--print-config")
        assert mine.returncode == 0, mine.stderr[-3000:]
        assert mine.stdout.splitlines()[0] == f"# recipe: {local}" and "max_steps: 7" in mine.stdout
    again = run("recipes", "copy", "tiny-llama-sft")
    assert again.returncode == 2 and again.stderr.strip() == f"error: {local} exists; pass --force to overwrite it"
    assert run("recipes", "copy", "tiny-llama-sft", "--force").returncode == 0
    assert "max_steps: 200" in local.read_text()


def test_the_lock_pins_every_requirement_inside_pyprojects_ranges():
    """`make setup` installs with .ci/constraints.txt: each requirement of pyproject.toml (dev extras too) but
    torch (TORCH_SPEC's) is pinned there at a version its range allows, and neither torch nor shardlight is."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    pins = {}
    for line in (REPO / ".ci" / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        assert version, f"not a pin: {line!r}"
        pins[canonicalize_name(name)] = version
    assert not {"torch", "shardlight"} & set(pins)
    for req in required:
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"{req.name} is not pinned in .ci/constraints.txt (make lock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {req}"
