"""CommTimeCallback: collective time, exposed communication and overlap, measured live in short windows.

``build(config, ctx, shared)`` makes the callback from the recipe's ``callbacks.comm`` section
(``CommConfig``).

Every ``every_n_steps`` optimizer steps (and once early, at ``first_step``) every rank records a short
``torch.profiler`` window (schedule wait/warmup/active; the last active step, which the analysis drops as HTA
does, is only begun: the profiler stops as it starts) and analyses it from the profiler's memory with the
trace analyzer (:mod:`shardlight.trace.live`: the same analysis as ``shardlight analyze`` of the window's
trace file, without writing and parsing one): NCCL kernels on GPU, gloo work on CPU. It then writes the
window's trace to ``run_dir/traces/step_<N>/rank<R>.pt.trace.json`` for offline use (``save_traces``).
The per-rank results are gathered to rank 0, which logs the window's metrics and prints its verdict
(:mod:`shardlight.callbacks._comm_report` lists the keys); what the windows cost is logged 8 steps after
each window's gather, when the ranks agree on it (``comm/window_cost_ms``, ``comm/overhead_pct``,
``comm/next_window_step``: :mod:`shardlight.callbacks._comm_schedule`).

Re-analyse a window offline with ``shardlight analyze run_dir/traces/step_<N>/``: it drops the last
recorded step as this callback does (HTA's rule), so both report the same communication time.

The analysis, then the trace export, run in a background thread while training goes on; the results are
gathered ``gather_delay`` (5) steps after the window (or at the end of training), waiting for the analysis
only, and logged at the window's last step; the trace files are complete when training ends. A profiler or
analysis failure on a rank is a warning; the window is skipped on that rank and training goes on (a trace
that cannot be written is a warning too, the window's metrics stand). Every rank joins the result gather at
the same, precomputed step, failed or not.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from shardlight.callbacks._comm_metrics import window_metrics
from shardlight.callbacks._comm_report import WindowReport
from shardlight.callbacks._comm_schedule import WindowSchedule
from shardlight.callbacks._common import (
    Findings,
    RankTable,
    Shared,
    define_wandb_group,
    gather_to_zero,
    log_metrics,
    rank,
)
from shardlight.callbacks._flight_recorder import issued_between, issued_marks
from shardlight.errors import warn
from shardlight.recipe.instrument_sections import CommConfig, DiagnosisConfig
from shardlight.run_context import RunContext
from shardlight.trace import analyze_trace_file
from shardlight.trace.live import analyze_profile, distributed_info, has_live_events
from shardlight.trace.records import write_issued

TRACE_DIR = "traces"


class CommTimeCallback(Callback):
    """Profile a window of steps on every rank, analyse it, log comm vs compute per rank and aggregated.

    Args:
        run_dir: the run directory; traces go to ``run_dir/traces/step_<N>/``.
        every_n_steps: optimizer steps between windows (windows start at multiples of it).
        first_step: the early window's first step (None or 0: none).
        overhead_budget: the largest share of training time the windows may cost (None or 0: no budget):
            each window's measured cost spaces the next (:mod:`shardlight.callbacks._comm_schedule`).
        judged_windows: windows after warm-up a run of 30 steps or more gets whatever the budget, spread over it.
        wait, warmup, active: ``torch.profiler.schedule`` of a window (``active`` steps are recorded, the last
            only begun: the analysis drops it).
        per_rank: also log ``comm/rank<R>/...`` keys.
        keep_windows: keep the traces of the last this-many windows (None: all).
        table: where the latest per-rank values go for the end-of-run table.
        gather_delay: steps between a window's end and the cross-rank gather of its results (the
            analysis runs in a background thread meanwhile); metrics are logged at the window's end step.
        record_shapes: record op shapes (the bytes of gloo collectives: bus bandwidth on CPU; about 10x a
            window's cost); NCCL kernels carry their sizes without it.
        print_windows: print each window's verdict line (rank 0).
        findings: where rank 0 keeps the latest window's analysis and verdict, and reads the memory and
            throughput callbacks' latest values for it.
        diagnosis: the recipe's ``diagnosis:`` thresholds; micro_batch_size: what its advice is about;
            tp_size: the tensor-parallel degree (its process groups are comm/tp/..., the others comm/fsdp/...).
        save_traces: write each window's trace file (after its analysis, in the background); False: none,
            and no ``run_dir/traces``.
    """

    def __init__(self, run_dir: Path, every_n_steps: int = 50, first_step: Optional[int] = 5, wait: int = 0,
                 warmup: int = 1, active: int = 4, per_rank: bool = True, keep_windows: Optional[int] = 10,
                 table: Optional[RankTable] = None, gather_delay: int = 5, record_shapes: bool = False,
                 print_windows: bool = True, findings: Optional[Findings] = None,
                 diagnosis: Optional[DiagnosisConfig] = None, micro_batch_size: Optional[int] = None,
                 tp_size: int = 1, save_traces: bool = True, overhead_budget: Optional[float] = None,
                 judged_windows: int = 4) -> None:
        self.trace_root = Path(run_dir) / TRACE_DIR
        self.every_n_steps = every_n_steps
        self.first_step = first_step or None
        self.wait, self.warmup, self.active = wait, warmup, active
        self.length = wait + warmup + active
        # Steps run under the profiler in full: the last active step only begins (see on_train_batch_end).
        self.full_steps = max(1, self.length - 1)
        self.schedule = WindowSchedule(every_n_steps, self.first_step, self.length, overhead_budget)
        self.judged_windows = judged_windows
        self.keep_windows = keep_windows
        self.table = table
        self.gather_delay = gather_delay
        self.record_shapes = record_shapes
        self.findings = findings if findings is not None else Findings()
        self.report = WindowReport(per_rank=per_rank, table=table, findings=self.findings,
                                   diagnosis=diagnosis if diagnosis is not None else DiagnosisConfig(),
                                   micro_batch_size=micro_batch_size, print_windows=print_windows)
        self.tp_size = tp_size
        self.save_traces = save_traces
        self._exports: List[threading.Thread] = []  # window threads that may still be writing their trace
        self._window: Optional[Dict[str, Any]] = None
        self._pending: Optional[Dict[str, Any]] = None
        self._last_step = -1
        self._saved: List[Path] = []
        self._val_began: Optional[float] = None

    # --- schedule -------------------------------------------------------------------------------------
    def is_window_start(self, step: int, max_steps: int) -> bool:
        return self.schedule.is_start(step, max_steps)

    @staticmethod
    def _max_steps(trainer: pl.Trainer) -> int:
        max_steps = trainer.max_steps
        if max_steps is None or max_steps < 0:
            try:
                max_steps = int(trainer.estimated_stepping_batches)
            except Exception:  # noqa: BLE001
                max_steps = 2**62
        return max_steps

    # --- hooks ----------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The run's own first step (a resumed run's resume step): windows count from it.
        self.findings.run_start = trainer.global_step
        self.schedule.plan_run(trainer.global_step, self._max_steps(trainer),
                               warmup_steps=self.report.diagnosis.warmup_steps,
                               gather_delay=self.gather_delay, judged_windows=self.judged_windows,
                               val_every=self._val_every(trainer))

    @staticmethod
    def _val_every(trainer: pl.Trainer) -> Optional[int]:
        """Optimizer steps between validation passes (None: none, or not every so many batches)."""
        interval = trainer.val_check_interval
        if not trainer.limit_val_batches or not isinstance(interval, int):
            return None
        return max(1, interval // trainer.accumulate_grad_batches)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_began = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_began is not None:  # a pass inside a window's span is the trainer's work, not the window's
            self.schedule.set_aside(time.perf_counter() - self._val_began)
        self._val_began = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        define_wandb_group(trainer, "comm", {"comm/exposed_ms": "mean", "comm/overlap_pct": "mean"})
        for group in ("step", "input", "diagnosis"):  # logged at the window's end step, like comm/*
            define_wandb_group(trainer, group)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if self._window is not None or step == self._last_step:
            return
        self._last_step = step  # first micro-batch of this optimizer step
        if not self.is_window_start(step, self._max_steps(trainer)):
            return
        if self._pending is not None:
            self._collect(trainer)
        window: Dict[str, Any] = {"start": step, "end": step + self.full_steps, "prof": None, "error": None,
                                  "file": None, "seconds": {}}
        self._window = window
        self.schedule.window_opened(step)
        try:
            if self.save_traces:
                directory = self.trace_root / f"step_{step:06d}"
                directory.mkdir(parents=True, exist_ok=True)
                window["file"] = directory / f"rank{rank()}.pt.trace.json"
            # libkineto prints "USDT: ... profiler_start" and "profiler_stop" at every start and stop (its USDT
            # level, 5): four console lines per window on 2 ranks. It reads KINETO_LOG_LEVEL once, when the
            # process's first profiler starts, so set it here, before that. 6 is above all its levels, errors
            # too (a failed window is our own warning); a user's own value wins.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
                on_trace_ready=lambda p: window.__setitem__("recorded", True),  # analysed off the hot path
                record_shapes=self.record_shapes, profile_memory=False, with_stack=False,
            )
            window["issued_from"] = issued_marks()  # the flight recorder names the groups gloo's trace does not
            prof.start()
            window["prof"] = prof
            window["t"] = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - profiling must never stop training
            self._fail(window, "start", exc)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        if not (batch_idx + 1) % trainer.accumulate_grad_batches:
            self.schedule.step_done(trainer.global_step)
            if self.schedule.agree_due(trainer.global_step):
                self._agree(trainer)
        pending = self._pending
        if pending is not None and trainer.global_step >= pending["gather_step"]:
            self._collect(trainer)
        window = self._window
        if window is None or trainer.global_step == window.get("done_step"):
            return
        if trainer.global_step <= window["start"]:
            return  # accumulation: the optimizer step has not happened yet
        window["done_step"] = trainer.global_step
        prof = window["prof"]
        if prof is not None:
            try:
                now = time.perf_counter()
                window["seconds"][prof.step_num] = now - window["t"]
                last = trainer.global_step >= window["end"]
                if last and trainer.strategy.root_device.type == "cuda":
                    # The analysed steps' kernels end inside them: the profiler stops before the next step runs.
                    torch.cuda.synchronize(trainer.strategy.root_device)
                prof.step()
                # The last active step is one the analysis drops (HTA's rule: a trace's last step may be
                # incomplete): _finish stops the profiler as it begins, instead of recording it in full, which
                # cost as much again as the analysed step (its ops recorded, then processed at the stop).
                if last and not window.get("recorded") and prof.current_action.name != "RECORD_AND_SAVE":
                    raise RuntimeError(f"schedule out of step ({prof.current_action.name})")
                window["t"] = time.perf_counter()
            except Exception as exc:  # noqa: BLE001
                self._fail(window, "step/export", exc)
        if trainer.global_step >= window["end"]:
            self._finish(trainer, window)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window, self._window = self._window, None
        if window is not None and window["prof"] is not None:
            try:  # training ended inside a window (early stop): drop it, no collective
                window["prof"].stop()
            except Exception:  # noqa: BLE001
                pass
        if self._pending is not None:  # every rank has the same pending window: the gather matches
            self._collect(trainer)
        if self.schedule.agree_step is not None:  # gathered, its cost not agreed yet: agree now (every rank)
            self._agree(trainer)
        self._join_exports()  # the run's trace files are complete when fit returns

    # --- window end -------------------------------------------------------------------------------------
    def _fail(self, window: Dict[str, Any], stage: str, exc: BaseException) -> None:
        window["error"] = f"{stage}: {type(exc).__name__}: {exc}"
        prof, window["prof"] = window["prof"], None
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001
                pass
        warn(f"comm window at step {window['start']} skipped on rank {rank()} ({window['error']})")

    def _analyse(self, window: Dict[str, Any], prof: torch.profiler.profile) -> None:
        """Analyse this rank's window from the profiler's memory, then write its trace file (in a background
        thread: it overlaps the next steps). The gather waits for ``window["analysed"]`` only."""
        try:
            # Lowest priority for this thread only (Linux): on a busy host it must yield to training.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        exported = False
        try:
            window["issued"] = issued_between(window["issued_from"], window["issued_to"]) or None
        except Exception as exc:  # noqa: BLE001 - the window stands without groups
            warn(f"comm window at step {window['start']}: no flight recorder ({type(exc).__name__}: {exc})")
            window["issued"] = None
        if window["file"] is not None:  # beside the trace: the group of each collective (gloo's names none)
            write_issued(window["file"], window["issued"])
        try:
            # payload: what rank 0 needs of this rank to match its collectives with the others' (small)
            if has_live_events(prof):
                name = window["file"] or f"<rank {rank()} window at step {window['start']}>"
                result = analyze_profile(prof, payload=True, path=name, dist_info=window.get("dist_info"),
                                         issued=window.get("issued"))
            else:  # this torch keeps no trace activities in memory (2.11): export the window and read it back
                result, exported = self._analyse_exported(window, prof), True
            metrics = window_metrics(result, window["seconds"], self.tp_size)
            window["result"] = {"metrics": metrics, "analysis": result}
        except Exception as exc:  # noqa: BLE001
            window["result"] = {"error": f"analysis: {type(exc).__name__}: {exc}"}
        finally:
            window["analysed"].set()
        if window["file"] is not None and not exported:
            try:  # for `shardlight analyze` / `diagnose` of the run; the window's metrics do not need it
                prof.export_chrome_trace(str(window["file"]))
            except Exception as exc:  # noqa: BLE001
                warn(f"comm window at step {window['start']}: trace not written on rank {rank()} "
                     f"({type(exc).__name__}: {exc})")

    @staticmethod
    def _analyse_exported(window: Dict[str, Any], prof: torch.profiler.profile) -> Dict[str, Any]:
        """The file path: export the window's trace (to a temporary file with ``save_traces`` off), analyse it."""
        if window["file"] is not None:
            prof.export_chrome_trace(str(window["file"]))
            return analyze_trace_file(window["file"], payload=True)
        with tempfile.TemporaryDirectory(prefix="shardlight-window-") as tmp:
            file = Path(tmp) / f"rank{rank()}.pt.trace.json"
            prof.export_chrome_trace(str(file))
            write_issued(file, window.get("issued"))
            return analyze_trace_file(file, payload=True)

    def _join_exports(self) -> None:
        exports, self._exports = self._exports, []
        for thread in exports:
            thread.join()

    def _finish(self, trainer: pl.Trainer, window: Dict[str, Any]) -> None:
        """Window recorded: stop the profiler and start export + analysis in a thread; the results are
        gathered ``gather_delay`` steps later, so that this work overlaps training instead of stalling it."""
        self._window = None
        prof, window["prof"] = window["prof"], None
        thread = None
        if window["error"] is None:
            try:
                prof.stop()
                window["issued_to"] = issued_marks()  # before this rank issues another collective
                if not window.get("recorded"):
                    raise RuntimeError("the profiler recorded nothing")
                window["dist_info"] = distributed_info()  # what the trace file's distributedInfo holds
                window["analysed"] = threading.Event()
                thread = threading.Thread(target=self._analyse, args=(window, prof),
                                          name="shardlight-comm-analysis", daemon=True)
                thread.start()
                self._exports = [t for t in self._exports if t.is_alive()] + [thread]
            except Exception as exc:  # noqa: BLE001
                self._fail(window, "analysis", exc)
        self._pending = {"window": window, "thread": thread,
                         "gather_step": trainer.global_step + self.gather_delay}

    def _collect(self, trainer: pl.Trainer) -> None:
        """Join the analysis and gather every rank's result (all ranks, at the same step)."""
        pending, self._pending = self._pending, None
        window = pending["window"]
        if pending["thread"] is not None:
            window["analysed"].wait()  # not the trace export that follows it
        local = window.get("result") or {"error": window["error"] or "no result"}
        if "error" in local and window["error"] is None:
            window["error"] = local["error"]
            warn(f"comm window at step {window['start']} skipped on rank {rank()} ({local['error']})")
        results = gather_to_zero(local)  # only rank 0 reads the others' results
        self.schedule.window_gathered()
        if trainer.is_global_zero:
            self.report.log(trainer, window, results)
            self._prune(window)
        if self.schedule.agree_due(trainer.global_step):
            self._agree(trainer)

    def _agree(self, trainer: pl.Trainer) -> None:
        """Agree on the gathered window's cost (all ranks, the same step); rank 0 logs it and the next start."""
        start = self.schedule.open_window
        cost_s, typical_s = self.schedule.agree(start, device=trainer.strategy.root_device)
        if not trainer.is_global_zero:
            return
        metrics = {"comm/window_cost_ms": 1e3 * cost_s, "comm/typical_step_ms": 1e3 * typical_s,
                   "comm/next_window_step": float(self.schedule.next_start),
                   "comm/cost_window_start_step": float(start)}
        share = self.schedule.overhead_share()
        if share is not None:
            metrics["comm/overhead_pct"] = 100.0 * share
        log_metrics(trainer, metrics, step=trainer.global_step)

    def _prune(self, window: Dict[str, Any]) -> None:
        if window.get("file") is None:
            return
        self._saved.append(window["file"].parent)
        if self.keep_windows is None or self.keep_windows <= 0:
            return
        while len(self._saved) > self.keep_windows:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)


def build(config: CommConfig, ctx: RunContext, shared: Shared) -> CommTimeCallback:
    return CommTimeCallback(
        Path(ctx.run_dir), every_n_steps=config.every_n_steps, first_step=config.first_step, wait=config.wait,
        warmup=config.warmup, active=config.active, per_rank=config.per_rank, keep_windows=config.keep_windows,
        table=shared.table, record_shapes=config.record_shapes, print_windows=config.print_windows,
        findings=shared.findings, diagnosis=shared.diagnosis, micro_batch_size=shared.micro_batch_size,
        tp_size=shared.tp_size, save_traces=config.save_traces, overhead_budget=config.overhead_budget,
        judged_windows=config.judged_windows,
    )
