"""`shardlight train ARGS` with a step timer and start-up marks, for the timing benchmarks.

The real CLI runs unchanged, imports included: the training path (torch, Lightning, transformers) is imported
where the CLI imports it, after the recipe has loaded. When ``shardlight.train`` has been imported, a Lightning
callback is added to the callbacks the builder makes and the preflight is wrapped to time it. Every rank runs
this script (Lightning starts ranks 1..N-1 with the same command line), so every rank writes
``timing-rank{R}.json`` into ``$SHARDLIGHT_BENCH_TIMES`` (a process boundary: the benchmark sets it):

* ``steps``: seconds from batch in hand (``on_train_batch_start``) to optimizer step done
  (``on_train_batch_end``), per optimizer step;
* ``ends``: ``time.time()`` at each step's end (the loop's wall per step comes from these);
* ``cpu_ends``: ``time.process_time()`` at each step's end (CPU seconds of the whole process, all threads:
  a machine's load slows wall time but adds little CPU time, so overhead shows here under load too);
* ``marks``: ``time.time()`` at: ``start`` (this script's first line), ``imports`` (torch, Lightning,
  transformers and shardlight's training path imported), ``preflight`` (done), ``fit`` (the callbacks'
  ``setup``: the process group is up, the model not yet wrapped), ``wrapped`` (``on_train_start``: FSDP
  wrapped, optimizer built), ``first_step`` (the first optimizer step done).
"""

import time

START = time.time()

import importlib.abc  # noqa: E402
import importlib.machinery  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlight.cli.main import leave, main  # noqa: E402  (light: the CLI imports torch only once the recipe is good)

TIMES_ENV = "SHARDLIGHT_BENCH_TIMES"
MARKS = {"start": START}


def instrument(train_module) -> None:
    """Add the step timer to the builder's callbacks and time the preflight (``shardlight.train`` imported)."""
    import lightning.pytorch as pl

    import shardlight.build.trainer as trainer_builder

    MARKS["imports"] = time.time()

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.steps: list = []
            self.ends: list = []
            self.cpu_ends: list = []
            self._start = 0.0

        def setup(self, trainer, pl_module, stage):
            MARKS.setdefault("fit", time.time())

        def on_train_start(self, trainer, pl_module):
            MARKS["wrapped"] = time.time()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append(time.perf_counter() - self._start)
            self.ends.append(time.time())
            self.cpu_ends.append(time.process_time())
            MARKS.setdefault("first_step", self.ends[-1])

        def on_train_end(self, trainer, pl_module):
            out = os.environ.get(TIMES_ENV)
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                record = {"steps": self.steps, "ends": self.ends, "cpu_ends": self.cpu_ends, "marks": MARKS}
                (Path(out) / f"timing-rank{trainer.global_rank}.json").write_text(json.dumps(record))

    build_callbacks = trainer_builder.build_callbacks
    preflight = train_module.preflight

    def with_timer(cfg, ctx, *rest):
        return build_callbacks(cfg, ctx, *rest) + [StepTimer()]

    def timed_preflight(*args, **kwargs):
        result = preflight(*args, **kwargs)
        MARKS["preflight"] = time.time()
        return result

    trainer_builder.build_callbacks = with_timer
    train_module.preflight = timed_preflight


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``instrument`` right after ``shardlight.train`` has been imported, wherever the CLI imports it."""

    name = "shardlight.train"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        instrument(module)


sys.meta_path.insert(0, _AfterImport())

if __name__ == "__main__":
    leave(main())  # its own command line: the ranks run it again
