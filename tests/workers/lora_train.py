"""`shardlight train ARGS` with instrumented_train's collective counters, also keeping the trained model's full
state dict (gathered on rank 0 as the export begins, which itself gathers only the adapters) in
$SHARDLIGHT_FULL_STATE, so a test can check every frozen base weight bitwise, not only the adapter the export
writes. The run itself is a real gloo FSDP run."""

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import instrumented_train  # noqa: E402  (installs the counters)
from safetensors.torch import save_file  # noqa: E402

import shardlight.checkpoint.adapter_export as adapter_export  # noqa: E402

_live_reference_logits = adapter_export.live_reference_logits


@functools.wraps(_live_reference_logits)
def _keeping_full_state(trainer, module):
    state = trainer.strategy.full_state_dict()  # every rank: a collective
    out = os.environ.get("SHARDLIGHT_FULL_STATE")
    if out and state:  # rank 0 only holds it
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, out)
    return _live_reference_logits(trainer, module)


adapter_export.live_reference_logits = _keeping_full_state

if __name__ == "__main__":
    import json

    from shardlight.cli.main import leave, main

    code = main(sys.argv[1:])
    out = os.environ.get("SHARDLIGHT_COUNTS_DIR")
    if out and code == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{os.environ.get('LOCAL_RANK', '0')}.json").write_text(json.dumps(instrumented_train.COUNTS))
    leave(code)
