"""How close is ``shardlight plan``'s memory to the allocator's? One JSON line.

For small shapes of three architectures (Llama-style, GPT-2, a Mixtral mixture-of-experts), in 32-true and
bf16-mixed, with and without activation checkpointing, the same training step (the model as
``shardlight.planner.fake_step.build_sharded_model`` shards it, shardlight's loss, AdamW; two steps, the
second measured) runs twice:

* measured: real CPU tensors on a real gloo process group (1 rank in-process; 2 spawned ranks for
  SHARD_GRAD_OP and FULL_SHARD in bf16-mixed), every allocation counted from the CPU
  allocator's events (PyTorch profiler, ``profile_memory``) from before the model is built, so the live
  total is exact: step peak = the highest live total during the second step; forward = what forward + loss
  left alive when backward starts;
* fake: ``step_memory`` (FakeTensorMode, fake process group, FSDPMemTracker): what ``shardlight plan`` uses;
* analytic: the closed-form model (``--analytic``), for reference.

Relative error = (estimate - measured) / measured. Run (shardlight installed): python benchmarks/plan_accuracy.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from shardlight.planner.estimate import Workload, estimate, make_cluster
from shardlight.planner.fake_step import (
    build_sharded_model,
    make_optimizer,
    shardlight_loss,
    step_memory,
    strategy_mesh,
)
from shardlight.planner.model_spec import model_spec

SHAPES = [
    {"name": "llama-h256-L4-v8k", "model_type": "llama", "batch": 4, "seq": 256,
     "config": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 4096}},
    {"name": "gpt2-h256-L4-v8k", "model_type": "gpt2", "batch": 4, "seq": 256,
     "config": {"n_embd": 256, "n_layer": 4, "n_head": 8, "vocab_size": 8192, "n_positions": 1024}},
    {"name": "mixtral-h256-L2-e4k2-v8k", "model_type": "mixtral", "batch": 2, "seq": 256,
     "config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 4, "vocab_size": 8192, "num_local_experts": 4, "num_experts_per_tok": 2,
                "max_position_embeddings": 4096}},
]
STRATEGY = "FULL_SHARD"


def hf_config(shape):
    from transformers import AutoConfig

    return AutoConfig.for_model(shape["model_type"], **shape["config"])


def live_bytes_timeline(prof):
    """[(ts, live bytes after the event)] of the CPU allocator, and the user annotations' (start, end) by name."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    marks = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
             if e.get("cat") == "user_annotation" and e["name"].startswith("bench.")}
    live, timeline = 0, []
    for event in memory:
        live += event["args"]["Bytes"]
        timeline.append((event["ts"], live))
    return timeline, marks


def measure_real(shape, checkpointing: bool, precision: str, strategy: str = STRATEGY, rank: int = 0,
                 world_size: int = 1, store_path: str = ""):
    """(step peak, forward alive) from the allocator for the second step of this rank, on a real gloo group
    (in-process for one rank; ``store_path``: the FileStore all ranks of a spawned group share)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    store = dist.FileStore(store_path, world_size) if store_path else dist.HashStore()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    try:
        mesh = strategy_mesh(strategy, world_size, None)
        torch.manual_seed(rank)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build_sharded_model(hf_config(shape), mesh, strategy, checkpointing, precision, "float32")
            optim = make_optimizer("adamw", model.parameters())
            input_ids = torch.randint(0, shape["config"]["vocab_size"], (shape["batch"], shape["seq"]))
            for step in range(2):
                with record_function(f"bench.step{step}"):
                    with record_function(f"bench.forward{step}"):
                        loss = shardlight_loss(model, input_ids)
                    loss.backward()
                    optim.step()
                    optim.zero_grad(set_to_none=True)
                    del loss
        timeline, marks = live_bytes_timeline(prof)
    finally:
        dist.destroy_process_group()
    start, end = marks["bench.step1"]
    f_start, f_end = marks["bench.forward1"]

    def live_at(ts):
        return next((live for t, live in reversed(timeline) if t <= ts), 0)

    peak = max([live for t, live in timeline if start <= t <= end] + [live_at(start)])
    return peak, live_at(f_end) - live_at(f_start)


def _rank_worker(rank, shape, checkpointing, precision, strategy, world_size, tmp):
    # One spawned rank: torch's gloo CPU threads per rank share the machine as training's ranks do.
    torch.set_num_threads(1)
    result = measure_real(shape, checkpointing, precision, strategy, rank, world_size, str(Path(tmp) / "store"))
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))


def measure_real_ranks(shape, checkpointing: bool, precision: str, strategy: str, world_size: int):
    """``measure_real`` on ``world_size`` spawned gloo ranks: rank 0's (step peak, forward alive)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_worker, args=(shape, checkpointing, precision, strategy, world_size, tmp),
                 nprocs=world_size, join=True)
        return tuple(json.loads((Path(tmp) / "rank0.json").read_text()))


def rel(estimate_value, measured):
    return round((estimate_value - measured) / measured, 4)


def main() -> None:
    cases = []
    cluster = make_cluster(nodes=1, gpus_per_node=1, gpu_memory="80GB", overhead_gb=0)
    for shape in SHAPES:
        config = hf_config(shape)
        spec = model_spec(config)
        for precision in ("32-true", "bf16-mixed"):
            for ckpt in (False, True):
                peak_real, forward_real = measure_real(shape, ckpt, precision)
                fake = step_memory(config, 1, STRATEGY, ckpt, precision, shape["batch"], shape["seq"])
                work = Workload(micro_batch_size=shape["batch"], seq_len=shape["seq"], precision=precision,
                                param_dtype="float32")
                analytic = estimate(spec, cluster, work, STRATEGY, ckpt, False)
                cases.append({
                    "shape": shape["name"], "precision": precision, "activation_checkpointing": ckpt,
                    "strategy": STRATEGY, "world_size": 1,
                    "peak_measured": peak_real, "peak_fake": fake["peak"], "peak_analytic": analytic["peak_bytes"],
                    "peak_rel_err": rel(fake["peak"], peak_real),
                    "peak_rel_err_analytic": rel(analytic["peak_bytes"], peak_real),
                    "forward_measured": forward_real, "forward_fake": fake["forward_alive"],
                    "activation_rel_err": rel(fake["forward_alive"], forward_real),
                })
    for shape in SHAPES:
        # Two real ranks per sharded strategy: the fake process group's per-rank layout against gloo's.
        config = hf_config(shape)
        for strategy in ("SHARD_GRAD_OP", "FULL_SHARD"):
            peak_real, forward_real = measure_real_ranks(shape, False, "bf16-mixed", strategy, 2)
            fake = step_memory(config, 2, strategy, False, "bf16-mixed", shape["batch"], shape["seq"])
            cases.append({"shape": shape["name"], "precision": "bf16-mixed", "activation_checkpointing": False,
                          "strategy": strategy, "world_size": 2, "peak_measured": peak_real, "peak_fake": fake["peak"],
                          "peak_rel_err": rel(fake["peak"], peak_real), "forward_measured": forward_real,
                          "forward_fake": fake["forward_alive"],
                          "activation_rel_err": rel(fake["forward_alive"], forward_real)})
    worst = {key: max(abs(c[key]) for c in cases if key in c) for key in ("peak_rel_err", "activation_rel_err",
                                                                          "peak_rel_err_analytic")}
    print(json.dumps({"benchmark": "plan_accuracy", "device": "cpu", "runs": len(cases),
                      "peak_rel_err_max_abs": worst["peak_rel_err"],
                      "activation_rel_err_max_abs": worst["activation_rel_err"],
                      "analytic_peak_rel_err_max_abs": worst["peak_rel_err_analytic"], "cases": cases}))


if __name__ == "__main__":
    main()
