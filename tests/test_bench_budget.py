"""The timing benchmarks' bounds: ``--budget-s`` bounds the wall time (about the budget plus one pair, even
below ``min_pairs``), progress prints as each run ends, a hung run tree is killed, and the CPU (gloo)
benchmarks keep their ranks off a visible GPU."""

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as harness  # noqa: E402


class FakeTime:
    """``harness.time`` on a fake clock: each arm run advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def arm(clock: FakeTime, seconds: float, step_s: float, calls: list, lines: list):
    def run() -> dict:
        calls.append(len(lines))  # the log lines printed before this run started
        clock.now += seconds
        return {"step_s": step_s, "startup_s": 5.0}
    return run


def test_budget_bounds_the_wall_time_below_min_pairs_and_progress_prints_per_run(monkeypatch):
    clock, calls, lines = FakeTime(), [], []
    monkeypatch.setattr(harness, "time", clock)
    result = harness.compare("fake", baseline=arm(clock, 30.0, 1.0, calls, lines),
                             candidate=arm(clock, 30.0, 1.1, calls, lines), metric="step_s", target=1.2,
                             min_pairs=4, max_pairs=40, budget_s=90.0, log=lines.append)
    wall = clock.now - 1000.0
    assert wall <= 90.0 + 60.0  # the budget plus one pair (the old harness ran min_pairs' 8 runs: 240 s)
    assert result["pairs"] == 1 and result["budget_hit"] is True
    assert result["holds"] is False  # fewer than min_pairs resolve nothing
    assert result["aa_noise"] is None  # no whole ABBA block
    # A line before the first run and after each run, not only at the end of a block.
    assert calls[0] >= 1 and all(later > earlier for earlier, later in zip(calls, calls[1:]))


def test_budget_counts_from_started_and_the_first_pair_always_runs(monkeypatch):
    clock, calls, lines = FakeTime(), [], []
    monkeypatch.setattr(harness, "time", clock)
    result = harness.compare("fake", baseline=arm(clock, 50.0, 1.0, calls, lines),
                             candidate=arm(clock, 50.0, 1.0, calls, lines), metric="step_s", target=1.02,
                             min_pairs=2, budget_s=30.0, started=clock.now - 40.0, log=lines.append)
    assert result["pairs"] == 1 and len(calls) == 2  # past the budget already: one pair, no more
    assert result["metrics"]["startup_s"]["aa_noise"] is None


def test_budget_that_fits_whole_blocks_keeps_abba_and_min_pairs(monkeypatch):
    clock, calls, lines = FakeTime(), [], []
    monkeypatch.setattr(harness, "time", clock)
    result = harness.compare("fake", baseline=arm(clock, 10.0, 1.0, calls, lines),
                             candidate=arm(clock, 10.0, 0.5, calls, lines), metric="step_s", target=0.6,
                             min_pairs=4, max_pairs=40, budget_s=1000.0, log=lines.append)
    assert result["pairs"] == 4 and result["budget_hit"] is False and result["holds"] is True
    assert result["aa_noise"] == 0.0


def test_run_tree_kills_the_whole_tree_on_timeout(tmp_path):
    # The child starts a grandchild that holds the output pipes: killing only the child would leave the read
    # waiting for the grandchild.
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print('started', child.pid, flush=True)\n"
              "time.sleep(60)\n")
    start = time.monotonic()
    result = harness.run_tree([sys.executable, "-c", script], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path,
                              timeout_s=2.0)
    assert time.monotonic() - start < 20.0
    assert result.returncode is None and "killed after 2 s" in result.stderr
    grandchild = Path(f"/proc/{result.stdout.split()[1]}/stat")
    for _ in range(40):  # gone, or a zombie waiting for its new parent to reap it
        try:
            if grandchild.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the grandchild outlived the timeout")


def test_cpu_benchmarks_hide_the_gpu_and_fix_the_threads(tmp_path, monkeypatch):
    import comm_callback_overhead
    import strategy_overhead

    from shardlight.preflight import usable_cores

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    threads = str(max(1, usable_cores() // 2))
    for env in (strategy_overhead._env(tmp_path), comm_callback_overhead._env()):
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["SHARDLIGHT_BENCH_THREADS"] == env["OMP_NUM_THREADS"] == threads
    args = strategy_overhead.shardlight_args(10, tmp_path, int(threads))
    assert "trainer.accelerator=cpu" in args and f"trainer.num_threads={threads}" in args
    monkeypatch.setenv("SHARDLIGHT_BENCH_THREADS", threads)
    assert comm_callback_overhead.cpu_overrides()[0] == "trainer.accelerator=cpu"
