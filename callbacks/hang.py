"""HangWatchdog: a run that stops making progress is named and stopped before torch's collective timeout.

A stuck FSDP run is one rank that never enters a collective the others wait in. torch's own answer is the
collective timeout (``trainer.collective_timeout_s``, 30 minutes by default), after which every rank dies with a
message that names none of that. This callback keeps a clock on every rank: when no training step (or validation
batch) has finished for ``callbacks.hang.after_s``, a thread of each rank

1. asks the others to do the same (``flight_recorder/trigger``: a rank whose own clock has not run out yet, or
   that is busy outside any collective, dumps too),
2. dumps its flight recorder (torch's, on since the process group started: ``trainer.flight_recorder_entries``)
   in torch's format to ``run_dir/flight_recorder/rank_<R>``, with its main thread's Python stack,
3. and exits 1. Rank 0 first waits up to ``grace_s`` for every rank's dump, prints the verdict
   (``shardlight.diagnosis.hang_verdict``: which ranks wait in which collective, which rank never entered it or stopped
   responding, and where it is) and one ``error:`` line, writes ``flight_recorder/verdict.json`` and kills the
   ranks Lightning started (a stopped rank cannot act on anything gentler). The others wait for that verdict, so
   that Lightning's child-process observer does not kill rank 0 while it reads their dumps.

The run directory is shared by every rank (its checkpoints are), so the dumps meet there; ``shardlight diagnose
RUN_DIR`` reads them again later. A rank that arrives late is a straggler (the comm verdict), never a hang: the
limit is a multiple of the median step, and at least ``min_after_s``.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import statistics
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Any, List, Optional

import lightning.pytorch as pl
from typing_extensions import override

from shardlight.callbacks._common import Shared
from shardlight.callbacks._flight_recorder import recorder_dump
from shardlight.diagnosis.hang_verdict import hang_report
from shardlight.files import write_json
from shardlight.recipe.instrument_sections import HangConfig
from shardlight.run_context import FLIGHT_RECORDER_PREFIX, RunContext

STEP_MULTIPLE = 10  # the limit, in median steps, when the recipe leaves after_s to the step time
EARLY_STEPS = 3  # until this many steps have finished, the limit is 5 x min_after_s (compilation, warm-up)
POLL_S = 0.5
TRIGGER = "trigger"
VERDICT = "verdict.json"
_STDLIB = sysconfig.get_paths()["stdlib"]


def _main_thread_stack() -> str:
    """Where the main thread is, without the standard library's innermost frames (``threading``'s wait is
    where every blocked thread ends; the frame that called it is the news)."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001 - the documented way
    frames = traceback.extract_stack(frame) if frame is not None else []
    while len(frames) > 1 and frames[-1].filename.startswith(_STDLIB):
        frames.pop()
    return "".join(traceback.format_list(frames))


class HangWatchdog(pl.Callback):
    """Every rank: a clock since the last finished step, and a thread that dumps and stops a stuck run.

    Arguments:
        config: the recipe's ``callbacks.hang`` section.
        folder: where the dumps go (``run_dir/flight_recorder``, shared by the ranks).
        collective_timeout_s: torch's timeout; the watchdog acts before it (``grace_s`` and 5 s earlier).
    """

    def __init__(self, config: HangConfig, folder: Path, collective_timeout_s: float) -> None:
        self.config = config
        self.folder = folder
        self.ceiling = collective_timeout_s - config.grace_s - 5.0
        self.last = time.monotonic()
        self.steps: List[float] = []
        self.step = 0
        self.rank = 0
        self.world_size = 1
        self.launcher: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def limit_s(self) -> float:
        """Seconds without progress that make a hang."""
        c = self.config
        if c.after_s is not None:
            return c.after_s
        if len(self.steps) < EARLY_STEPS:
            limit = 5 * c.min_after_s
        else:
            limit = max(c.min_after_s, STEP_MULTIPLE * statistics.median(self.steps))
        return min(limit, self.ceiling)

    def _progress(self, trainer: pl.Trainer) -> None:
        now = time.monotonic()
        if trainer.training:
            self.steps = (self.steps + [now - self.last])[-100:]
        self.last = now
        self.step = trainer.global_step

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rank, self.world_size = trainer.global_rank, trainer.world_size
        self.launcher = getattr(trainer.strategy, "launcher", None)
        self.last = time.monotonic()
        if self.ceiling <= 0 and self.config.after_s is None:
            return  # torch's timeout is shorter than any limit we could keep: it will end a hang first
        self._thread = threading.Thread(target=self._watch, name="shardlight-hang-watchdog", daemon=True)
        self._thread.start()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._progress(trainer)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._progress(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._progress(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop.set()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop.set()

    def _watch(self) -> None:
        trigger = self.folder / TRIGGER
        while not self._stop.wait(POLL_S):
            idle = time.monotonic() - self.last
            if idle > self.limit_s() or trigger.exists():
                self._dump_and_stop(idle)
                return

    def _dump_and_stop(self, idle: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trigger = self.folder / TRIGGER
        if not trigger.exists():
            write_json(trigger, {"rank": self.rank, "idle_s": round(idle, 1), "step": self.step})
        dump = recorder_dump()
        dump["shardlight"] = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                              "host": socket.gethostname(), "step": self.step, "idle_s": round(idle, 1),
                              "after_s": round(self.limit_s(), 1), "stack": _main_thread_stack()}
        path = self.folder / f"{FLIGHT_RECORDER_PREFIX}{self.rank}"
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(pickle.dumps(dump))
        partial.replace(path)  # whole or absent: rank 0 reads it as soon as it exists
        if self.rank == 0:
            self._report()
        else:
            self._await_report(idle)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the main thread is stuck in a collective: nothing else would end this process

    def _report(self) -> None:
        deadline = time.monotonic() + self.config.grace_s
        while time.monotonic() < deadline and not all(
                (self.folder / f"{FLIGHT_RECORDER_PREFIX}{r}").exists() for r in range(self.world_size)):
            time.sleep(POLL_S)
        verdict = hang_report(self.folder, self.world_size)
        assert verdict is not None  # this rank's own dump is there
        print("\n".join(verdict.lines), file=sys.stderr)
        print(f"{verdict.error} (dumps: {self.folder}; `shardlight diagnose` reads them)", file=sys.stderr,
              flush=True)
        write_json(self.folder / VERDICT, verdict.to_dict())
        if self.launcher is not None and hasattr(self.launcher, "kill"):
            self.launcher.kill(signal.SIGKILL)  # the ranks Lightning started, a stopped one included

    def _await_report(self, idle: float) -> None:
        deadline = time.monotonic() + self.config.grace_s + 15
        while time.monotonic() < deadline and not (self.folder / VERDICT).exists():
            time.sleep(POLL_S)
        if not (self.folder / VERDICT).exists():
            print(f"error: rank {self.rank}: no step finished for {idle:.0f} s and rank 0 gave no verdict; this "
                  f"rank's flight recorder is in {self.folder}", file=sys.stderr, flush=True)


def build(config: HangConfig, ctx: RunContext, shared: Shared) -> HangWatchdog:
    return HangWatchdog(config, ctx.flight_recorder_dir(), shared.collective_timeout_s)
