"""The verdict against known truths: real 2-rank gloo runs of the default recipe with a bottleneck built in
(tests/workers/bottleneck_train.py), each diagnosed live by the comm window and at the end of the run.

* a straggler: rank 1 computes STALL_MS more per step -> straggler-bound, naming rank 1; rank 0 waits about
  STALL_MS more per step than in the same run without the stall; the transfer itself barely changes;
* a slow input: every batch takes INPUT_MS more to load -> input-bound, input wait about INPUT_MS per step;
* a costly window: every rank sleeps WINDOW_COST_MS when the second of two alike comm windows stops -> its
  measured cost (``comm/window_cost_ms``, what spaces the next window under ``overhead_budget``) holds the
  sleep in full, clearly above the alike window's, and each next window start follows the budget's rule from
  the logged cost;
* communication- vs compute-bound by construction: a huge vocabulary with tiny sequences (the root unit's
  all-gathers dwarf the compute) vs the small model with large micro-batches.

One run per case; every check on a run is in one test, so each run is paid for once.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from shardlight.launch.launchers import without_run_env

WORKER = REPO / "tests" / "workers" / "bottleneck_train.py"
STALL_MS = 300.0
INPUT_MS = 250.0
WINDOW_COST_MS = 2000.0

# A short run with one comm window: steps 4..7 recorded (the last dropped, as HTA does), so 3 steps analysed.
WINDOW = ["trainer.max_steps=14", "callbacks.comm.first_step=3", "callbacks.comm.every_n_steps=1000",
          "callbacks.comm.warmup=1", "callbacks.comm.active=4", "trainer.limit_val_batches=0",
          "checkpoint.enabled=false", "export.checkpoint=false", "trainer.progress_bar=false", "logging.wandb.enabled=false",
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
    # The stall lands in wait, not in transfer: the transfer does not grow by it. Transfer here is tens of ms per
    # step over loopback and varies severalfold between runs on a loaded 2-core machine (seen in baseline runs:
    # 20, 54 and 86 ms; the last against 19 ms in the stall run), so the bound is one-sided: 20% or a tenth of the
    # stall, whichever is larger. Transfer mistaken for wait the other way shows in the wait checks above
    # (rank 1's wait under 0.15 of the stall, rank 0's extra wait within 0.15 of it).
    transfer, base_transfer = last(rows, "comm/transfer_ms_mean"), last(base_rows, "comm/transfer_ms_mean")
    assert transfer - base_transfer <= max(0.2 * base_transfer, 0.1 * STALL_MS), (transfer, base_transfer)
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
    # 7 analysed steps (active 8), so that one step another process slowed is a small part of the window.
    _, diagnosis, _, _ = bottleneck_run(tmp_path, "trainer.micro_batch_size=32", "callbacks.comm.active=8")
    shares = diagnosis["shares"]
    assert diagnosis["steps"] == 7 and shares["exposed_transfer_pct"] < 15, diagnosis
    if diagnosis["verdict"] == "straggler-bound":
        # Both ranks share this machine's 2 cores with everything else it runs: when other load slows one rank's
        # compute for the window, that rank is a real straggler, and then the verdict must say so and why -- the
        # rank whose measured compute is the slower by the straggler threshold or more (the truth built in here,
        # balanced ranks with hidden communication, is then not what ran). Wait that both ranks do alike (40
        # and 58 ms of a 374 ms step in one run here) is not a straggler's and must not make one.
        evidence = diagnosis["evidence"]
        compute = {int(r): s["compute_total_ms"] for r, s in diagnosis["split_by_rank"].items()}
        assert evidence["cause"] == "compute" and evidence["compute_slower_pct"] >= 10, diagnosis
        assert diagnosis["straggler_rank"] == max(compute, key=compute.get), diagnosis
    else:
        assert diagnosis["verdict"] == "compute-bound", diagnosis


def test_a_window_that_costs_more_is_measured_and_spaces_the_next(tmp_path):
    # Windows at 4, 40 and 60 of one run, all recording shapes; every rank sleeps in the last one only. Each
    # cost is agreed 8 steps after its gather (22, 58, 78), so no window starts before the last one's cost is
    # known (none at 20), and the budget puts the third at 60 (40's cost is well under 0.5 x 20 typical steps).
    # The first window pays the profiler's one-time start-up, so the costly window is compared with the second.
    _, _, rows, _ = bottleneck_run(
        tmp_path, "trainer.max_steps=80", "callbacks.comm.first_step=4", "callbacks.comm.every_n_steps=20",
        "callbacks.comm.overhead_budget=0.5", "callbacks.comm.record_shapes=true", "callbacks.comm.judged_windows=1",
        env={"SHARDLIGHT_TEST_WINDOW_COST_MS": str(WINDOW_COST_MS), "SHARDLIGHT_TEST_WINDOW_COST_FROM_STEP": "50"})
    starts = values_of(rows, "comm/window_start_step")
    assert starts == [4.0, 40.0, 60.0] and values_of(rows, "comm/cost_window_start_step") == starts
    first, plain, costly = values_of(rows, "comm/window_cost_ms")
    # The sleep is wall time on every rank's training thread, so the costly window's cost is the sleep plus its own
    # cost. A window's own cost is not a constant: its analysis thread takes the GIL from the training thread
    # for a whole step in one window and interleaves with three steps in the next (in one run the plain window
    # cost 758 ms and the costly one 471 ms above its sleep; 424 to 1175 ms on a day this machine ran Python 2x
    # slower). So the sleep must be read in full (0.9 of it: the typical step's error times the window's 10
    # steps), clearly above an alike window (by half the sleep), and at most the sleep plus 1.5x the largest own
    # cost the other two windows showed plus a fifth of the sleep. Not counting the sleep, or counting it twice,
    # fails.
    assert costly >= WINDOW_COST_MS * 0.9 and costly - plain >= WINDOW_COST_MS * 0.5, (first, plain, costly)
    assert costly - WINDOW_COST_MS <= 1.5 * max(first, plain) + WINDOW_COST_MS * 0.2, (first, plain, costly)
    for start, cost_ms, typical_ms, next_step in zip(starts, values_of(rows, "comm/window_cost_ms"),
                                                      values_of(rows, "comm/typical_step_ms"),
                                                      values_of(rows, "comm/next_window_step")):
        # budget 0.5: the next starts cost / (0.5 x typical step) steps later or more, on a multiple of 20
        earliest = start + max(1, math.ceil(cost_ms / (0.5 * typical_ms) - 1e-9))
        assert next_step == 20 * math.ceil(earliest / 20), (start, cost_ms, typical_ms, next_step)
    assert 0 < values_of(rows, "comm/overhead_pct")[-1] < 100


def values_of(rows, key):
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]
