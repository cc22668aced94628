"""2 gloo ranks: ``framework.full_params`` on FSDP1 and FSDP2 shows full shapes, writes back only when asked.

Usage: python full_params_worker.py OUT.json (rank 0 writes what it saw).

Each rank ends with ``os._exit`` once the process group is destroyed and its output flushed. Destroying it
does not stop gloo here: torch keeps the process group referenced after ``destroy_process_group`` (FSDP2's
DeviceMesh holds it in ``_pg_registry`` and DTensor's sharding/redistribute caches keep the mesh; and
``torch.distributed.nn.functional``, which FSDP imports, binds ``group.WORLD`` as a default argument when
first imported after init, hence the imports at the top). Its threads (gloo's run loops and TCP loop, rank
0's TCPStore server) were still running when a spawned rank left through ``sys.exit``: interpreter
finalization and the C++ static destructors then ran beside them, which now and then aborted a rank with
"terminate called without an active exception". ``os._exit`` ends the process without tearing anything down
around live threads (as multiprocessing's fork children do)"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shardlight import full_params  # noqa: E402
from shardlight.strategy.unshard import register_fsdp_root  # noqa: E402


def build():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    holder = nn.Module()  # stands in for the LightningModule: the HF model is ``.model``
    holder.model = LlamaForCausalLM(config)
    return holder


def wrap(holder, version):
    if version == 1:
        root = FSDP(holder, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=True,
                    device_id=torch.device("cpu"))
        register_fsdp_root(root)
        return root
    for layer in holder.model.model.layers:
        fully_shard(layer)
    fully_shard(holder.model)
    return holder


def check(version):
    holder = build()
    expected = holder.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    root = wrap(holder, version)  # noqa: F841  (the FSDP1 root must stay alive, as the strategy keeps it)
    model = holder.model
    seen = {"sharded_numel": model.model.layers[0].self_attn.q_proj.weight.to_local().numel()
            if hasattr(model.model.layers[0].self_attn.q_proj.weight, "to_local")
            else model.model.layers[0].self_attn.q_proj.weight.numel()}
    with full_params(model):
        q = model.model.layers[0].self_attn.q_proj.weight
        seen["shape"] = list(q.shape)
        seen["embed_shape"] = list(model.model.embed_tokens.weight.shape)
        seen["equal_to_init"] = bool(torch.equal(q.detach(), expected))
        with torch.no_grad():
            q.add_(1.0)  # discarded: no writeback
    with full_params(model, writeback=True):
        q = model.model.layers[0].self_attn.q_proj.weight
        seen["discarded"] = bool(torch.equal(q.detach(), expected))
        with torch.no_grad():
            q.add_(1.0)
            model.model.embed_tokens.weight.mul_(0.0)
    with full_params(model):
        seen["written_back"] = bool(torch.equal(model.model.layers[0].self_attn.q_proj.weight.detach(),
                                                expected + 1.0))
        seen["embed_zero"] = bool((model.model.embed_tokens.weight == 0).all())
    seen["sharded_after"] = list(model.model.layers[0].self_attn.q_proj.weight.shape)
    return seen


def main(rank, world, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("FP_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {f"fsdp{v}": check(v) for v in (1, 2)}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()  # both ranks done with every collective
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not sys.exit: gloo's threads outlive the destroy (see the top)


if __name__ == "__main__":
    mp.spawn(main, args=(2, sys.argv[1]), nprocs=2)
