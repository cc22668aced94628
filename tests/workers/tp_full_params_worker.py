"""4 gloo ranks, a dp_shard 2 x tp 2 mesh through ``apply_fsdp2``: ``full_params`` on the 2-D (FSDP x TP)
shards shows full weights equal to the unsharded model's, and writes back only when asked.

Usage: python tp_full_params_worker.py OUT.json (rank 0 writes what it saw). Ends with ``os._exit`` for the
reason ``full_params_worker.py`` gives (gloo's threads outlive ``destroy_process_group``).
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shardlight import full_params  # noqa: E402
from shardlight.recipe import FSDPConfig  # noqa: E402
from shardlight.strategy import apply_fsdp2, resolve_fsdp  # noqa: E402
from shardlight.strategy.fsdp2 import fsdp2_mesh  # noqa: E402
from shardlight.strategy.tensor_parallel import ParallelDims  # noqa: E402


def check():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    resolved = dataclasses.replace(
        resolve_fsdp(FSDPConfig(fsdp_version=2, transformer_cls_names_to_wrap=["LlamaDecoderLayer"])),
        parallel=ParallelDims(dp_replicate=1, dp_shard=2, tp=2))
    model, report = apply_fsdp2(model, resolved, fsdp2_mesh(resolved, "cpu", 4))
    q = model.model.layers[0].self_attn.q_proj.weight
    seen = {"q_local_shape": list(q.to_local().shape), "q_mesh": list(q.device_mesh.mesh_dim_names),
            "mesh": report["mesh"], "params_this_rank": report["params_this_rank"]}
    with full_params(model):
        seen["all_equal_to_init"] = all(torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters())
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(1.0)  # discarded: no writeback
    with full_params(model, writeback=True):
        down = model.model.layers[1].mlp.down_proj.weight
        seen["discarded"] = bool(torch.equal(model.model.layers[0].self_attn.q_proj.weight.detach(),
                                             expected["model.layers.0.self_attn.q_proj.weight"]))
        with torch.no_grad():
            down.add_(1.0)
    with full_params(model):
        seen["written_back"] = bool(torch.equal(model.model.layers[1].mlp.down_proj.weight.detach(),
                                                expected["model.layers.1.mlp.down_proj.weight"] + 1.0))
    return seen


def main(rank, world, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("FP_PORT", "29534"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    seen = check()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(seen, fh)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(main, args=(4, sys.argv[1]), nprocs=4)
