"""4 gloo ranks, a (dp_shard 2, tp 2) mesh: a two-layer MLP with Colwise/Rowwise tensor parallelism and FSDP2
over the shard dimension, 3 steps under torch.profiler with the flight recorder on, as a run's comm window.

Usage: python tp_groups_worker.py OUT_DIR PORT [hang]

Known truth per step and rank: one FSDP all-gather and one reduce-scatter in the rank's shard group
(``mesh_dp_shard``: ranks r and r ^ 2), one tensor-parallel all-reduce in its TP group (``mesh_tp``: the pair
2k, 2k + 1; the RowwiseParallel output). Each rank writes ``OUT_DIR/rank<R>.pt.trace.json`` with the collectives
it issued beside it (``rank<R>.collectives.json``, what the comm callback writes), and ``rank<R>.live.json``: the
live analysis of the same window (``analyze_profile`` with those collectives).

``hang``: then one more step, in which rank 3 stops before the RowwiseParallel layer (a forward pre-hook that
waits forever), so rank 2 waits in their TP all-reduce and ranks 0 and 1, in backward, in the FSDP
reduce-scatter with ranks 2 and 3. After 5 s every rank dumps its flight recorder and stack as the hang watchdog
does (``OUT_DIR/flight_recorder/rank_<R>``) and exits.
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


def _dump_after(seconds: float, rank: int, folder: Path) -> None:
    import pickle
    import threading
    import time

    from shardlight.callbacks._flight_recorder import recorder_dump
    from shardlight.callbacks.hang import _main_thread_stack

    def dump() -> None:
        time.sleep(seconds)
        data = recorder_dump()
        data["shardlight"] = {"rank": rank, "world_size": 4, "stack": _main_thread_stack(), "idle_s": seconds}
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".rank_{rank}.partial"
        partial.write_bytes(pickle.dumps(data))
        partial.replace(folder / f"rank_{rank}")  # whole or absent, as the watchdog writes it
        deadline = time.time() + 60  # leave once every rank has dumped: an exit breaks the others' collectives
        while len(list(folder.glob("rank_*"))) < 4 and time.time() < deadline:
            time.sleep(0.1)
        os._exit(0)

    threading.Thread(target=dump, daemon=True).start()


def worker(rank: int, out: str, port: int, hang: bool) -> None:
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
    if hang:
        import threading

        if rank == 3:
            model[2].register_forward_pre_hook(lambda module, args: threading.Event().wait(), prepend=True)
        _dump_after(5.0, rank, Path(out) / "flight_recorder")
        try:
            model(x).sum().backward()
        except RuntimeError:  # a rank that dumped and left closed this one's collective: its dump thread exits
            threading.Event().wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["hang"]), nprocs=4, join=True)
