"""Standby ranks (``shardlight.launch.standby``): started before the launching process imports torch, held
quiet until the hand-off, gone without a word when the run is refused. Real processes throughout: a small
Python program stands in for the rank, and the CLI's own path is run for the refusals."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import DEFAULT_RECIPE, REPO, run_cli

from shardlight.launch.base import ENV_STANDBY
from shardlight.launch.standby import StandbyRanks, standby_pays
from shardlight.recipe.files import peek_ranks

# A rank: prints while it "imports" (held back until the hand-off), then what its environment says.
RANK = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from shardlight.launch.standby import serve_as_standby

    def prepare():
        print("imported", flush=True)
        print("import warning", file=sys.stderr, flush=True)

    serve_as_standby(prepare)
    print("rank", os.environ.get("LOCAL_RANK"), "role", os.environ.get("ROLE"), "standby", os.environ.get({env!r}))
""")


@pytest.fixture
def rank_command(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(repo=str(REPO), env=ENV_STANDBY))
    return [sys.executable, str(script)]


def _output(proc_out, proc_err):
    proc_out.seek(0)
    proc_err.seek(0)
    return proc_out.read().decode(), proc_err.read().decode()


def test_hand_off_gives_the_environment_and_releases_held_output(rank_command, tmp_path):
    out, err = (tmp_path / "out").open("w+b"), (tmp_path / "err").open("w+b")
    saved = os.dup(1), os.dup(2)
    try:  # the standby inherits this process's stdout/stderr: point them at files for the test
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        standby = StandbyRanks.start(3, {"PATH": os.environ["PATH"], "ROLE": "early"}, command=rank_command)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    time.sleep(1.0)  # both have "imported" by now, and printed nothing yet
    assert _output(out, err) == ("", "")
    procs = standby.hand_off({r: {"PATH": os.environ["PATH"], "LOCAL_RANK": str(r), "ROLE": "handed"}
                              for r in (1, 2)})
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    stdout, stderr = _output(out, err)
    assert stdout.count("imported\n") == 2, stdout  # held back, then written out at the hand-off
    for rank in (1, 2):  # the handed environment, the standby flag gone
        assert f"rank {rank} role handed standby None" in stdout, stdout
    assert stderr.count("import warning") == 2, stderr
    standby.cancel()  # after a hand-off: nothing to do
    assert all(p.returncode == 0 for p in procs)


def test_cancel_kills_and_end_of_input_exits(rank_command):
    standby = StandbyRanks.start(3, {"PATH": os.environ["PATH"]}, command=rank_command)
    # Rank 2's launching process "dies": its end of the pipe closes, the standby exits 0 and says nothing.
    standby.procs[2].stdin.close()
    assert standby.procs[2].wait(timeout=30) == 0
    standby.cancel()
    assert standby.procs[1].returncode is not None


def test_a_dead_standby_is_replaced_by_a_fresh_rank(rank_command, tmp_path):
    standby = StandbyRanks.start(2, {"PATH": os.environ["PATH"]}, command=rank_command + ["--unused"])
    standby.procs[1].kill()
    standby.procs[1].wait()
    [proc] = standby.hand_off({1: {"PATH": os.environ["PATH"], "LOCAL_RANK": "1", "ROLE": "fresh"}})
    assert proc is not standby.procs[1]
    assert proc.wait(timeout=30) == 0


def test_a_standby_the_launcher_does_not_start_is_killed(rank_command):
    standby = StandbyRanks.start(3, {"PATH": os.environ["PATH"]}, command=rank_command)
    procs = standby.hand_off({1: {"PATH": os.environ["PATH"], "LOCAL_RANK": "1"}})
    assert procs[0].wait(timeout=30) == 0
    assert standby.procs[2].wait(timeout=30) != 0  # killed: Lightning asked for 2 ranks after all


def test_standby_only_where_lightning_starts_the_ranks():
    assert standby_pays("local", 2, 1)
    assert not standby_pays("local", 1, 1)
    assert not standby_pays("local", 2, 2)
    assert not standby_pays("slurm", 8, 1) and not standby_pays("torchrun", 8, 1) and not standby_pays("lightning", 2, 1)


def test_peek_ranks_reads_the_chain_and_the_overrides(tmp_path):
    assert peek_ranks(None, []) == 2  # the default recipe: 2 CPU ranks
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {DEFAULT_RECIPE}\ntrainer:\n  devices: 4\n")
    assert peek_ranks(str(child), []) == 4
    assert peek_ranks(str(child), ["trainer.devices=3"]) == 3
    assert peek_ranks(str(child), ["trainer.num_nodes=2"]) == 1  # several nodes: a scheduler starts them
    assert peek_ranks(str(child), ["trainer.devices=many"]) == 1  # load_recipe words that error
    assert peek_ranks(str(tmp_path / "missing.yaml"), []) == 1
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    assert peek_ranks(str(tmp_path / "loop.yaml"), []) == 1


@pytest.mark.parametrize("case, args, fragment", [
    ("bad recipe value", ["trainer.max_steps=0"], "trainer.max_steps"),
    ("preflight refusal", ["model.config.hidden_size=130"], "hidden"),
])
def test_refused_run_leaves_one_line_and_no_standby(tmp_path, case, args, fragment):
    """The default recipe asks for 2 ranks, so rank 1 starts in standby; the refusal kills it unheard. A standby
    left behind would hold the stderr pipe open past rank 0's exit (the run would not return)."""
    started = time.time()
    result = run_cli(["train", f"output_dir={tmp_path}", *args], timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert not any(tmp_path.rglob("*"))
    assert time.time() - started < 100


def test_building_the_parser_imports_none_of_the_commands_work():
    """Every command's parser is built at every start (a standby rank's too, before it starts its imports), so it
    imports none of the commands' work: not torch, nor numpy, the analyzer or the diagnosis (about 170 ms), nor
    importlib.metadata (25 ms, for the SLURM job script's version line)."""
    heavy = ["torch", "numpy", "shardlight.trace", "shardlight.diagnosis", "importlib.metadata"]
    code = ("import sys, json; from shardlight.cli.main import build_parser; build_parser(); "
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert result.stdout.strip() == "[]", (result.stdout, result.stderr)
