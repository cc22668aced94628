"""`shardlight train ARGS` whose rank 1 starts $LATE_RANK_S seconds late (a slow node: imports, a cold cache),
for the start-up timeout test. Lightning's launcher re-executes this script for rank 1 (LOCAL_RANK=1)."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":
    if os.environ.get("LOCAL_RANK") == "1":
        time.sleep(float(os.environ["LATE_RANK_S"]))
    from shardlight.cli.main import leave, main

    leave(main(sys.argv[1:]))
