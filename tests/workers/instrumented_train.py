"""`shardlight train ARGS` with counters, for tests and benchmarks: gradient reduce-scatters (calls and
bytes), all-gathers, and decoder-block forward calls, per rank, written to $SHARDLIGHT_COUNTS_DIR.

The counters wrap (not replace) the real functions, so the run is a real gloo FSDP run. Lightning's
launcher re-executes this script for the other ranks, so every rank counts.
"""

import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import is_fake  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

COUNTS = {"reduce_scatter": 0, "reduce_scatter_bytes": 0, "all_gather": 0, "block_forward": 0}


def _count_collective(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        COUNTS[name] += 1
        if name == "reduce_scatter":
            tensor = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
            COUNTS["reduce_scatter_bytes"] += tensor.numel() * tensor.element_size()
        return fn(*args, **kwargs)

    return wrapper


# torch 2.13 names the tensor collectives *_single (the older names forward to them, so wrap one).
for _name, _functions in (("reduce_scatter", ("reduce_scatter_single", "reduce_scatter_tensor")),
                          ("all_gather", ("all_gather_single", "all_gather_into_tensor"))):
    _attr = next(f for f in _functions if hasattr(dist, f))
    setattr(dist, _attr, _count_collective(_name, getattr(dist, _attr)))
# FSDP1 all-gathers into a tensor list on backends without a single-tensor all-gather (gloo).
dist.all_gather = _count_collective("all_gather", dist.all_gather)
_block_forward = modeling_llama.LlamaDecoderLayer.forward


def _counted_forward(self, *args, **kwargs):
    # Preflight's one step on fake tensors (in the launching process, rank 0) is not a training forward.
    if not is_fake(args[0] if args else kwargs["hidden_states"]):
        COUNTS["block_forward"] += 1
    return _block_forward(self, *args, **kwargs)


modeling_llama.LlamaDecoderLayer.forward = _counted_forward

if __name__ == "__main__":
    from shardlight.cli.main import leave, main

    code = main(sys.argv[1:])
    out = os.environ.get("SHARDLIGHT_COUNTS_DIR")
    if out and code == 0:
        rank = int(os.environ.get("LOCAL_RANK", "0")) + int(os.environ.get("NODE_RANK", "0")) * 0
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(COUNTS))
    leave(code)
