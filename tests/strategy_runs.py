"""The FSDP strategy's shared runs: a saved tiny Llama and its recipe, every whole 2-rank and 4-rank run that
test_strategy, test_chunked_loss and test_compile_and_checkpointing read (``runs_of``), and the single-process
reference they are held against. conftest's session fixtures ``strategy_two_ranks`` and ``strategy_four_ranks``
run each world size's runs once, in one process group (``conftest.gloo_fits``), whichever module asks first."""

import functools
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "recipes" / "assets" / "tiny-tokenizer"
TRAIN_DATA = REPO / "recipes" / "data" / "tiny_sft_train.jsonl"
STEPS, MICRO_BATCH, SEQ_LEN = 3, 2, 32
CALLBACKS_OFF = ["callbacks.comm.enabled=false", "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false"]


def write_setup(root):
    """A saved tiny Llama (so every run and the reference start from the same weights) and its recipe."""
    from conftest import save_tiny_llama

    save_tiny_llama(root / "init")
    recipe = root / "tiny.yaml"
    recipe.write_text(textwrap.dedent(f"""
        output_dir: {root / 'runs'}
        model: {{name_or_path: {root / 'init'}}}
        tokenizer: {{name_or_path: {TOKENIZER}}}
        data: {{train_files: [{TRAIN_DATA}], val_fraction: 0.0, seq_len: {SEQ_LEN}}}
        optim: {{lr: 1.0e-3, warmup_steps: 1, weight_decay: 0.1}}
        trainer: {{max_steps: {STEPS}, micro_batch_size: {MICRO_BATCH}, accelerator: cpu, devices: 2,
                   limit_val_batches: 0, progress_bar: false, log_every_n_steps: 1, num_threads: 1}}
        logging: {{wandb: {{enabled: false}}}}
        fsdp: {{transformer_cls_names_to_wrap: [LlamaDecoderLayer]}}
    """))
    return root, recipe


MATRIX = [
    (version, strategy)
    for version in (1, 2)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
]
# test_compile_and_checkpointing: activation checkpointing's choices on each FSDP version.
CHECKPOINTING_CHOICES = {
    1: ["fsdp.activation_checkpointing_mode=selective"],
    2: ["fsdp.activation_checkpointing_mode=selective", "fsdp.activation_checkpointing_every=2",
        "fsdp.activation_checkpointing_offload=true"],
}


def matrix_overrides(version, strategy):
    world = 4 if strategy == "HYBRID_SHARD" else 2
    overrides = [f"fsdp.fsdp_version={version}", f"fsdp.sharding_strategy={strategy}", f"trainer.devices={world}"]
    if strategy == "HYBRID_SHARD":
        overrides.append("fsdp.mesh_shape=[2,2]")  # 2 replicas × 2-way shards on one host
    return world, overrides


def runs_of(world):
    """Every whole run (``shardlight.train.train``, counted, its console kept) on ``world`` ranks: {name: spec}."""
    runs = {}
    for version, strategy in MATRIX:
        ranks, overrides = matrix_overrides(version, strategy)
        if ranks == world:
            runs[f"fsdp{version}-{strategy}"] = overrides
    if world == 2:
        for version in (1, 2):
            base = [f"fsdp.fsdp_version={version}", "trainer.accumulate_grad_batches=4"]
            runs[f"fsdp{version} no_sync"] = base
            runs[f"fsdp{version} sync_each_batch"] = base + ["fsdp.sync_each_batch=true"]
            runs[f"fsdp{version} activation checkpointing"] = [
                f"fsdp.fsdp_version={version}", "fsdp.sharding_strategy=FULL_SHARD", "fsdp.activation_checkpointing=true"]
            runs[f"fsdp{version} loss_chunks 3"] = [f"fsdp.fsdp_version={version}", "trainer.loss_chunks=3"]
            runs[f"fsdp{version} checkpointing choices"] = [f"fsdp.fsdp_version={version}",
                                                            "fsdp.activation_checkpointing=true",
                                                            *CHECKPOINTING_CHOICES[version]]
        runs["bf16-mixed"] = ["trainer.precision=bf16-mixed"]
    return {name: {"train": True, "counters": True, "capture": True,
                   "overrides": [*CALLBACKS_OFF, *overrides, f"name={name.replace(' ', '-')}"]}
            for name, overrides in runs.items()}


def final_weights(summary):
    return load_file(str(Path(summary["model_dir"]) / "model.safetensors"))


@functools.lru_cache(maxsize=None)  # the same steps for every strategy on as many ranks: computed once
def reference_weights(recipe, world_size, accumulate=1):
    """The same optimizer steps in one process on the same global batch: the summed token loss of every rank's
    micro-batches over their global token count, global-norm clipping, AdamW with the same groups."""
    from torch.utils.data import DistributedSampler, default_collate

    from shardlight.build import build_module, build_tokenizer
    from shardlight.data import SFTDataModule
    from shardlight.recipe import load_recipe

    cfg = load_recipe(str(recipe), [f"trainer.devices={world_size}", f"trainer.accumulate_grad_batches={accumulate}"])
    datamodule = SFTDataModule(cfg, build_tokenizer(cfg))
    datamodule.setup("fit")
    dataset = datamodule.train_dataset
    order = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.trainer.seed)
        sampler.set_epoch(0)
        order.append(list(sampler))
    module = build_module(cfg, sharded_load=False)  # from_pretrained: the truth the sharded load must equal
    module.configure_model()
    optim = module.configure_optimizers()
    optimizer, schedule = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
    for step in range(cfg.trainer.max_steps):
        sums = []
        for micro in range(accumulate):
            start = (step * accumulate + micro) * MICRO_BATCH
            for rank in range(world_size):
                batch = default_collate([dataset[i] for i in order[rank][start:start + MICRO_BATCH]])
                sums.append(module._loss_sum(batch))
        (sum(total for total, _ in sums) / sum(count for _, count in sums)).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return {name[len("model."):]: p.detach() for name, p in module.named_parameters()}


def assert_weights_close(actual, expected, atol=2e-5):
    assert set(actual) == set(expected)
    worst = max(float((actual[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= atol, f"max |diff| {worst:.3g}"
