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


def test_default_run_prints_the_bar_and_none_of_the_noise(default_run):
    # W&B on (offline) and the comm windows on, so every source of the noise gets its chance.
    result, summary = default_run
    console = result.stdout + result.stderr
    run_dir = Path(summary["run_dir"])
    assert list((run_dir / "traces").glob("step_*/rank*.pt.trace.json")), "no comm window ran"
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B did not run"

    for noise in NOISE:
        assert noise not in console, (noise, console[-4000:])
    # Only Lightning's chatter is dropped: a real warning (the tiny units of this recipe) still reaches the user.
    assert "FSDP wrap: units are tiny" in console, console[-4000:]
    # tqdm redraws with \r: the bar's last state, after the window's results were gathered at the end.
    final_bar = [part for part in re.split(r"[\r\n]", result.stdout) if part.startswith("step ")][-1]
    assert re.match(r"step 200/200 \|█+\| \[.*loss=\d+\.\d{4}.*exposed comm=\d+%.*\]", final_bar), final_bar
    assert "FSDP FULL_SHARD: 3 units on 2 ranks" in console
    # Each window's line is judged as the run's verdict is: the warm-up window says so, and no line names only
    # classes the run's verdict does not (a window's line never reads as a flip).
    lines = re.findall(r"^step \d+( \(warm-up\))?: (.+?)(?::| —) ", result.stdout, flags=re.M)
    run_label = json.loads((run_dir / "diagnosis.json").read_text())["label"]
    assert lines and lines[0][0] and not any(warm for warm, _ in lines[1:]), lines
    assert all(set(label.split(" or ")) & set(run_label.split(" or ")) for _, label in lines[1:]), (lines, run_label)
    assert "shardlight: 200 steps, val loss" in result.stdout
