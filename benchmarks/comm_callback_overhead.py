"""Overhead of the comm callback (``callbacks.comm``) on training, on the harness (``benchmarks/_harness.py``:
ABBA pairs, ci90, A/A noise).

Arms, each one fresh process tree per run (this script in ``--run`` mode, 2 gloo ranks, FULL_SHARD): the
default recipe trained for ``--steps`` (300, about 25 s: the early window at 5 and whatever the callback's
``overhead_budget`` (1%) then allows, read from each run's metrics.csv; each window gathered inside the loop) with
a step timer on every rank, validation and checkpoints off (not in a step), W&B off (the CSV logger stays):

* ``--arms off-on`` (the default): baseline ``callbacks.comm.enabled=false``, candidate ``true`` (its default
  interval and window);
* ``--arms file-live``: both arms with the callback on; baseline analyses each window the way it did before
  ``shardlight.trace.live`` (export the chrome trace, then parse it back with ``analyze_trace_file``), the
  candidate as it does now (from the profiler's memory, the trace written after): the effect of that change;
* ``--arms recorder`` (``benchmarks/flight_recorder_overhead.py``): both arms with the callback off; baseline
  without torch's flight recorder and the hang watchdog (``trainer.flight_recorder_entries=0``,
  ``callbacks.hang.enabled=false``), the candidate with both, as every run has them by default;
* ``--arms token-mean`` (``benchmarks/token_weighting_overhead.py``): both arms with the callback off; baseline
  without the step's token weighting (``CausalLMModule._scale_to_token_mean`` only resets its count: no
  all-reduce of the count, no gradient scaling), the candidate as every run trains;
* ``--arms compile`` (``benchmarks/compile_speed.py``): both arms with the callback off; baseline as the recipe,
  candidate ``compile=true``. The compile itself falls in the first step, before the measured loop; a figure
  (the step-time ratio, tokens/s its inverse), not a target: CPU inductor says little about a GPU.

Metrics per run (the timer: wall time from one optimizer step's end to the next, every hook included):

* ``loop_step_s`` (primary): wall per optimizer step over the loop after warm-up (end of step ``WARMUP`` to end
  of the last step, over the slower rank): what a user waits for; the windows' cost shows up here (not in a
  median), the early window at step 5 included;
* ``step_s``: the median over steps after warm-up of the slower rank's step time.

Target: ``loop_step_s`` ratio <= 1.01 (upper bound). The line also carries the old amortized figure of the
windows, from rank 0's step times of the runs with windows (the candidate arm; with ``file-live`` each arm's,
the keys prefixed ``baseline_`` / ``candidate_``):
``window_overhead_ms`` (the wall time of the steps a periodic window touches above the median of the steps
near it, median over windows and runs; ``first_window_overhead_ms`` for the early one) and ``amortized_ratio``
(that / (``every_n_steps`` * mean step time)); ``loop_cost_per_window_ms`` (the arms' median ``loop_step_s``
difference times the measured steps, over the windows in them); and ``<arm>_window_work_ms``: a window's
background thread, median over windows, ranks and runs: wall and CPU milliseconds to its analysis
(``analysis_ms``, what the gather waits for) and in all (``thread_ms``, the trace export included).

    python benchmarks/comm_callback_overhead.py [--pairs N] [--max-pairs N] [--budget-s S] [--steps N]
        [--arms off-on|file-live] [key=value ...]

Without ``--pairs``/``--budget-s`` the harness's stopping rule decides (8 to 40 pairs, 600 s budget). The budget
bounds the whole (``_harness.compare``): about the budget plus one pair (two runs of ``--steps``), start-up
included, even below ``--pairs``; every run prints a progress line to stderr as it ends. The runs stay on CPU
where a GPU is visible: ``CUDA_VISIBLE_DEVICES=""`` and a fixed thread count per rank (``_harness.cpu_env``),
``trainer.accelerator=cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import compare, cpu_env, emit, run_tree  # noqa: E402

WARMUP = 3  # steps before the measured loop (the early window, at step 5, is inside it)
TIMES_FILE = "step_times_rank{rank}.json"
WORK_FILE = "window_work_rank{rank}.json"
WORK: list = []  # per window of this rank: seconds to its analysis, and of its whole background thread
# --arms -> (benchmark name, baseline label, candidate label, each arm's recipe overrides)
ARMS = {
    "off-on": ("comm_callback_overhead", "comm off", "comm on",
               {"baseline": ["callbacks.comm.enabled=false"], "candidate": ["callbacks.comm.enabled=true"]}),
    "file-live": ("comm_callback_live_analysis", "file analysis", "live analysis",
                  {"baseline": ["callbacks.comm.enabled=true"], "candidate": ["callbacks.comm.enabled=true"]}),
    "recorder": ("flight_recorder_overhead", "flight recorder and hang watchdog off", "both on (the default)",
                 {"baseline": ["callbacks.comm.enabled=false", "trainer.flight_recorder_entries=0",
                               "callbacks.hang.enabled=false"],
                  "candidate": ["callbacks.comm.enabled=false"]}),
    "token-mean": ("token_weighting_overhead", "no token weighting", "token-weighted step (the default)",
                   {"baseline": ["callbacks.comm.enabled=false"], "candidate": ["callbacks.comm.enabled=false"]}),
    "compile": ("compile_speed", "compile: false", "compile: true (each block, inductor)",
                {"baseline": ["callbacks.comm.enabled=false"],
                 "candidate": ["callbacks.comm.enabled=false", "compile=true"]}),
}


# --- one run (``--run``: this process is rank 0; Lightning re-runs it as rank 1) ---------------------------------

def _step_timer(run_dir: Path):
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        """``time.perf_counter()`` at every optimizer step's end; validation time is taken out."""

        def __init__(self) -> None:
            self.ends: dict = {}
            self._paused = 0.0
            self._val = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends[trainer.global_step] = time.perf_counter() - self._paused

        def on_validation_start(self, trainer, pl_module):
            self._val = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            if self._val is not None:
                self._paused += time.perf_counter() - self._val
            self._val = None

        def on_train_end(self, trainer, pl_module):
            (run_dir / TIMES_FILE.format(rank=trainer.global_rank)).write_text(json.dumps(self.ends))
            (run_dir / WORK_FILE.format(rank=trainer.global_rank)).write_text(json.dumps(WORK))

    return StepTimer()


def _file_path_analysis() -> None:
    """The callback's analysis as it was before the live path: export the trace, parse it back."""
    import threading

    from shardlight.callbacks import comm
    from shardlight.trace import analyze_trace_file

    def analyse(self, window, prof):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            prof.export_chrome_trace(str(window["file"]))
            result = analyze_trace_file(window["file"], payload=True)
            window["result"] = {"metrics": comm.window_metrics(result, window["seconds"], self.tp_size),
                                "analysis": result}
        except Exception as exc:  # noqa: BLE001
            window["result"] = {"error": f"analysis: {type(exc).__name__}: {exc}"}
        finally:
            window["analysed"].set()

    comm.CommTimeCallback._analyse = analyse


def _time_window_work() -> None:
    """Time each window's background work: to its analysis (what the gather waits for) and in all."""
    from shardlight.callbacks import comm

    analyse = comm.CommTimeCallback._analyse

    def timed(self, window, prof):
        event, start, cpu = window["analysed"], time.perf_counter(), time.thread_time()
        done = {}
        real_set = event.set

        def set_():
            done.setdefault("wall", time.perf_counter() - start)
            done.setdefault("cpu", time.thread_time() - cpu)
            real_set()

        event.set = set_
        analyse(self, window, prof)
        WORK.append({"analysis_s": done.get("wall"), "analysis_cpu_s": done.get("cpu"),
                     "thread_s": time.perf_counter() - start, "thread_cpu_s": time.thread_time() - cpu})

    comm.CommTimeCallback._analyse = timed


def _no_token_weighting() -> None:
    """The step as it was before token weighting, for its cost: the count is reset, nothing reduced or scaled."""
    from shardlight.causal_lm import CausalLMModule

    CausalLMModule._scale_to_token_mean = lambda self: self._step_tokens.zero_()


def run(out: Path, steps: int, file_analysis: bool, overrides: list, token_weighting: bool = True) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import shardlight.build.trainer as trainer_builder
    import shardlight.train as train_mod
    from shardlight.instruments import Measurements
    from shardlight.recipe import load_recipe
    from shardlight.run_context import RunContext

    if file_analysis:
        _file_path_analysis()
    if not token_weighting:
        _no_token_weighting()
    _time_window_work()
    cfg = load_recipe(None, [f"output_dir={out}", f"trainer.max_steps={steps}", "trainer.progress_bar=false",
                             *cpu_overrides(),
                             f"trainer.val_every_n_steps={steps}", "trainer.limit_val_batches=0",
                             "checkpoint.enabled=false", "logging.wandb.enabled=false", *overrides])
    build = trainer_builder.build_callbacks
    trainer_builder.build_callbacks = lambda cfg_, ctx_, *rest: build(cfg_, ctx_, *rest) + [
        _step_timer(Path(ctx_.run_dir))]
    summary = train_mod.train(RunContext.from_env(), cfg, instruments=[Measurements()])
    if RunContext.from_env().rank == 0:
        (out / "run.json").write_text(json.dumps({"run_dir": str(summary["run_dir"])}))
    return 0


# --- the benchmark -----------------------------------------------------------------------------------------------

def window_overhead(times: dict, windows: list, touched_steps: int) -> dict:
    """Per window (start step -> seconds): the wall time of the steps it touches above the median of the
    untouched steps near it. A window touches steps start+1 .. start+touched_steps: the recorded steps, the
    steps its background analysis overlaps and the one that gathers the results."""
    touched = set()
    for start in windows:
        touched.update(range(start + 1, start + touched_steps + 1))
    normal = [times[s] for s in sorted(times) if s not in touched and s > WARMUP]
    median = statistics.median(normal)
    costs = {}
    for start in windows:
        near = [times[s] for s in range(start - 12, start + touched_steps + 13)
                if s in times and s not in touched and s > WARMUP]
        local = statistics.median(near) if len(near) >= 5 else median
        costs[start] = sum(times[s] - local for s in range(start + 1, start + touched_steps + 1) if s in times)
    return {"costs": costs, "mean_step_s": statistics.fmean(normal)}


def window_starts(run_dir: Path) -> list:
    """The steps the run's comm windows started at (``overhead_budget`` decides them), from its metrics.csv."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as fh:
        return sorted({int(float(row["comm/window_start_step"])) for row in csv.DictReader(fh)
                       if row.get("comm/window_start_step")})


def cpu_overrides() -> list:
    """The recipe overrides that keep a run on 2 CPU ranks, ``$SHARDLIGHT_BENCH_THREADS`` threads each (the
    command line's overrides come after and win)."""
    threads = os.environ.get("SHARDLIGHT_BENCH_THREADS")
    return ["trainer.accelerator=cpu", "trainer.devices=2", *([f"trainer.num_threads={threads}"] if threads else [])]


def _env() -> dict:
    """A run's environment: CPU only, the threads per rank fixed (``cpu_env``), no rank variables inherited."""
    env = cpu_env(dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true",
                       HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "SHARDLIGHT_RUN_DIR", "SHARDLIGHT_BENCH_RESULTS",
                "MASTER_PORT"):
        env.pop(key, None)
    return env


class Bench:
    def __init__(self, args, tmp: Path) -> None:
        from shardlight.callbacks.comm import CommTimeCallback
        from shardlight.recipe import load_recipe

        self.args, self.tmp, self.count = args, tmp, 0
        comm = load_recipe(None, [f"trainer.max_steps={args.steps}", *args.overrides]).callbacks.comm
        self.comm = comm
        callback = CommTimeCallback(tmp, wait=comm.wait, warmup=comm.warmup, active=comm.active)
        self.length = callback.full_steps  # the steps a window runs under the profiler (the last active only begun)
        self.delay = callback.gather_delay
        self.windows: list = []  # the windows of the last run with windows (from its metrics.csv)
        # arm -> {"periodic": [window costs], "first": [...], "mean_step_s": [per run]} of the runs with windows
        self.overheads: dict = {}
        self.work: dict = {}  # arm -> every window's background work, all ranks and runs

    def run_once(self, arm: str) -> dict:
        self.count += 1
        out = self.tmp / f"{arm}-{self.count}"
        out.mkdir()
        arm_overrides = ARMS[self.args.arms][3][arm]
        comm_on = "callbacks.comm.enabled=true" in arm_overrides
        file_analysis = self.args.arms == "file-live" and arm == "baseline"
        command = [sys.executable, str(Path(__file__).resolve()), "--run", str(out), "--steps", str(self.args.steps)]
        if file_analysis:
            command.append("--file-analysis")
        if self.args.arms == "token-mean" and arm == "baseline":
            command.append("--no-token-weighting")
        command += [*self.args.overrides, *arm_overrides]
        result = run_tree(command, env=_env(), cwd=REPO, timeout_s=self.args.run_timeout_s)
        if result.returncode != 0:
            why = (f"exit {result.returncode}" if result.returncode is not None
                   else f"no end after {self.args.run_timeout_s:.0f} s")
            sys.exit(f"comm_callback_overhead: the {arm} run failed ({why}):\n{result.stderr[-3000:]}")
        run_dir = Path(json.loads((out / "run.json").read_text())["run_dir"])
        ranks = [{int(k): v for k, v in json.loads(p.read_text()).items()}
                 for p in sorted(run_dir.glob(TIMES_FILE.format(rank="*")))]
        if len(ranks) != 2:
            sys.exit(f"comm_callback_overhead: the {arm} run wrote {len(ranks)} timing files, not 2")
        last = min(max(ends) for ends in ranks)
        measured = range(WARMUP + 1, last + 1)
        per_step = [max(ends[s] - ends[s - 1] for ends in ranks) for s in measured]
        loop = max((ends[last] - ends[WARMUP]) / len(measured) for ends in ranks)
        if comm_on:
            self.windows = window_starts(run_dir)
            times = {s: ranks[0][s] - ranks[0][s - 1] for s in ranks[0] if s - 1 in ranks[0]}
            found = window_overhead(times, self.windows, self.length + self.delay)
            mine = self.overheads.setdefault(arm, {"periodic": [], "first": [], "mean_step_s": []})
            mine["periodic"] += [c for s, c in found["costs"].items() if s != self.comm.first_step]
            mine["first"] += [c for s, c in found["costs"].items() if s == self.comm.first_step]
            mine["mean_step_s"].append(found["mean_step_s"])
            for path in sorted(run_dir.glob(WORK_FILE.format(rank="*"))):
                self.work.setdefault(arm, []).extend(json.loads(path.read_text()))
        return {"loop_step_s": loop, "step_s": statistics.median(per_step)}


def main(argv=None) -> int:
    started = time.perf_counter()  # the budget counts from here (the set-up's imports included)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8,
                        help="at least this many A/B pairs, the budget permitting (default 8)")
    parser.add_argument("--max-pairs", type=int, default=40)
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="start no pair that would end past this long (the first always runs; default 600)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--arms", choices=sorted(ARMS), default="off-on")
    parser.add_argument("--run-timeout-s", type=float, default=600.0,
                        help="kill a run (and end the benchmark) that takes longer than this (default 600)")
    parser.add_argument("--run", type=Path, default=None, help=argparse.SUPPRESS)  # one arm's run, into this dir
    parser.add_argument("--file-analysis", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-token-weighting", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value (both arms)")
    args = parser.parse_args(argv)
    if args.run is not None:
        return run(args.run, args.steps, args.file_analysis, args.overrides, not args.no_token_weighting)

    name = ARMS[args.arms][0]
    with tempfile.TemporaryDirectory(prefix="comm_overhead_") as tmp:
        bench = Bench(args, Path(tmp))
        result = compare(name, baseline=lambda: bench.run_once("baseline"),
                         candidate=lambda: bench.run_once("candidate"), metric="loop_step_s",
                         target=1.01, bound="upper", min_pairs=args.pairs, max_pairs=max(args.pairs, args.max_pairs),
                         budget_s=args.budget_s, started=started)
    result["arms"] = dict(zip(("baseline", "candidate"), ARMS[args.arms][1:3]))
    if args.arms == "compile":
        result["note"] = "a figure, not a target: tokens/s ratio = 1 / loop_step_s ratio; CPU inductor"
    result["steps"], result["warmup"], result["windows"] = args.steps, WARMUP, bench.windows
    result["every_n_steps"] = bench.comm.every_n_steps
    for arm, overheads in bench.overheads.items():  # the old amortized figure, per arm with windows
        prefix = "" if args.arms == "off-on" else f"{arm}_"
        if overheads["periodic"]:
            per_window = statistics.median(overheads["periodic"])
            result[f"{prefix}window_overhead_ms"] = round(1e3 * per_window, 1)
            result[f"{prefix}amortized_ratio"] = round(
                per_window / (bench.comm.every_n_steps * statistics.fmean(overheads["mean_step_s"])), 5)
        if overheads["first"]:
            result[f"{prefix}first_window_overhead_ms"] = round(1e3 * statistics.median(overheads["first"]), 1)
    for arm, work in bench.work.items():  # median seconds of a window's background work
        if not work:
            continue  # no window ran in this arm (overrides that start none)
        result[f"{arm}_window_work_ms"] = {key[:-2] + "_ms": round(1e3 * statistics.median(w[key] for w in work), 1)
                                           for key in work[0] if all(w[key] is not None for w in work)}
    measured = [w for w in bench.windows if w > WARMUP]
    if measured:
        medians = result["medians"]
        diff = medians["candidate"]["loop_step_s"] - medians["baseline"]["loop_step_s"]
        result["loop_cost_per_window_ms"] = round(1e3 * diff * (args.steps - WARMUP) / len(measured), 1)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
