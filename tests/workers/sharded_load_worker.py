"""One sharded load of a pretrained checkpoint on WORLD gloo ranks, as the strategy does it (skeleton → TP/FSDP →
materialize → read each rank's slices), measured from outside the library's own report.

    python sharded_load_worker.py RECIPE REFERENCE_LOGITS OUT_JSON WORLD [OVERRIDE ...]

Each rank writes OUT_JSON.rank<r>: its peak-RSS growth over the load (bytes, getrusage), and rank 0 also the
largest |difference| between the loaded weights and the checkpoint's tensors (gathered after the measurement)
and between the sharded model's logits and the single-process ``from_pretrained`` logits in REFERENCE_LOGITS.
"""

import json
import os
import resource
import socket
import sys


def rank_main(rank, world, port, recipe, reference, out, overrides):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardlight.build.training_model import build_training_model, sharded_weights_folder
    from shardlight.recipe import load_recipe
    from shardlight.strategy import resolve_recipe_fsdp
    from shardlight.strategy.fsdp1 import apply_fsdp1, fsdp1_full_state_dict, fsdp1_mesh
    from shardlight.strategy.fsdp2 import apply_fsdp2, fsdp2_mesh
    from shardlight.strategy.sharded_load import load_safetensors, materialize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_recipe(recipe, [f"trainer.devices={world}", *overrides])
    resolved = resolve_recipe_fsdp(cfg)
    folder = sharded_weights_folder(cfg)
    cpu = torch.device("cpu")
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    model = build_training_model(cfg, weights=False)
    if resolved.version == 1:
        model, _ = apply_fsdp1(model, resolved, cpu, mesh=fsdp1_mesh(resolved, "cpu"), weights=folder)
        tensors = None
    else:
        model, _ = apply_fsdp2(model, resolved, fsdp2_mesh(resolved, "cpu", world))
        materialize(model, cpu)
        tensors = load_safetensors(model, folder)

    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    result = {"rss_growth": growth, "tensors": tensors}
    ids = torch.load(reference, weights_only=True)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if resolved.version == 1:  # offloading to the CPU a CPU rank's tensors frees them (shardlight's note)
        full = fsdp1_full_state_dict(model, cpu)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        result["logits_diff"] = float((logits - torch.load(reference, weights_only=True)["logits"]).abs().max())
        worst = 0.0
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(str(folder / name), framework="pt") as f:
                    for key in f.keys():
                        worst = max(worst, float((full[key] - f.get_tensor(key).float()).abs().max()))
        result["weights_diff"] = worst
        result["weights_compared"] = len(full)
    with open(f"{out}.rank{rank}", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    recipe, reference, out, world, *overrides = sys.argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(int(world), port, recipe, reference, out, overrides), nprocs=int(world))
