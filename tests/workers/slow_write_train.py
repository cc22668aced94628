"""`shardlight train ARGS` on a slow file system, for the async checkpoint tests.

Every DCP write of checkpoint shards sleeps ``$SLOW_WRITE_S`` seconds before it writes, as a parallel file
system under load would: a synchronous save holds training for that long, an asynchronous one must not.
Lightning's launcher re-executes this script for rank 1, so the slow writer is in place on every rank.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.checkpoint import filesystem  # noqa: E402

_DELAY_S = float(os.environ["SLOW_WRITE_S"])
_write_data = filesystem._FileSystemWriter.write_data


def _slow_write_data(self, plan, planner):
    time.sleep(_DELAY_S)
    return _write_data(self, plan, planner)


filesystem._FileSystemWriter.write_data = _slow_write_data

if __name__ == "__main__":
    from shardlight.cli.main import leave, main

    leave(main(sys.argv[1:]))
