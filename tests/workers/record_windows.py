"""Record the profiled windows of real runs as test fixtures: ``python tests/workers/record_windows.py [CASE ...]``.

Each case is a real 2-rank gloo run of the default recipe through ``bottleneck_train.py`` (its injected
bottlenecks: a straggler, a slow input; the compute-bound case's large micro-batches), with a window every few
steps and every window's traces kept. Every window is analysed as ``shardlight diagnose`` analyses it, and the
analyses (without their timelines) go to ``tests/data/windows/<case>.json``, which
``tests/test_verdict_stability.py`` replays. Re-record after a change to the analysis's output format.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

OUT = REPO / "tests" / "data" / "windows"
RUN = ["trainer.max_steps=64", "callbacks.comm.first_step=3", "callbacks.comm.every_n_steps=6",
       "callbacks.comm.overhead_budget=null", "callbacks.comm.keep_windows=null", "callbacks.comm.warmup=1",
       "callbacks.comm.active=3", "trainer.limit_val_batches=0", "checkpoint.enabled=false",
       "export.at_end=false", "trainer.progress_bar=false", "logging.wandb.enabled=false"]
CASES = {  # case -> (overrides, environment of bottleneck_train.py)
    "default": ([], {}),
    "straggler": ([], {"SHARDLIGHT_TEST_STALL_MS": "300", "SHARDLIGHT_TEST_STALL_RANK": "1"}),
    "slow_input": ([], {"SHARDLIGHT_TEST_INPUT_DELAY_MS": "250"}),
    "compute": (["trainer.micro_batch_size=32"], {}),
}


def record(case: str) -> Path:
    from shardlight.diagnosis.run_inputs import window_dirs
    from shardlight.launch.launchers import without_run_env
    from shardlight.trace import analyze_traces

    overrides, env = CASES[case]
    with tempfile.TemporaryDirectory(prefix=f"windows-{case}-") as tmp:
        summary = Path(tmp) / "summary.json"
        result = subprocess.run(
            [sys.executable, str(REPO / "tests" / "workers" / "bottleneck_train.py"), "train",
             f"output_dir={tmp}/runs", "--summary-json", str(summary), *RUN, *overrides],
            cwd=REPO, env={**without_run_env(os.environ), **env}, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise SystemExit(f"{case}: the run failed\n{result.stderr[-3000:]}")
        run_dir = Path(json.loads(summary.read_text())["run_dir"])
        windows = []
        for step, folder in window_dirs(run_dir):
            analysis = analyze_traces(folder)
            for rank in analysis["ranks"].values():
                rank.pop("timeline", None)
                rank["steps"] = {s: {} for s in rank.get("steps", {})}  # the step numbers only
            windows.append([step, analysis])
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{case}.json"
    path.write_text(json.dumps({"case": case, "overrides": RUN + overrides, "environment": env,
                                "windows": windows}, separators=(",", ":")))
    return path


if __name__ == "__main__":
    for name in sys.argv[1:] or list(CASES):
        print(record(name))
