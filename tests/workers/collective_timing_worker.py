"""2 gloo ranks: collectives of known sizes under torch.profiler, timed with perf_counter too.

Usage: python collective_timing_worker.py OUT_DIR PORT REPS STALL_MS

Two profiled phases, each in its own trace directory:

* ``OUT_DIR/timing/rep<K>/rank<R>.pt.trace.json``: one profiled window per repetition K (so a
  test can compare call by call, robust to a noisy host), each with one all_gather_into_tensor,
  reduce_scatter_tensor and all_reduce, a barrier before each call so the ranks arrive together
  and the call's perf_counter time is (almost) all transfer. ``.../rep<K>/rank<R>.json`` holds
  those times: ``{"<kind>": {"bytes", "seconds"}}``, bytes in nccl-tests' convention.
* ``OUT_DIR/stall/rank<R>.pt.trace.json``: REPS + 1 recorded ``ProfilerStep``s (the analysis
  drops the last, as HTA), one all_gather each, no barrier; rank 1 sleeps STALL_MS before each,
  so rank 0 waits about that long in every one. ``.../stall/rank<R>.json`` holds when each rank issued each
  all_gather (``{"issued_s": [...]}``, perf_counter: one clock for the host's processes): the true wait of
  rank 0 in iteration K is rank 1's issue time minus its own, whatever a loaded host adds on either side.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Sizes in float32 elements: a few MiB, so a call takes milliseconds and the fixed cost of handing
# the work to gloo's thread and back (0.1-0.5 ms on a busy 2-core host) is a small part of it.
GATHER_INPUT = 1 << 21  # 8 MiB per rank in, 16 MiB out on 2 ranks
SCATTER_INPUT = 1 << 23  # 32 MiB in, 16 MiB out per rank
REDUCE_BUFFER = 1 << 23  # 32 MiB


def _timed(call) -> float:
    dist.barrier()  # arrive together: what perf_counter then measures is the transfer
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def timing_phase(rank: int, world: int, reps: int, out_dir: str) -> None:
    gather_in = torch.ones(GATHER_INPUT)
    gather_out = torch.empty(GATHER_INPUT * world)
    scatter_in = torch.ones(SCATTER_INPUT)
    scatter_out = torch.empty(SCATTER_INPUT // world)
    reduce_buf = torch.ones(REDUCE_BUFFER)
    calls = [
        ("all_gather", 4 * GATHER_INPUT * world, lambda: dist.all_gather_into_tensor(gather_out, gather_in)),
        ("reduce_scatter", 4 * SCATTER_INPUT, lambda: dist.reduce_scatter_tensor(scatter_out, scatter_in)),
        ("all_reduce", 4 * REDUCE_BUFFER, lambda: dist.all_reduce(reduce_buf)),
    ]
    for _, _, call in calls:  # warm the connections outside the profile
        call()
    for rep in range(reps):
        rep_dir = os.path.join(out_dir, f"rep{rep}")
        os.makedirs(rep_dir, exist_ok=True)
        times = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for kind, size, call in calls:
                times[kind] = {"bytes": size, "seconds": _timed(call)}
        prof.export_chrome_trace(os.path.join(rep_dir, f"rank{rank}.pt.trace.json"))
        with open(os.path.join(rep_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(times, handle)


def stall_phase(rank: int, world: int, reps: int, stall_ms: float, out_dir: str) -> None:
    gather_in = torch.ones(GATHER_INPUT)
    gather_out = torch.empty(GATHER_INPUT * world)
    dist.barrier()
    # ProfilerStep rows are written only under a schedule; its one warm-up step is not recorded.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=reps + 1, repeat=1)

    def export(profiler):
        profiler.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.pt.trace.json"))

    issued = []  # perf_counter (one clock for every process of the host) as each all_gather is issued
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=schedule, on_trace_ready=export) as prof:
        for _ in range(reps + 2):
            if rank == 1:
                time.sleep(stall_ms / 1e3)
            issued.append(time.perf_counter())
            dist.all_gather_into_tensor(gather_out, gather_in)
            prof.step()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"issued_s": issued}, handle)


def worker(rank: int, world: int, out_dir: str, port: int, reps: int, stall_ms: float) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    timing_phase(rank, world, reps, os.path.join(out_dir, "timing"))
    stall_phase(rank, world, reps, stall_ms, os.path.join(out_dir, "stall"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out, port, reps, stall = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    for phase in ("timing", "stall"):
        os.makedirs(os.path.join(out, phase), exist_ok=True)
    mp.spawn(worker, args=(2, out, port, reps, stall), nprocs=2, join=True)
