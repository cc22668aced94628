"""`shardlight train ARGS` with instrumented_train's collective counters, also keeping the trained model's full
state dict (gathered on rank 0 for the export) in $SHARDLIGHT_FULL_STATE, so a test can check every frozen
base weight bitwise, not only the adapter the export writes. The run itself is a real gloo FSDP run."""

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import instrumented_train  # noqa: E402  (installs the counters)
from safetensors.torch import save_file  # noqa: E402

from shardlight.strategy import ShardlightFSDPStrategy  # noqa: E402

_full_state_dict = ShardlightFSDPStrategy.full_state_dict


@functools.wraps(_full_state_dict)
def _keeping_full_state_dict(self):
    state = _full_state_dict(self)
    out = os.environ.get("SHARDLIGHT_FULL_STATE")
    if out and state:  # rank 0 only holds it
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, out)
    return state


ShardlightFSDPStrategy.full_state_dict = _keeping_full_state_dict

if __name__ == "__main__":
    import json

    from shardlight.cli.main import leave, main

    code = main(sys.argv[1:])
    out = os.environ.get("SHARDLIGHT_COUNTS_DIR")
    if out and code == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(instrumented_train.COUNTS))
    leave(code)
