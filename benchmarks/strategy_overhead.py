"""shardlight's training step vs a hand-written raw torch FSDP loop: same model, data, settings
(FSDP1 FULL_SHARD, one unit per decoder block, BACKWARD_PRE, AdamW, global-norm clipping), 2 gloo ranks,
run alternately in one invocation. Step time = the median over steps after warm-up of the slower rank,
timed from batch in hand to optimizer step done.

Prints one JSON line; ``ratio`` = shardlight step time / raw step time (target <= 1.03).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
STEPS, WARMUP, ROUNDS = 30, 5, 2
MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
OVERRIDES = [f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0", "trainer.progress_bar=false",
             "trainer.micro_batch_size=4", "data.seq_len=128", "logging.wandb.enabled=false", "logging.csv=false",
             "callbacks.comm.enabled=false", "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false",
             "trainer.log_every_n_steps=10"] + [f"model.config.{k}={v}" for k, v in MODEL.items() if k != "model_type"]


def shardlight_worker(out: Path) -> None:
    import lightning.pytorch as pl

    from shardlight.build import build_datamodule, build_module, build_trainer
    from shardlight.preflight import preflight
    from shardlight.recipe import load_recipe
    from shardlight.runtime import RunContext
    from shardlight.train import resolve_run_dir

    class StepTimer(pl.Callback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.start)

    cfg = load_recipe(None, OVERRIDES + [f"output_dir={out}"])
    tokenizer = preflight(cfg)
    pl.seed_everything(cfg.trainer.seed, verbose=False)
    ctx = RunContext.from_env()
    ctx = ctx.replace(run_dir=resolve_run_dir(ctx, cfg))
    ctx.export()
    trainer = build_trainer(cfg, ctx)
    timer = StepTimer()
    trainer.callbacks.append(timer)
    trainer.fit(build_module(cfg), datamodule=build_datamodule(cfg, tokenizer))
    (out / f"times-{trainer.global_rank}.json").write_text(json.dumps(timer.times))


def raw_rank(rank: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardlight.build import build_tokenizer
    from shardlight.data import SFTDataModule
    from shardlight.recipe import load_recipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571", RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    cfg = load_recipe(None, OVERRIDES)
    datamodule = SFTDataModule(cfg, build_tokenizer(cfg))
    datamodule.setup("fit")
    sampler = DistributedSampler(datamodule.train_dataset, num_replicas=2, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(datamodule.train_dataset, batch_size=4, sampler=sampler, drop_last=True)
    torch.manual_seed(1234)
    spec = dict(MODEL)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec),
                                             attn_implementation="sdpa")
    model = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"), use_orig_params=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    times = []
    for _, batch in zip(range(STEPS), loader):
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                 ignore_index=-100)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    (out / f"times-{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def measure(mode: str, out: Path) -> float:
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    for key in ("LOCAL_RANK", "SHARDLIGHT_RUN_DIR"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, __file__, mode, str(out)], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{mode} run failed: {result.stderr[-2000:]}")
    per_rank = [json.loads(p.read_text())[WARMUP:] for p in sorted(out.glob("times-*.json"))]
    return statistics.median(max(step) for step in zip(*per_rank))


def main() -> None:
    results = {"shardlight": [], "raw": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(ROUNDS):
            for mode in ("raw", "shardlight"):
                results[mode].append(measure(f"--{mode}", Path(tmp) / f"{mode}-{round_index}"))
    shardlight, raw = min(results["shardlight"]), min(results["raw"])
    print(json.dumps({
        "benchmark": "strategy_overhead",
        "shardlight_step_s": round(shardlight, 5),
        "raw_fsdp_step_s": round(raw, 5),
        "ratio": round(shardlight / raw, 4),
        "target_ratio": 1.03,
        "rounds": results,
    }))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--shardlight":
        shardlight_worker(Path(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--raw":
        import torch.multiprocessing as mp

        mp.spawn(raw_rank, args=(Path(sys.argv[2]),), nprocs=2)
    else:
        main()
