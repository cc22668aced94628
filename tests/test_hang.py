"""A stuck run is named: the hang watchdog (``callbacks.hang``) and the flight-recorder verdict
(``shardlight.diagnosis.hang_verdict``), on real gloo runs where one rank is made to stop short of an FSDP all-gather,
and on dumps in the format torch's NCCL watchdog writes."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
from conftest import DEFAULT_RECIPE, REPO

from shardlight.cli.main import main
from shardlight.diagnosis.hang_verdict import hang_report
from shardlight.launch.launchers import without_run_env

HANG_WORKER = REPO / "tests" / "workers" / "hang_train.py"
AFTER_S, GRACE_S = 6, 5


# --- dumps as torch's NCCL watchdog writes them (TORCH_FR_DUMP_TEMP_FILE=<dir>/rank_) ------------------------

def _entry(record, group, desc, seq, op, size, finished, dtype="BFloat16"):
    return {"record_id": record, "pg_id": int(group), "process_group": (group, desc), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": record,
            "input_sizes": [[size]], "input_dtypes": [dtype], "output_sizes": [[size]], "output_dtypes": [dtype],
            "state": "completed" if finished else "started", "retired": finished, "timeout_ms": 600000,
            "is_p2p": False, "frames": []}


def _write_nccl_dump(folder, rank, groups, entries):
    pg_config = {name: {"name": name, "desc": desc, "ranks": str(members)} for name, (desc, members) in groups.items()}
    with open(folder / f"rank_{rank}", "wb") as fh:
        pickle.dump({"version": "2.10", "pg_config": pg_config, "pg_status": {}, "entries": entries}, fh)


def test_a_tp_hang_behind_an_fsdp_wait_is_named_in_the_tp_group(tmp_path):
    """4 ranks, TP 2 x FSDP 2, groups made by split_group (one name for disjoint sets of ranks). Rank 3 never
    enters the tensor-parallel all-reduce #5 rank 2 waits in; ranks 0 and 1 wait in FSDP all-gather #8 for ranks
    2 and 3. The end of that chain is the TP collective and rank 3, not the FSDP all-gather the most ranks sit in."""
    shard = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    tp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank in range(4):
        groups = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("mesh_dp_shard", shard[rank]), "2": ("mesh_tp", tp[rank])}
        entries = [_entry(1, "1", "mesh_dp_shard", 7, "_allgather_base", 4096, True),
                   _entry(2, "2", "mesh_tp", 4, "allreduce", 1024, True)]
        if rank in (0, 1):
            entries += [_entry(3, "2", "mesh_tp", 5, "allreduce", 1024, True),
                        _entry(4, "1", "mesh_dp_shard", 8, "_allgather_base", 4096, False)]
        elif rank == 2:
            entries += [_entry(3, "2", "mesh_tp", 5, "allreduce", 1024, False)]
        _write_nccl_dump(tmp_path, rank, groups, entries)
    verdict = hang_report(tmp_path)
    assert verdict.kind == "missing", verdict.lines
    assert (verdict.culprits, verdict.waiting, verdict.collective) == ([3], [2], "allreduce #5")
    assert verdict.group == "the tensor-parallel group (mesh_tp: ranks 2, 3)"
    assert verdict.error.startswith("error: rank 3 never entered allreduce #5 of the tensor-parallel group")

    out = tmp_path / "verdict.json"  # the CLI reads a bare folder of dumps as well as a run directory
    assert main(["diagnose", str(tmp_path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["hang"] == verdict.to_dict()


def test_a_collective_mismatch_names_both_calls(tmp_path):
    """Both ranks are in collective #3 of the default group, with other sizes: a mismatch, with both sizes."""
    groups = {"0": ("default_pg", [0, 1])}
    done = [_entry(1, "0", "default_pg", 1, "allreduce", 8, True), _entry(2, "0", "default_pg", 2, "allreduce", 8, True)]
    _write_nccl_dump(tmp_path, 0, groups, done + [_entry(3, "0", "default_pg", 3, "_allgather_base", 1000, False)])
    _write_nccl_dump(tmp_path, 1, groups, done + [_entry(3, "0", "default_pg", 3, "_allgather_base", 2000, False)])
    verdict = hang_report(tmp_path)
    assert verdict.kind == "mismatch", verdict.lines
    assert verdict.culprits == [1] and verdict.waiting == [0]
    assert "rank 0: _allgather_base [[1000]]; rank 1: _allgather_base [[2000]]" in verdict.error


def test_the_limit_follows_the_step_time_and_stays_below_the_collective_timeout(tmp_path):
    from shardlight.callbacks.hang import HangWatchdog
    from shardlight.recipe.instrument_sections import HangConfig

    watchdog = HangWatchdog(HangConfig(min_after_s=60, grace_s=20), tmp_path, collective_timeout_s=1800)
    assert watchdog.limit_s() == 300  # until 3 steps have finished: 5 x min_after_s (warm-up, compilation)
    watchdog.steps = [1.0, 30.0, 2.0, 2.0]
    assert watchdog.limit_s() == 60  # 10 x the median step (2 s), at least min_after_s
    watchdog.steps = [12.0, 12.0, 15.0]
    assert watchdog.limit_s() == 120
    watchdog.steps = [400.0] * 3
    assert watchdog.limit_s() == 1800 - 20 - 5  # acts before torch's timeout ends the run unnamed
    assert HangWatchdog(HangConfig(after_s=7), tmp_path, 1800).limit_s() == 7


def test_an_after_s_torch_would_beat_is_refused():
    from shardlight.errors import ShardlightError
    from shardlight.recipe import load_recipe

    with pytest.raises(ShardlightError, match=r"^callbacks.hang.after_s=50 plus callbacks.hang.grace_s=20 must be "
                                              r"below trainer.collective_timeout_s=60"):
        load_recipe(str(DEFAULT_RECIPE), ["callbacks.hang.after_s=50", "trainer.collective_timeout_s=60"])
    load_recipe(str(DEFAULT_RECIPE), ["callbacks.hang.after_s=50", "callbacks.hang.enabled=false",
                                      "trainer.collective_timeout_s=60"])


# --- real runs: 2 gloo ranks, rank 1 stuck just before an FSDP all-gather at step 3 ------------------------

def _still_running(pids, within_s=10.0):
    """The pids that are still running (not gone, not a zombie awaiting its reaper) after ``within_s``."""
    import psutil

    deadline = time.time() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("action, fsdp_version", [("block", 1), ("stop", 2), ("raise", 1)])
def test_a_rank_stuck_before_an_all_gather_is_named(tmp_path, action, fsdp_version):
    """``block``: rank 1's main thread waits forever before layer 1's all-gather (a deadlock, a stuck loader):
    it dumps, and the verdict names it as never having entered the all-gather rank 0 waits in, with its stack.
    ``stop``: rank 1 SIGSTOPs itself there: no dump; named as stopped responding in that all-gather.
    ``raise``: rank 1 raises there: its exception is the run's one line, not rank 0's dead peer.
    Each within after_s + grace_s + 30 s of the fault, exit 1, one ``error:`` line, no traceback, no process
    left, and for a hang ``shardlight diagnose RUN_DIR`` gives the same verdict."""
    marks, runs = tmp_path / "marks", tmp_path / "runs"
    env = without_run_env(os.environ)
    env.update(PYTHONPATH=str(REPO), HANG_MARKS=str(marks), HANG_INJECT=f"1:{action}", HANG_STEP="3")
    command = [sys.executable, str(HANG_WORKER), "train", str(DEFAULT_RECIPE), f"output_dir={runs}",
               "callbacks.comm.enabled=false", "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false",
               "logging.wandb.enabled=false", "trainer.progress_bar=false", "trainer.max_steps=1000",
               f"fsdp.fsdp_version={fsdp_version}", f"callbacks.hang.after_s={AFTER_S}",
               f"callbacks.hang.grace_s={GRACE_S}", "trainer.collective_timeout_s=120"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=400)
    finally:
        proc.kill()
    ended = time.time()
    pids = [int(p.read_text()) for p in marks.glob("rank*.pid")]
    leftover = _still_running(pids)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert (marks / "stuck").is_file(), stderr[-3000:]  # rank 1 got where it was meant to
    assert ended - (marks / "stuck").stat().st_mtime < AFTER_S + GRACE_S + 30
    assert proc.returncode == 1, stderr[-3000:]
    assert not leftover, leftover
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    run_dir = next(runs.glob("*/*/flight_recorder")).parent
    if action == "raise":
        assert errors[0].startswith("error: rank 1: ValueError: injected on rank 1 at step 3 (at "), errors
        assert "in stuck_before_the_all_gather); traceback in " in errors[0]
        traceback = (run_dir / "flight_recorder" / "exception_rank_1.txt").read_text()
        assert traceback.startswith("Traceback") and "ValueError: injected on rank 1 at step 3" in traceback
        assert not list((run_dir / "flight_recorder").glob("rank_*"))  # an exception, not a hang
        return
    if action == "block":
        assert errors[0].startswith("error: rank 1 never entered all_gather"), errors
        assert "in stuck_before_the_all_gather" in stderr  # rank 1's stack, where it is
    else:
        assert errors[0].startswith("error: rank 1 stopped responding in all_gather"), errors
    assert "which rank 0 waits in" in errors[0] or "rank 0 waits in it" in errors[0]

    verdict = json.loads((run_dir / "flight_recorder" / "verdict.json").read_text())
    assert verdict["culprits"] == [1] and verdict["waiting"] == [0]
    assert verdict["kind"] == ("missing" if action == "block" else "stopped")
    # The collective is the one after rank 1's last: rank 1 stopped right before issuing it.
    dumps = {p.name: pickle.loads(p.read_bytes()) for p in (run_dir / "flight_recorder").glob("rank_*")}
    waiting = next(e for e in dumps["rank_0"]["entries"] if not e["retired"])
    assert verdict["collective"] == f"all_gather #{waiting['collective_seq_id']}"
    if action == "block":
        assert max(e["collective_seq_id"] for e in dumps["rank_1"]["entries"]) == waiting["collective_seq_id"] - 1

    out = tmp_path / "diagnose.json"
    result = subprocess.run([sys.executable, "-m", "shardlight.cli", "diagnose", str(run_dir), "--json", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["hang"] == verdict


@pytest.mark.slow
def test_a_slow_start_is_not_a_collective_timeout(tmp_path):
    """The ranks meet under trainer.startup_timeout_s, not the collective timeout: rank 1 starts 20 s late with
    collective_timeout_s=10 and the run trains. (That a collective still gives up after collective_timeout_s,
    on every group, is what the SIGSTOP tests of tests/test_checkpoint.py see.)"""
    env = without_run_env(os.environ)
    env.update(PYTHONPATH=str(REPO), LATE_RANK_S="20")
    worker = REPO / "tests" / "workers" / "late_rank_train.py"
    result = subprocess.run(
        [sys.executable, str(worker), "train", str(DEFAULT_RECIPE), f"output_dir={tmp_path}",
         "callbacks.comm.enabled=false", "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false",
         "logging.wandb.enabled=false", "trainer.progress_bar=false", "trainer.max_steps=2",
         "trainer.limit_val_batches=0", "export.at_end=false", "trainer.collective_timeout_s=10",
         "trainer.startup_timeout_s=120"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shardlight: 2 steps" in result.stdout


@pytest.mark.slow
def test_a_tp_hang_on_four_gloo_ranks_names_the_tp_group(tmp_path):
    """Real dumps (tests/workers/tp_groups_worker.py hang): dp_shard 2 x tp 2 on 4 gloo ranks; rank 3 stops before
    the RowwiseParallel layer, rank 2 waits in their TP all-reduce, ranks 0 and 1 in FSDP's reduce-scatter (gloo
    runs it as an all-reduce) of their shard groups. The verdict is the TP group and rank 3, with its stack."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = REPO / "tests" / "workers" / "tp_groups_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(tmp_path), str(port), "hang"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, KINETO_LOG_LEVEL="6", PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = hang_report(tmp_path / "flight_recorder")
    assert verdict.kind == "missing", verdict.lines
    assert (verdict.culprits, verdict.waiting) == ([3], [2])
    assert verdict.group == "the tensor-parallel group (mesh_tp: ranks 2, 3)"
    assert verdict.collective.startswith("all_reduce #")
    text = "\n".join(verdict.lines)
    assert "rank 0: waiting in all_reduce" in text and "of the FSDP shard group (mesh_dp_shard: ranks 0, 2)" in text
    assert "register_forward_pre_hook" in text  # rank 3's stack: where it stopped
