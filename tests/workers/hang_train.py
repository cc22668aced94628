"""`shardlight train ARGS` where one rank gets stuck just before an FSDP all-gather, for the hang tests.

$HANG_INJECT is ``<rank>:block`` (that rank's main thread waits forever: a deadlock, a stuck data loader),
``<rank>:stop`` (it SIGSTOPs itself: a hung host) or ``<rank>:raise`` (a ValueError: a bug that shows on one
rank). It happens at optimizer step $HANG_STEP, in a forward
pre-hook of the second decoder layer put before FSDP's own (so the layer's all-gather is never issued on that
rank while the others wait in it). Every rank writes its pid to ``$HANG_MARKS/rank<R>.pid`` at start.

The run is otherwise real (2 gloo ranks); Lightning's launcher re-executes this script for rank 1, so the hook is
in place on every rank.
"""

import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402

import shardlight.build.trainer as trainer_builder  # noqa: E402

_MARKS = Path(os.environ["HANG_MARKS"])
_RANK, _ACTION = os.environ["HANG_INJECT"].split(":")
_STEP = int(os.environ.get("HANG_STEP", "3"))


def stuck_before_the_all_gather(module, args):
    (_MARKS / "stuck").write_text(str(os.getpid()))
    if _ACTION == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if _ACTION == "raise":
        raise ValueError(f"injected on rank {_RANK} at step {_STEP}")
    threading.Event().wait()  # forever


class _Inject(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == int(_RANK) and trainer.global_step == _STEP:
            layer = next(m for name, m in pl_module.named_modules() if name.endswith("layers.1"))
            layer.register_forward_pre_hook(stuck_before_the_all_gather, prepend=True)


_build_callbacks = trainer_builder.build_callbacks
trainer_builder.build_callbacks = lambda *a, **k: _build_callbacks(*a, **k) + [_Inject()]

if __name__ == "__main__":
    from shardlight.cli.main import leave, main

    _MARKS.mkdir(parents=True, exist_ok=True)
    (_MARKS / f"rank{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(str(os.getpid()))
    leave(main(sys.argv[1:]))
