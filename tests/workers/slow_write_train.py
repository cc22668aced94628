"""`shardlight train ARGS` on a file system that writes only while training goes on, for the async checkpoint test.

Every DCP write of the checkpoint of step N first waits until this rank's training has finished step N + 1 (or
training has ended): a write that can only finish by overlapping a step.
An asynchronous save therefore always overlaps at least one step, however loaded the machine; a save that held
the training thread would wait ``$SLOW_WRITE_TIMEOUT_S`` seconds for a step that never comes and then report
that training went on 0 steps, so the test fails on the fact, not on timing.
Lightning's launcher re-executes this script for rank 1, so the writer is in place on every rank.
"""

import os
import re
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.checkpoint import filesystem  # noqa: E402

from shardlight.checkpoint.callback import CheckpointCallback  # noqa: E402

_TIMEOUT_S = float(os.environ.get("SLOW_WRITE_TIMEOUT_S", "120"))
_progress = threading.Condition()
_state = {"step": 0, "ended": False}
_write_data = filesystem._FileSystemWriter.write_data
_batch_end = CheckpointCallback.on_train_batch_end
_train_end = CheckpointCallback.on_train_end


def _after_one_more_step(self, plan, planner):
    saved = int(re.search(r"step-(\d+)", str(self.path)).group(1))
    with _progress:
        _progress.wait_for(lambda: _state["step"] > saved or _state["ended"], timeout=_TIMEOUT_S)
    return _write_data(self, plan, planner)


def _on_train_batch_end(self, trainer, *args, **kwargs):
    with _progress:
        _state["step"] = trainer.global_step
        _progress.notify_all()
    return _batch_end(self, trainer, *args, **kwargs)


def _on_train_end(self, trainer, pl_module):
    with _progress:
        _state["ended"] = True
        _progress.notify_all()
    return _train_end(self, trainer, pl_module)


filesystem._FileSystemWriter.write_data = _after_one_more_step
CheckpointCallback.on_train_batch_end = _on_train_batch_end
CheckpointCallback.on_train_end = _on_train_end

if __name__ == "__main__":
    from shardlight.cli.main import leave, main

    leave(main(sys.argv[1:]))
