"""Overhead of the comm callback (``callbacks.comm``), amortized at its interval.

Trains the default recipe (2 gloo ranks, FULL_SHARD) with the comm callback on at its default interval
and a step timer on every rank. A window's overhead is the wall time of the steps it touches (recorded
steps, export, analysis, cross-rank gather) above the median time of the steps outside windows; it is
amortized over the interval:

    ratio = median overhead of the periodic windows / (every_n_steps * mean step time outside windows)

(``ratio_mean_of_windows`` uses their mean; the early window's one-time profiler start-up is reported
as ``first_window_overhead_ms``.)

Target: ratio <= 0.02 at the default interval. Prints one JSON line, e.g.
``{"ratio": 0.011, "every_n_steps": 50, "windows": 3, "mean_step_ms": 130.2, ...}``.

    python benchmarks/comm_callback_overhead.py [--steps N] [--every-n-steps N] [key=value ...]

(Lightning re-runs this script in each rank's process; ranks other than 0 print nothing.)
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
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning.pytorch.callbacks import Callback  # noqa: E402

TIMES_FILE = "step_times_rank{rank}.json"


class StepTimer(Callback):
    """Wall time of every optimizer step (batch end to batch end), validation excluded."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.times: dict = {}
        self._last = None
        self._paused = 0.0
        self._val = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        if self._last is not None:
            self.times[trainer.global_step] = now - self._last - self._paused
        self._last, self._paused = now, 0.0

    def on_validation_start(self, trainer, pl_module):
        self._val = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if self._val is not None and self._last is not None:
            self._paused += time.perf_counter() - self._val
        self._val = None

    def on_train_end(self, trainer, pl_module):
        path = self.run_dir / TIMES_FILE.format(rank=trainer.global_rank)
        path.write_text(json.dumps(self.times))


def overhead(times: dict, windows: list, touched_steps: int, every_n_steps: int, first_step=None) -> dict:
    """The amortized ratio from step times (step -> seconds) and window start steps.

    A window touches steps start+1 .. start+touched_steps: the recorded steps (the last one exports
    the trace), the steps its background analysis overlaps and the one that gathers the results.
    The early window (``first_step``) also pays the profiler's one-time start-up; it is reported on
    its own, and the ratio is that of the periodic windows (those at multiples of the interval).
    """
    touched = set()
    for start in windows:
        touched.update(range(start + 1, start + touched_steps + 1))
    steps = sorted(int(s) for s in times)
    normal = [times[s] for s in steps if s not in touched and s > 2]
    median = statistics.median(normal)
    mean = statistics.fmean(normal)
    costs = {}
    for start in windows:
        # Baseline: the untouched steps around the window (the machine's speed drifts during a run).
        near = [times[s] for s in range(start - 12, start + touched_steps + 13)
                if s in times and s not in touched and s > 2]
        local = statistics.median(near) if len(near) >= 5 else median
        costs[start] = sum(times[s] - local for s in range(start + 1, start + touched_steps + 1) if s in times)
    periodic = [c for start, c in costs.items() if start != first_step] or list(costs.values())
    # The median window: other processes on a shared machine only ever add spikes to a window.
    per_window = statistics.median(periodic) if periodic else 0.0
    return {
        "ratio": round(per_window / (every_n_steps * mean), 5),
        "ratio_mean_of_windows": round(statistics.fmean(periodic) / (every_n_steps * mean), 5) if periodic else 0.0,
        "every_n_steps": every_n_steps,
        "windows": len(windows),
        "window_overhead_ms": {str(s): round(1e3 * c, 1) for s, c in costs.items()},
        "first_window_overhead_ms": round(1e3 * costs[first_step], 1) if first_step in costs else None,
        "mean_step_ms": round(1e3 * mean, 2),
        "median_step_ms": round(1e3 * median, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=260, help="optimizer steps to train")
    parser.add_argument("--every-n-steps", type=int, default=None, help="comm window interval (default: the recipe's)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    args = parser.parse_args(argv)

    import shardlight.train as train_mod
    from shardlight.recipe import load_recipe
    from shardlight.runtime import RunContext

    out = Path(os.environ.get("SHARDLIGHT_BENCH_DIR") or tempfile.mkdtemp(prefix="comm_overhead_"))
    os.environ["SHARDLIGHT_BENCH_DIR"] = str(out)  # the rank processes Lightning starts inherit it
    overrides = [f"output_dir={out}", f"trainer.max_steps={args.steps}", "trainer.progress_bar=false",
                 f"trainer.val_every_n_steps={args.steps}", "logging.wandb.enabled=false", *args.overrides]
    if args.every_n_steps:
        overrides.append(f"callbacks.comm.every_n_steps={args.every_n_steps}")
    cfg = load_recipe(None, overrides)

    import shardlight.build.trainer as trainer_builder

    build = trainer_builder.build_callbacks

    def with_timer(cfg_, ctx_):
        return build(cfg_, ctx_) + [StepTimer(Path(ctx_.run_dir))]

    trainer_builder.build_callbacks = with_timer
    ctx = RunContext.from_env()
    summary = train_mod.train(ctx, cfg)
    if ctx.rank != 0:
        return 0
    run_dir = Path(summary["run_dir"])
    times = {int(k): v for k, v in json.loads((run_dir / TIMES_FILE.format(rank=0)).read_text()).items()}
    comm = cfg.callbacks.comm
    length = comm.wait + comm.warmup + comm.active
    windows = sorted({s for s in range(1, args.steps) if (s % comm.every_n_steps == 0 or s == comm.first_step)
                      and s + length <= args.steps})
    from shardlight.callbacks.comm import CommTimeCallback

    delay = CommTimeCallback(run_dir).gather_delay
    result = overhead(times, windows, length + delay, comm.every_n_steps, comm.first_step)
    result["trace_dirs"] = len(list((run_dir / "traces").glob("step_*")))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
