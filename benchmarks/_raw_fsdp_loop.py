"""The hand-written raw torch FSDP loop the timing benchmarks compare shardlight with.

The same model, batch shapes and settings as the shardlight arm (FSDP1 FULL_SHARD, one unit per decoder
block, BACKWARD_PRE, limit_all_gathers, use_orig_params; AdamW with shardlight's betas and weight decay, a
warm-up + cosine LambdaLR, global-norm clipping at 1.0; 2 gloo ranks on CPU, half the cores each:
``$SHARDLIGHT_BENCH_THREADS`` torch threads, set by the benchmark, else ``os.cpu_count() // 2``). No shardlight
import: the tokens are random ids of the shardlight arm's packed shape (micro-batch x seq_len; a step's
cost does not depend on which ids), served by a DataLoader with a DistributedSampler as a user would.

    python benchmarks/_raw_fsdp_loop.py OUT_DIR STEPS MODEL_JSON MICRO_BATCH SEQ_LEN [PORT]

Writes ``timing-rank{R}.json`` in OUT_DIR in the format of ``_timed_train.py``.
"""

import time

START = time.time()

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

IMPORTS = time.time()
WORLD = 2


def rank_main(rank: int, out: Path, steps: int, model_spec: dict, micro_batch: int, seq_len: int,
              port: int) -> None:
    marks = {"start": START, "imports": IMPORTS}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo")
    # The benchmark's share of the usable cores (a container's os.cpu_count() may be the host's).
    torch.set_num_threads(int(os.environ.get("SHARDLIGHT_BENCH_THREADS") or max(1, (os.cpu_count() or 1) // WORLD)))
    marks["fit"] = time.time()
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, model_spec["vocab_size"], (micro_batch * WORLD * (steps + 1), seq_len),
                           generator=generator)
    dataset = TensorDataset(tokens)
    sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    torch.manual_seed(1234)
    spec = dict(model_spec)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec),
                                             attn_implementation="sdpa")
    model = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"), use_orig_params=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    warmup = 10

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    marks["wrapped"] = time.time()
    step_times, ends, cpu_ends = [], [], []
    mask = torch.ones(micro_batch, seq_len, dtype=torch.long)
    for _, (input_ids,) in zip(range(steps), loader):
        start = time.perf_counter()
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
        labels = input_ids[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        ends.append(time.time())
        cpu_ends.append(time.process_time())
        marks.setdefault("first_step", ends[-1])
    (out / f"timing-rank{rank}.json").write_text(json.dumps({"steps": step_times, "ends": ends, "cpu_ends": cpu_ends,
                                                                 "marks": marks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    args = (out_dir, int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
            int(sys.argv[6]) if len(sys.argv) > 6 else 29571)
    mp.spawn(rank_main, args=args, nprocs=WORLD)
