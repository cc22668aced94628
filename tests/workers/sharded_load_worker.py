"""One sharded load of a pretrained checkpoint on WORLD gloo ranks, as the strategy does it (skeleton → TP/FSDP →
materialize → read each rank's slices), measured from outside the library's own report.

    python sharded_load_worker.py RECIPE REFERENCE_LOGITS OUT_JSON EXPORT_DIR WORLD [OVERRIDE ...]

Each rank writes OUT_JSON.rank<r>: its peak-RSS growth over the load (bytes, getrusage), and rank 0 also the
largest |difference| between the loaded weights and the checkpoint's tensors (gathered after the measurement)
and between the sharded model's logits and the single-process ``from_pretrained`` logits in REFERENCE_LOGITS.
Then the ranks export the loaded model to EXPORT_DIR in 100 MB files (``safetensors_folder``): each rank's
read-back difference and its peak RSS over what it held before, and on rank 0 the exported tensors against
the checkpoint's.
"""

import json
import os
import resource
import socket
import sys
from pathlib import Path


def rank_main(rank, world, port, recipe, reference, out, export, overrides):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import psutil
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardlight.build.training_model import build_training_model, sharded_weights_folder
    from shardlight.checkpoint.safetensors_folder import verify_safetensors_folder, write_safetensors_folder
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

    # The export, from the shards: what it adds to the memory the ranks hold now (peak after - RSS before).
    state = {k: v for k, v in get_model_state_dict(model).items()}
    held = psutil.Process().memory_info().rss
    write_safetensors_folder(state, export, max_shard_bytes=100 * 10**6)
    result["export_diff"] = verify_safetensors_folder(state, export)
    result["export_rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - held
    del state
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
        # The exported folder holds the checkpoint's tensors (upcast to the run's fp32), exactly.
        index = json.loads((Path(export) / "model.safetensors.index.json").read_text())["weight_map"]
        exported_worst = 0.0
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(str(folder / name), framework="pt") as f:
                    for key in f.keys():
                        with safe_open(str(Path(export) / index[key]), framework="pt") as g:
                            exported = g.get_tensor(key)
                        assert exported.dtype == torch.float32, exported.dtype
                        exported_worst = max(exported_worst, float((exported - f.get_tensor(key).float()).abs().max()))
        result["exported_vs_checkpoint"] = exported_worst
        result["exported_files"] = sorted(set(index.values()))
    with open(f"{out}.rank{rank}", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not a normal exit: gloo's threads outlive the destroy (full_params_worker.py says why)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    recipe, reference, out, export, world, *overrides = sys.argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(int(world), port, recipe, reference, out, export, overrides), nprocs=int(world))
