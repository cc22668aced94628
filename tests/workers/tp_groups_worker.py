"""4 gloo ranks, a (dp_shard 2, tp 2) mesh: a two-layer MLP with Colwise/Rowwise tensor parallelism and FSDP2
over the shard dimension, 3 steps under torch.profiler with the flight recorder on, as a run's comm window.

Usage: python tp_groups_worker.py OUT_DIR PORT

Known truth per step and rank: one FSDP all-gather and one reduce-scatter in the rank's shard group
(``mesh_dp_shard``: ranks r and r ^ 2), one tensor-parallel all-reduce in its TP group (``mesh_tp``: the pair
2k, 2k + 1; the RowwiseParallel output). Each rank writes ``OUT_DIR/rank<R>.pt.trace.json`` with the collectives
it issued beside it (``rank<R>.collectives.json``, what the comm callback writes), and ``rank<R>.live.json``: the
live analysis of the same window (``analyze_profile`` with those collectives).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS = 3


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE="2000")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from shardlight.callbacks._flight_recorder import issued_between, issued_marks
    from shardlight.trace.live import analyze_profile
    from shardlight.trace.records import write_issued

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_shard"])
    x = torch.randn(8, 64)
    model(x).sum().backward()  # warm-up, outside the window
    mark = issued_marks()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):  # the step the last prof.step() opens is empty: the one the analysis drops
            model(x).sum().backward()
            prof.step()
    issued = issued_between(mark, issued_marks())
    trace = Path(out) / f"rank{rank}.pt.trace.json"
    prof.export_chrome_trace(str(trace))
    write_issued(trace, issued)
    live = analyze_profile(prof, issued=issued)
    (Path(out) / f"rank{rank}.live.json").write_text(json.dumps(live["by_group"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=4, join=True)
