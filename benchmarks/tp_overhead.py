"""shardlight's tensor-parallel training step vs a hand-written torch TP + FSDP2 loop with the same plan, 2 gloo
ranks, tp_size 2, on the harness (``benchmarks/_harness.py``: ABBA pairs, ci90, A/A noise).

Arms, each one fresh process tree per run:

* baseline (raw): this file's ``--raw`` mode, no shardlight import: the same 4-block Llama (hidden 256, 8
  heads), micro-batch 4 x 128 tokens; a (dp_replicate 1, dp_shard 1, tp 2) device mesh;
  ``parallelize_module`` over ``tp`` with the model's ``base_model_tp_plan`` mapped to the styles shardlight's
  ``tensor_parallel._style`` derives (colwise -> ``ColwiseParallel()``, rowwise -> ``RowwiseParallel()``,
  ``lm_head`` left replicated), then ``fully_shard`` per decoder block and at the root over ``dp_shard``
  (reshard after forward: FULL_SHARD), fp32 (the default recipe's 32-true); AdamW with shardlight's lr, betas,
  eps and weight decay, a warm-up + cosine LambdaLR, global-norm clipping at 1.0 with the norms of the two
  meshes (TP-sharded and replicated parameters) combined, as a user has to; both TP ranks draw the same
  random token ids (one data-parallel rank) from a DataLoader;
* candidate: ``shardlight train`` (the real CLI, through ``_timed_train.py``) with the same model and
  settings (``fsdp.fsdp_version=2 parallelism.tp_size=2``) and the default recipe's everything else: its data
  pipeline, Lightning's loop, logging, the memory and throughput callbacks. Left out: the comm callback, W&B
  (no network), validation and checkpoints (not in a step).

Metrics per run: ``step_s``, the median over steps after warm-up of the slower rank, batch in hand to
optimizer step done; ``loop_step_s``, wall per optimizer step over the loop after warm-up (end of the
warm-up step to end of the last, slower rank). One JSON line ``tp_overhead`` (``step_s``, target <= 1.03,
``loop_step_s`` under metrics).

    python benchmarks/tp_overhead.py [--pairs N] [--max-pairs N] [--budget-s S] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import compare, emit  # noqa: E402

WARMUP = 5
WORLD, TP = 2, 2
MICRO_BATCH, SEQ_LEN = 4, 128
MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
# shardlight's default recipe (framework/recipe/schema.py): optimizer and schedule the raw loop copies.
LR, BETAS, EPS, WEIGHT_DECAY, WARMUP_STEPS, MIN_LR_RATIO, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.01, 10, 0.1, 1.0


def shardlight_args(steps: int, out: Path) -> list:
    return [f"output_dir={out}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
            f"trainer.val_every_n_steps={steps}", f"trainer.micro_batch_size={MICRO_BATCH}",
            f"data.seq_len={SEQ_LEN}", "logging.wandb.enabled=false", "callbacks.comm.enabled=false",
            "checkpoint.enabled=false", "fsdp.fsdp_version=2", f"parallelism.tp_size={TP}"] + [
        f"model.config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODEL.items()
        if k != "model_type"]


def _env(times: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", SHARDLIGHT_BENCH_TIMES=str(times))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "SHARDLIGHT_RUN_DIR", "SHARDLIGHT_BENCH_RESULTS",
                "MASTER_PORT", "MASTER_ADDR", "RANK"):
        env.pop(key, None)
    return env


def clip_grad_norm(model, max_norm: float):
    """Global-norm clipping over DTensor gradients on two meshes: each mesh's norm, combined by hand."""
    import torch

    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]).full_tensor() for group in by_mesh.values()]
    total = torch.stack(norms).pow(2).sum().sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def raw_rank(rank: int, out: Path, steps: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))
    mesh = init_device_mesh("cpu", (1, WORLD // TP, TP), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp_rank, dp_size = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, MODEL["vocab_size"], (MICRO_BATCH * dp_size * (steps + 1), SEQ_LEN), generator=generator)
    dataset = TensorDataset(tokens)
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1234)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)
    torch.manual_seed(1234)
    spec = dict(MODEL)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {f"{model.base_model_prefix}.{key}": styles[style]() for key, style in config.base_model_tp_plan.items()}
    parallelize_module(model, mesh["tp"], plan)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def lr_lambda(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    step_times, ends = [], []
    mask = torch.ones(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    for _, (input_ids,) in zip(range(steps), loader):
        start = time.perf_counter()
        logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
        labels = input_ids[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        clip_grad_norm(model, CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        ends.append(time.time())
    (out / f"timing-rank{rank}.json").write_text(json.dumps({"steps": step_times, "ends": ends}))
    dist.destroy_process_group()


def run_once(arm: str, steps: int, tmp: Path, counter: list) -> dict:
    """One run of an arm in a fresh process tree; its metrics."""
    counter[0] += 1
    out = tmp / f"{arm}-{counter[0]}"
    times = out / "times"
    if arm == "raw":
        port = 20000 + (os.getpid() * 7 + counter[0]) % 20000
        command = [sys.executable, str(Path(__file__).resolve()), "--raw", str(times), str(steps), str(port)]
    else:
        command = [sys.executable, str(REPO / "benchmarks" / "_timed_train.py"), "train",
                   *shardlight_args(steps, out)]
    result = subprocess.run(command, env=_env(times), capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"tp_overhead: the {arm} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(times.glob("timing-rank*.json"))]
    if len(ranks) != WORLD:
        sys.exit(f"tp_overhead: the {arm} run wrote {len(ranks)} timing files, not {WORLD}")
    if any(len(r["steps"]) <= WARMUP for r in ranks):
        sys.exit(f"tp_overhead: the {arm} run timed {min(len(r['steps']) for r in ranks)} steps, need > {WARMUP}")
    step = statistics.median(max(per_rank) for per_rank in zip(*(r["steps"][WARMUP:] for r in ranks)))
    loop = max((r["ends"][-1] - r["ends"][WARMUP - 1]) / (len(r["ends"]) - WARMUP) for r in ranks)
    return {"step_s": step, "loop_step_s": loop}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="at least this many A/B pairs (default 8)")
    parser.add_argument("--max-pairs", type=int, default=24)
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop adding pairs after this long")
    parser.add_argument("--steps", type=int, default=40, help=f"optimizer steps per run (the first {WARMUP} are "
                                                              "warm-up)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    counter = [0]
    with tempfile.TemporaryDirectory(prefix="tp_overhead_") as tmp:
        result = compare("tp_overhead", baseline=lambda: run_once("raw", args.steps, Path(tmp), counter),
                         candidate=lambda: run_once("shardlight", args.steps, Path(tmp), counter),
                         metric="step_s", target=1.03, bound="upper", min_pairs=args.pairs,
                         max_pairs=max(args.pairs, args.max_pairs), budget_s=args.budget_s)
    result["raw_step_s"] = result["medians"]["baseline"]["step_s"]
    result["shardlight_step_s"] = result["medians"]["candidate"]["step_s"]
    result.update(steps=args.steps, warmup=WARMUP, world_size=WORLD, tp_size=TP)
    emit(result)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--raw":
        import torch.multiprocessing as mp

        out_dir = Path(sys.argv[2])
        out_dir.mkdir(parents=True, exist_ok=True)
        mp.spawn(raw_rank, args=(out_dir, int(sys.argv[3]), int(sys.argv[4])), nprocs=WORLD)
    else:
        sys.exit(main())
