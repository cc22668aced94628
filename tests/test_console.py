"""The console of a default run: the wrap report, one progress bar in optimizer steps and the summary line;
none of the third-party chatter (Kineto's USDT lines from the comm window's profiler, Lightning's
litlogger tip, W&B's anonymous-setting warning, Lightning's ``Epoch 5/-2`` bar, Lightning's process-group
banners: each rank's ``Initializing distributed: GLOBAL_RANK: r, MEMBER: r+1/2`` and rank 0's
``distributed_backend=gloo ... All distributed processes registered`` block), while real warnings still show.
A real 2-rank gloo fit."""

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOISE = ("USDT", "litlogger", "anonymous setting", "/-", "Initializing distributed", "GLOBAL_RANK", "MEMBER: ",
         "distributed_backend=", "All distributed processes registered")


def test_default_run_prints_the_bar_and_none_of_the_noise(tmp_path, cli):
    summary_path = tmp_path / "summary.json"
    # W&B on (conftest: offline) and a comm window at step 2, so every source of the noise gets its chance.
    result = cli(["train", f"output_dir={tmp_path / 'runs'}", "--summary-json", str(summary_path),
                  "trainer.max_steps=6", "callbacks.comm.first_step=2", "callbacks.comm.every_n_steps=4"])
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-4000:]
    run_dir = Path(json.loads(summary_path.read_text())["run_dir"])
    assert list((run_dir / "traces" / "step_000002").glob("rank*.pt.trace.json")), "no comm window ran"
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B did not run"

    for noise in NOISE:
        assert noise not in console, (noise, console[-4000:])
    # Only Lightning's chatter is dropped: a real warning (the tiny units of this recipe) still reaches the user.
    assert "FSDP wrap: units are tiny" in console, console[-4000:]
    # tqdm redraws with \r: the bar's last state, after the window's results were gathered at the end.
    final_bar = [part for part in re.split(r"[\r\n]", result.stdout) if part.startswith("step ")][-1]
    assert re.match(r"step 6/6 \|█+\| \[.*loss=\d+\.\d{4}.*exposed comm=\d+%.*\]", final_bar), final_bar
    assert "FSDP FULL_SHARD: 3 units on 2 ranks" in console
    assert "shardlight: 6 steps, val loss" in result.stdout
