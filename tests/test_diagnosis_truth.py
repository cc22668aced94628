"""The verdict against known truths: real 2-rank gloo runs of the default recipe with a bottleneck built in
(tests/workers/bottleneck_train.py), each diagnosed live by the comm window and at the end of the run.

* a straggler: rank 1 computes STALL_MS more per step -> straggler-bound, naming rank 1; rank 0 waits about
  STALL_MS more per step than in the same run without the stall; the transfer itself barely changes;
* a slow input: every batch takes INPUT_MS more to load -> input-bound, input wait about INPUT_MS per step;
* communication- vs compute-bound by construction: a huge vocabulary with tiny sequences (the root unit's
  all-gathers dwarf the compute) vs the small model with large micro-batches.

One run per case; every check on a run is in one test, so each run is paid for once.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from shardlight.launch.base import without_run_env

WORKER = REPO / "tests" / "workers" / "bottleneck_train.py"
STALL_MS = 300.0
INPUT_MS = 250.0

# A short run with one comm window: steps 4..7 recorded (the last dropped, as HTA does), so 3 steps analysed.
WINDOW = ["trainer.max_steps=14", "callbacks.comm.first_step=3", "callbacks.comm.every_n_steps=1000",
          "callbacks.comm.warmup=1", "callbacks.comm.active=4", "trainer.limit_val_batches=0",
          "checkpoint.enabled=false", "export=false", "trainer.progress_bar=false", "logging.wandb.mode=offline",
          "callbacks.memory.every_n_steps=2", "callbacks.throughput.every_n_steps=2"]

pytestmark = pytest.mark.slow


def bottleneck_run(tmp: Path, *overrides, env=None):
    """Train through the worker; the run dir, its final diagnosis, and its CSV rows."""
    summary = tmp / "summary.json"
    full_env = without_run_env(os.environ)
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, str(WORKER), "train", f"output_dir={tmp / 'runs'}", "--summary-json", str(summary),
         *WINDOW, *overrides],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    run_dir = Path(json.loads(summary.read_text())["run_dir"])
    diagnosis = json.loads((run_dir / "diagnosis.json").read_text())
    import csv

    with open(run_dir / "csv" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    return run_dir, diagnosis, rows, result


def last(rows, key):
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    assert values, f"no {key} in metrics.csv"
    return values[-1]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return bottleneck_run(tmp_path_factory.mktemp("baseline"))


def test_a_straggler_is_named_and_the_others_wait_for_it(baseline, tmp_path):
    _, _, base_rows, _ = baseline
    run_dir, diagnosis, rows, result = bottleneck_run(
        tmp_path, env={"SHARDLIGHT_TEST_STALL_MS": str(STALL_MS), "SHARDLIGHT_TEST_STALL_RANK": "1"})
    assert diagnosis["verdict"] == "straggler-bound", diagnosis
    assert diagnosis["straggler_rank"] == 1
    assert last(rows, "comm/straggler_rank") == 1.0
    # rank 0 waits the stall; rank 1, which stalls, does not
    extra_wait = last(rows, "comm/rank0/wait_ms") - last(base_rows, "comm/rank0/wait_ms")
    assert STALL_MS * 0.85 <= extra_wait <= STALL_MS * 1.15, extra_wait
    assert last(rows, "comm/rank1/wait_ms") < 0.15 * STALL_MS
    # The stall lands in wait, not in transfer: the bytes move about as fast as without it. Transfer here is tens
    # of ms per step over loopback, and on a loaded 2-core machine it varies by more than 20% from run to run
    # (seen: 20 and 54 ms in two baseline runs), so the bound is 20% or a tenth of the stall, whichever is larger.
    transfer, base_transfer = last(rows, "comm/transfer_ms_mean"), last(base_rows, "comm/transfer_ms_mean")
    assert abs(transfer - base_transfer) <= max(0.2 * base_transfer, 0.1 * STALL_MS), (transfer, base_transfer)
    # the straggler's cause is its compute, not its input
    assert diagnosis["straggler_cause"] == "compute", diagnosis
    assert "straggler-bound" in result.stdout  # the window's line and the end panel


def test_a_slow_input_is_input_bound(tmp_path):
    run_dir, diagnosis, rows, _ = bottleneck_run(tmp_path, env={"SHARDLIGHT_TEST_INPUT_DELAY_MS": str(INPUT_MS)})
    assert diagnosis["verdict"] == "input-bound", diagnosis
    for rank in (0, 1):
        wait = last(rows, f"input/rank{rank}/wait_ms")
        assert INPUT_MS * 0.85 <= wait <= INPUT_MS * 1.15, (rank, wait)


def test_huge_vocabulary_tiny_sequences_is_communication_bound(tmp_path):
    _, diagnosis, rows, _ = bottleneck_run(
        tmp_path, "model.config.vocab_size=65536", "data.seq_len=16", "trainer.micro_batch_size=1")
    assert diagnosis["verdict"] == "communication-bound", diagnosis
    assert last(rows, "comm/exposed_transfer_ms") > last(rows, "comm/exposed_wait_ms")


def test_small_model_large_batches_is_compute_bound(tmp_path):
    _, diagnosis, _, _ = bottleneck_run(tmp_path, "trainer.micro_batch_size=32")
    assert diagnosis["verdict"] == "compute-bound", diagnosis
