"""RunContext and the launchers: who a process is, decided from the environment at the process edge only."""

import re
from pathlib import Path

from shardlight.launch import detect_launcher
from shardlight.launch.launchers import ENV_RESUME_FROM, ENV_RUN_DIR, ENV_WANDB_RUN_ID, without_run_env
from shardlight.run_context import RunContext

REPO = Path(__file__).resolve().parents[1]


def test_a_shell_process_decides_everything_itself():
    ctx = RunContext.from_env({ENV_RESUME_FROM: "/old/ckpt", "PATH": "/bin"})
    assert (ctx.launcher, ctx.rank, ctx.launched) == ("local", 0, False)
    # A stale decision in the shell's environment is not inherited by a process nobody launched.
    assert not ctx.resume_decided and ctx.resume_from is None and ctx.run_dir is None


def test_ranks_inherit_the_parents_decisions_and_round_trip():
    parent = RunContext(run_dir=Path("/runs/x"), resume_from=None, resume_decided=True, wandb_run_id="abc")
    child = RunContext.from_env({**parent.to_env(), "LOCAL_RANK": "1", "RANK": "1"})
    assert (child.launcher, child.rank, child.launched) == ("lightning", 1, True)
    assert child.run_dir == Path("/runs/x") and child.resume_decided and child.resume_from is None
    assert child.wandb_run_id == "abc"
    resumed = RunContext.from_env({**parent.replace(resume_from=Path("/c/step-4")).to_env(), "LOCAL_RANK": "0"})
    assert resumed.resume_from == Path("/c/step-4")


def test_slurm_and_torchrun_tasks():
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "3", ENV_WANDB_RUN_ID: "slurm-77"}
    ctx = RunContext.from_env(env)
    assert (ctx.launcher, ctx.rank, ctx.launched, ctx.job_id) == ("slurm", 3, True, "77")
    assert detect_launcher(env).run_dir_name(ctx.job_id) == "slurm-77"
    run = RunContext.from_env({"TORCHELASTIC_RUN_ID": "r9", "LOCAL_RANK": "0", "RANK": "2"})
    assert (run.launcher, run.rank) == ("torchrun", 2)
    assert detect_launcher({"TORCHELASTIC_RUN_ID": "r9"}).run_dir_name(run.job_id) == "torchrun-r9"


def test_a_new_run_started_from_a_rank_gets_none_of_its_variables():
    env = without_run_env({ENV_RUN_DIR: "/r", ENV_RESUME_FROM: "", "LOCAL_RANK": "1", "HOME": "/h"})
    assert env == {"HOME": "/h"}


def test_shardlight_variables_are_named_in_one_module():
    """Environment variables belong at process boundaries, named once (launch/launchers.py)."""
    offenders = []
    for folder in ("framework", "callbacks", "launch"):
        for path in (REPO / folder).rglob("*.py"):
            if path == REPO / "launch" / "launchers.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"SHARDLIGHT_[A-Z_]+", line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
