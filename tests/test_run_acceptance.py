"""No rank of ``shardlight train`` starts before the recipe and the preflight accept the run (the standby ranks
that were started ahead of the preflight are gone), and building the CLI's parser imports none of the commands'
work. Real processes: the CLI's own path is run for the refusals."""

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_cli

# Every Python process started with this environment (PYTHONPATH) notes its pid here, as its first act.
SITECUSTOMIZE = "import os\nwith open({path!r}, 'a') as f:\n    f.write(str(os.getpid()) + '\\n')\n"


def _too_many_cpu_ranks():
    from shardlight.preflight import MAX_CPU_RANKS_PER_CORE, usable_cores

    return MAX_CPU_RANKS_PER_CORE * usable_cores() + 1


@pytest.mark.parametrize("case, args, fragment", [
    ("bad recipe value", ["trainer.max_steps=0"], "trainer.max_steps"),
    ("preflight refusal", ["model.config.hidden_size=130"], "hidden"),
    ("too many CPU ranks", ["trainer.devices={too_many}", "trainer.accelerator=cpu"], "CPU ranks"),
])
def test_refused_run_leaves_one_line_and_starts_no_rank(tmp_path, case, args, fragment):
    """No rank process starts before the recipe and the preflight accept the run (issue 34: ranks started
    ahead of the preflight, trainer.devices=64 on 2 cores, kept the refusal from ever printing). The default
    recipe asks for 2 ranks; each refusal is one line, exit 2, and this CLI the only Python process started."""
    site, started_log, out = tmp_path / "site", tmp_path / "started", tmp_path / "out"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=str(started_log)))
    args = [a.format(too_many=_too_many_cpu_ranks()) for a in args]
    started = time.time()
    result = run_cli(["train", f"output_dir={out}", *args], timeout=60, env={"PYTHONPATH": str(site)})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert len(started_log.read_text().split()) == 1, started_log.read_text()  # the CLI alone: no rank
    assert not out.exists()
    assert time.time() - started < 60


def test_building_the_parser_imports_none_of_the_commands_work():
    """Every command's parser is built at every start (each rank's too), so it imports none of the commands' work: not torch, nor numpy, the analyzer or the diagnosis (about 170 ms), nor
    importlib.metadata (25 ms, for the SLURM job script's version line)."""
    heavy = ["torch", "numpy", "shardlight.trace", "shardlight.diagnosis", "importlib.metadata"]
    code = ("import sys, json; from shardlight.cli.main import build_parser; build_parser(); "
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert result.stdout.strip() == "[]", (result.stdout, result.stderr)
