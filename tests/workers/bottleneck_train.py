"""`shardlight train ARGS` with a known bottleneck built in, for the diagnosis truth tests.

The knobs are this test worker's own (environment variables at the process boundary, read once here):

* ``SHARDLIGHT_TEST_STALL_MS`` / ``SHARDLIGHT_TEST_STALL_RANK``: that rank computes that many extra
  milliseconds at the start of every training step (real ``aten::mm`` work on the main thread, so the
  profiler sees compute, not idle time): a straggler everybody else waits for at the next collective;
* ``SHARDLIGHT_TEST_INPUT_DELAY_MS``: every rank's data loader sleeps that long per batch (inside
  DataLoader ``__next__``, where a slow dataset or tokenizer spends its time): input-bound.
* ``SHARDLIGHT_TEST_WINDOW_COST_MS``: every rank's training thread sleeps that long when a comm window
  that starts at or after step ``SHARDLIGHT_TEST_WINDOW_COST_FROM_STEP`` (0) stops recording (inside
  ``CommTimeCallback._finish``, before its analysis thread starts): a window that costs that much more.

Everything else is the real run: real gloo FSDP, the real callbacks and diagnosis. Lightning re-executes this
script for the other ranks, so every rank is patched.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data._utils import fetch  # noqa: E402

STALL_MS = float(os.environ.get("SHARDLIGHT_TEST_STALL_MS", "0"))
STALL_RANK = int(os.environ.get("SHARDLIGHT_TEST_STALL_RANK", "1"))
INPUT_DELAY_MS = float(os.environ.get("SHARDLIGHT_TEST_INPUT_DELAY_MS", "0"))
WINDOW_COST_MS = float(os.environ.get("SHARDLIGHT_TEST_WINDOW_COST_MS", "0"))
WINDOW_COST_FROM_STEP = int(os.environ.get("SHARDLIGHT_TEST_WINDOW_COST_FROM_STEP", "0"))


def _rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _busy(ms: float) -> None:
    """``ms`` milliseconds of matrix products: profiled as computation (aten::mm), not as idle time."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


if STALL_MS > 0:
    from shardlight.causal_lm import CausalLMModule

    _training_step = CausalLMModule.training_step

    def _stalled_training_step(self, batch, batch_idx):
        if _rank() == STALL_RANK:
            _busy(STALL_MS)
        return _training_step(self, batch, batch_idx)

    CausalLMModule.training_step = _stalled_training_step

if INPUT_DELAY_MS > 0:
    _fetch = fetch._MapDatasetFetcher.fetch

    def _slow_fetch(self, possibly_batched_index):
        time.sleep(INPUT_DELAY_MS / 1000.0)
        return _fetch(self, possibly_batched_index)

    fetch._MapDatasetFetcher.fetch = _slow_fetch

if WINDOW_COST_MS > 0:
    from shardlight.callbacks.comm import CommTimeCallback

    _finish = CommTimeCallback._finish

    def _costly_finish(self, trainer, window):
        if window["start"] >= WINDOW_COST_FROM_STEP:
            time.sleep(WINDOW_COST_MS / 1000.0)  # before the window's background analysis starts: no overlap
        _finish(self, trainer, window)

    CommTimeCallback._finish = _costly_finish

if __name__ == "__main__":
    from shardlight.cli.main import leave, main

    leave(main(sys.argv[1:]))
