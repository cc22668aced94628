"""shardlight vs its peers on one CUDA GPU: the same model, data and settings trained for N steps under

* ``shardlight``: ``shardlight train`` (the real CLI, ``python -m shardlight.cli train`` with overrides) plus a
  step timer added to the callbacks it builds;
* ``raw_fsdp``: a hand-written torch FSDP1 loop (as ``benchmarks/strategy_overhead.py``'s raw arm, on CUDA);
* ``accelerate_fsdp``: ``accelerate.Accelerator`` with a ``FullyShardedDataParallelPlugin``.

The settings (all three): the default recipe's model (recipes/tiny-llama-sft.yaml: a 2-layer Llama, hidden 128,
vocab 512; ``--override model.config.hidden_size=1024`` and the like scale it, for every arm), its packed data
(micro-batch 8 x 128 tokens), FSDP1 FULL_SHARD with one unit per decoder layer, BACKWARD_PRE, limit_all_gathers,
use_orig_params, bf16-mixed (FSDP MixedPrecision in bf16 + autocast), AdamW (the recipe's lr, betas, eps, weight
decay), global-norm clipping at 1.0; world size 1, NCCL. shardlight's observability callbacks, W&B, CSV and
validation are off (the framework's own cost, not its measurements'). Each arm runs in its own process, one after
the other (``--rounds`` repeats the sequence; each arm's best round is reported).

Step time: the median, after ``--warmup`` steps, of the wall time between consecutive optimizer-step ends, each
end after ``torch.cuda.synchronize()`` (data loading and the framework's per-step work included). tokens/s =
micro-batch x seq_len / step time. MFU = tokens/s x FLOPs per token / peak: FLOPs per token of forward + backward
from ``torch.utils.flop_counter.FlopCounterMode`` on a meta-device copy (shardlight's throughput callback's
``measure_flops_per_token``; its 6N + attention approximation if counting fails, named in ``flops_method``),
the peak the H200/H100 dense bf16 datasheet figure, 989.4 TFLOP/s (``--peak-tflops``). The default model is tiny:
an H200 is launch-bound on it, so MFU is far below 1% and the step time is mostly per-step overhead, which is
what the comparison is about.

Prints one JSON line (and appends it to ``$SHARDLIGHT_BENCH_RESULTS`` when set)::

    python3 benchmarks/gpu/peer_compare.py [--steps 40] [--warmup 10] [--rounds 1] [--override key=value ...]

Needs CUDA (Accelerate refuses FSDP on CPU): without it, one line on stderr and exit status 2.
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

ARMS = ("shardlight", "raw_fsdp", "accelerate_fsdp")
PEAK_TFLOPS = 989.4  # H100/H200 SXM dense bf16, NVIDIA's datasheet (callbacks/throughput.py's table)
TIMES_ENV = "PEER_COMPARE_TIMES"
# shardlight's side of "the same settings": the default recipe on one GPU, bf16-mixed, measurements off.
BASE_OVERRIDES = ["trainer.accelerator=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed",
                  "trainer.limit_val_batches=0", "trainer.progress_bar=false", "trainer.log_every_n_steps=10",
                  "fsdp.sharding_strategy=FULL_SHARD", "fsdp.backward_prefetch=BACKWARD_PRE",
                  "fsdp.use_orig_params=true", "fsdp.limit_all_gathers=true",
                  "logging.wandb.enabled=false", "logging.csv=false", "callbacks.comm.enabled=false",
                  "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false"]


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        print("peer_compare: needs a CUDA GPU (Accelerate refuses FSDP on CPU); torch "
              f"{torch.__version__} sees none", file=sys.stderr)
        sys.exit(2)


def synced_end(ends: list) -> None:
    import torch

    torch.cuda.synchronize()
    ends.append(time.perf_counter())


def write_times(out: Path, ends: list, **extra) -> None:
    out.write_text(json.dumps({"ends": ends, **extra}))


def recipe(overrides: list):
    from shardlight.recipe import load_recipe

    return load_recipe(None, BASE_OVERRIDES + overrides)


def lr_lambda(cfg):
    warmup, total = cfg.optim.warmup_steps, cfg.trainer.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def model_and_data(cfg):
    """The recipe's model (fp32 on CPU, as both loops then hand it to FSDP) and an endless loader over its
    packed training blocks."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from shardlight.build import build_hf_config, build_tokenizer
    from shardlight.data import SFTDataModule

    datamodule = SFTDataModule(cfg, build_tokenizer(cfg))
    datamodule.setup("fit")
    loader = DataLoader(datamodule.train_dataset, batch_size=cfg.trainer.micro_batch_size, shuffle=True,
                        drop_last=True, generator=torch.Generator().manual_seed(cfg.trainer.seed))

    def batches():
        while True:
            yield from loader

    torch.manual_seed(cfg.trainer.seed)
    model = AutoModelForCausalLM.from_config(build_hf_config(cfg.model), attn_implementation="sdpa")
    return model, batches()


def loss_of(model, batch):
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100)


def adamw(cfg, params):
    import torch

    return torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                             weight_decay=cfg.optim.weight_decay)


def init_single_rank(port: int, init: bool = True) -> None:
    """World size 1 as torchrun would describe it; the NCCL process group too unless ``init`` is False."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    torch.cuda.set_device(0)
    if init and not dist.is_initialized():
        dist.init_process_group("nccl")


def arm_raw(out: Path, overrides: list) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = recipe(overrides)
    init_single_rank(29631)
    model, batches = model_and_data(cfg)
    bf16 = torch.bfloat16
    model = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(), use_orig_params=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True, mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16))
    optimizer = adamw(cfg, model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    ends: list = []
    synced_end(ends)
    for _, batch in zip(range(cfg.trainer.max_steps), batches):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=bf16):
            loss = loss_of(model, batch)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        synced_end(ends)
    write_times(out, ends, final_loss=float(loss))
    dist.destroy_process_group()


def arm_accelerate(out: Path, overrides: list) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FullyShardedDataParallel

    cfg = recipe(overrides)
    init_single_rank(29632, init=False)  # Accelerate starts the NCCL process group itself, from these variables
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, sharding_strategy="FULL_SHARD", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], backward_prefetch="BACKWARD_PRE",
        use_orig_params=True, limit_all_gathers=True, state_dict_type="FULL_STATE_DICT",
        sync_module_states=False, cpu_ram_efficient_loading=False)
    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
    model, batches = model_and_data(cfg)
    model = accelerator.prepare(model)  # FSDP first, then the optimizer over its (original) parameters
    optimizer = adamw(cfg, model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    optimizer, schedule = accelerator.prepare(optimizer, schedule)
    wrapped = isinstance(model, FullyShardedDataParallel)
    if accelerator.distributed_type != DistributedType.FSDP or not wrapped:
        sys.exit(f"accelerate arm: distributed_type {accelerator.distributed_type}, FSDP-wrapped {wrapped}")
    ends: list = []
    synced_end(ends)
    for _, batch in zip(range(cfg.trainer.max_steps), batches):
        batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
        loss = loss_of(model, batch)  # the prepared model's forward runs under Accelerate's bf16 autocast
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        synced_end(ends)
    write_times(out, ends, final_loss=float(loss), mixed_precision=str(plugin.mixed_precision_policy))
    accelerator.end_training()


def arm_shardlight(out: Path, overrides: list) -> None:
    """`shardlight train` itself, a step timer added to the callbacks its builder makes."""
    import lightning.pytorch as pl

    import shardlight.build.trainer as trainer_builder
    from shardlight.cli.main import main

    class StepEnds(pl.Callback):
        def __init__(self) -> None:
            self.ends: list = []

        def on_train_start(self, trainer, pl_module):
            synced_end(self.ends)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            synced_end(self.ends)

        def on_train_end(self, trainer, pl_module):
            write_times(out, self.ends)

    build_callbacks = trainer_builder.build_callbacks
    trainer_builder.build_callbacks = lambda cfg, ctx, *rest: build_callbacks(cfg, ctx, *rest) + [StepEnds()]
    with tempfile.TemporaryDirectory() as tmp:
        rc = main(["train", *BASE_OVERRIDES, *overrides, f"output_dir={tmp}"])
    if rc:
        sys.exit(rc)


def run_arm(arm: str, out: Path, steps: int, warmup: int, overrides: list, timeout: float) -> dict:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SHARDLIGHT_RUN_DIR"):
        env.pop(key, None)
    command = [sys.executable, __file__, "--arm", arm, "--times", str(out), "--steps", str(steps),
               "--warmup", str(warmup), *[arg for o in overrides for arg in ("--override", o)]]
    started = time.time()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0 or not out.exists():
        tail = (result.stderr or result.stdout)[-1500:]
        raise RuntimeError(f"{arm} arm failed (exit {result.returncode}): {tail}")
    return {**json.loads(out.read_text()), "wall_s": round(time.time() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per arm (default 40)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median (default 10)")
    parser.add_argument("--rounds", type=int, default=1, help="times the three arms run, in turn (default 1)")
    parser.add_argument("--override", action="append", default=[], help="recipe override for every arm")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)} (default all)")
    parser.add_argument("--arm-timeout-s", type=float, default=120.0)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--times", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_cuda()
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    overrides = [f"trainer.max_steps={args.steps}", *args.override]
    arm_names = [a for a in args.arms.split(",") if a]
    if not arm_names or any(a not in ARMS for a in arm_names):
        parser.error(f"--arms: a comma-separated subset of {','.join(ARMS)}")
    if args.arm:
        {"shardlight": arm_shardlight, "raw_fsdp": arm_raw, "accelerate_fsdp": arm_accelerate}[args.arm](
            args.times, overrides)
        return 0

    import torch

    from shardlight.build import build_hf_config
    from shardlight.callbacks.throughput import measure_flops_per_token

    cfg = recipe(overrides)
    tokens_per_step = cfg.trainer.micro_batch_size * cfg.data.seq_len
    flops_per_token, flops_method = measure_flops_per_token(build_hf_config(cfg.model), cfg.data.seq_len)
    per_arm: dict = {arm: [] for arm in arm_names}
    errors: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for arm in arm_names:
                try:
                    record = run_arm(arm, Path(tmp) / f"{arm}-{round_index}.json", args.steps, args.warmup,
                                     args.override, args.arm_timeout_s)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other arms still run
                    print(f"peer_compare: {exc}", file=sys.stderr)
                    errors[arm] = str(exc).splitlines()[0][:300]
                    continue
                deltas = [b - a for a, b in zip(record["ends"], record["ends"][1:])][args.warmup:]
                if not deltas:
                    errors[arm] = f"{len(record['ends'])} step ends recorded"
                    continue
                per_arm[arm].append({"step_s": statistics.median(deltas), "steps_timed": len(deltas),
                                     "p90_step_s": sorted(deltas)[int(0.9 * (len(deltas) - 1))],
                                     "wall_s": record["wall_s"], "final_loss": record.get("final_loss")})
    arms = {}
    for arm, rounds in per_arm.items():
        if not rounds:
            continue
        best = min(rounds, key=lambda r: r["step_s"])
        tokens_per_s = tokens_per_step / best["step_s"]
        arms[arm] = {"step_ms": round(1000 * best["step_s"], 3), "p90_step_ms": round(1000 * best["p90_step_s"], 3),
                     "tokens_per_s": round(tokens_per_s, 1),
                     "mfu": round(tokens_per_s * flops_per_token / (args.peak_tflops * 1e12), 6),
                     "steps_timed": best["steps_timed"], "process_wall_s": best["wall_s"],
                     "rounds_step_ms": [round(1000 * r["step_s"], 3) for r in rounds]}
    raw = arms["raw_fsdp"]["step_ms"] if "raw_fsdp" in arms else None
    line = {
        "benchmark": "peer_compare", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "world_size": 1, "backend": "nccl", "precision": "bf16-mixed", "fsdp": "FSDP1 FULL_SHARD",
        "model_params": sum(p.numel() for p in _meta_model(cfg).parameters()),
        "micro_batch": cfg.trainer.micro_batch_size, "seq_len": cfg.data.seq_len, "tokens_per_step": tokens_per_step,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "overrides": args.override,
        "flops_per_token": round(flops_per_token), "flops_method": flops_method, "peak_tflops": args.peak_tflops,
        "arms": arms,
        "step_ratio_vs_raw": {arm: round(a["step_ms"] / raw, 4) for arm, a in arms.items()} if raw else None,
        "errors": errors,
    }
    text = json.dumps(line)
    print(text)
    if os.environ.get("SHARDLIGHT_BENCH_RESULTS"):
        with open(os.environ["SHARDLIGHT_BENCH_RESULTS"], "a") as f:
            f.write(text + "\n")
    return 1 if errors else 0


def _meta_model(cfg):
    import torch
    from transformers import AutoModelForCausalLM

    from shardlight.build import build_hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(build_hf_config(cfg.model))


if __name__ == "__main__":
    sys.exit(main())
