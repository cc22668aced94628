"""`shardlight train ARGS` where one rank dies or stops in the live export after fit, for the fault tests.

$EXPORT_FAULT is ``<rank>:kill`` (SIGKILL) or ``<rank>:stop`` (SIGSTOP: a hung rank), or ``all:raise`` (every rank
raises ``OSError``, as a full disk they share would). That rank does it to itself as it enters the safetensors
write (the reference forward before it has run on every rank), so the
other rank is inside the export's collectives when the peer goes. Every rank writes its pid to
``$EXPORT_FAULT_DIR/rank<R>.pid`` at start; the victim writes the time of its fault to ``fault`` just before.

The run is otherwise real (a 2-rank gloo FSDP fit); Lightning's launcher re-executes this script for rank 1,
so the wrapper is in place on every rank.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import shardlight.checkpoint.export as export  # noqa: E402

_DIR = Path(os.environ["EXPORT_FAULT_DIR"])
_RANK, _ACTION = os.environ["EXPORT_FAULT"].split(":")
_SIGNAL = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "raise": None}[_ACTION]
_write = export.write_safetensors_folder


def _faulty_write(state, out_dir, max_shard_bytes):
    import torch.distributed as dist

    if _ACTION == "raise":
        raise OSError(28, "No space left on device (injected)")
    if dist.get_rank() == int(_RANK):
        (_DIR / "fault").write_text(repr(time.time()))
        os.kill(os.getpid(), _SIGNAL)
    return _write(state, out_dir, max_shard_bytes)


export.write_safetensors_folder = _faulty_write

if __name__ == "__main__":
    from shardlight.cli.main import leave, main

    _DIR.mkdir(parents=True, exist_ok=True)
    (_DIR / f"rank{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(str(os.getpid()))
    leave(main(sys.argv[1:]))
