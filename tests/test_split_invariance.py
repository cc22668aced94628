"""Every token weighs the same: one optimizer step's gradient does not depend on how its batch is split.

Eight examples of very uneven length (one long response, seven of a word or two) make one optimizer step's whole
batch. The truth is computed in one process without Lightning: the summed token cross-entropy of all eight over
their supervised token count. Every split must recover it: one rank with micro-batch 8 or with micro-batch 1 and 8
accumulation steps (Lightning in this process), and on real gloo ranks 2 x 4, 2 x 1 accumulating 4 (FSDP1 and
FSDP2), packed blocks, the loss in 4 pieces, LoRA, and dp 2 x tp 2 on 4 ranks. Before this held, micro-batch 1 x 8
gave a gradient norm 41% off (115% packed).

The ranks of each world size are one process tree (tests/workers/gloo_fits.py) that runs all its fits in
one gloo process group: 20 s for 2 ranks x 8 fits and 21 s for 4 ranks x 1 fit on 2 quiet cores; the one-rank
fits run in this process (about 1 s each).
"""

import json
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from conftest import REPO, gloo_fits, save_tiny_llama
from torch.utils.data import default_collate
from workers.gloo_fits import FirstStepGradients

from shardlight.build import build_module, build_tokenizer
from shardlight.causal_lm import clean_param_name
from shardlight.data import SFTDataModule
from shardlight.recipe import load_recipe

TOKENIZER = REPO / "recipes" / "assets" / "tiny-tokenizer"
STEPS, SEQ_LEN, LR = 5, 80, 1e-3
LONG = "A river starts as rain on the hills, runs down through the woods and fields, and reaches the sea"
SHORT = [("Next letter after y", "z"), ("Add: 8 + 4", "12"), ("Say yes", "yes"), ("Opposite of up", "down"),
         ("Add: 1 + 1", "2"), ("Colour of grass", "green"), ("Say no", "no")]
GRAD_RTOL = 1e-5  # fp32: the bound, relative to each parameter's gradient norm
BF16_RTOL = 3e-2  # bf16-mixed against the fp32 truth: 1.0e-2 measured (the worst parameter); the old split was 41% off


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny Llama, the eight examples and a recipe whose one optimizer step takes all of them (one
    epoch per step), AdamW at a constant lr, clipping at 1.0."""
    root = tmp_path_factory.mktemp("split")
    save_tiny_llama(root / "init")
    rows = [{"prompt": "Describe a river", "response": LONG}] + [{"prompt": p, "response": r} for p, r in SHORT]
    data = root / "uneven.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = root / "split.yaml"
    recipe.write_text(textwrap.dedent(f"""
        name: split
        output_dir: {root / 'runs'}
        model: {{name_or_path: {root / 'init'}}}
        tokenizer: {{name_or_path: {TOKENIZER}}}
        data: {{train_files: [{data}], val_fraction: 0.0, seq_len: {SEQ_LEN}, packing: false,
                cache_dir: {root / 'cache'}}}
        optim: {{lr: {LR}, warmup_steps: 0, schedule: constant, weight_decay: 0.0}}
        trainer: {{max_steps: {STEPS}, micro_batch_size: 8, accelerator: cpu, devices: 1, limit_val_batches: 0,
                   progress_bar: false, log_every_n_steps: 1, num_threads: 1, gradient_clip_val: 1.0,
                   gc_freeze: false}}
        logging: {{wandb: {{enabled: false}}, csv: false}}
        export: {{at_end: false}}
        callbacks: {{comm: {{enabled: false}}, memory: {{enabled: false}}, throughput: {{enabled: false}}}}
        fsdp: {{transformer_cls_names_to_wrap: [LlamaDecoderLayer]}}
    """))
    return recipe


LORA = ["peft.method=lora", "peft.r=4", "peft.alpha=8", "peft.dropout=0.0", "peft.target_modules=[q_proj,v_proj]"]
PACKED = ["data.packing=true"]


def reference(recipe, overrides=()):
    """One process, no Lightning: the whole batch's summed token loss over its count. Returns (the first step's
    gradients, the weights after STEPS steps of the same batch), with the recipe's clipping and AdamW."""
    cfg = load_recipe(str(recipe), list(overrides))
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg, sharded_load=False)
    module.configure_model()
    data = SFTDataModule(cfg, build_tokenizer(cfg))
    data.setup("fit")
    batch = default_collate([data.train_dataset[i] for i in range(len(data.train_dataset))])
    optimizer = module.configure_optimizers()["optimizer"]
    first = None
    for _ in range(STEPS):
        total, count = module._loss_sum(batch)
        (total / count).backward()
        if first is None:
            first = named(module, lambda p: p.grad)
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return first, named(module, lambda p: p)


def named(module, what):
    return {clean_param_name(n).removeprefix("model."): what(p).detach().clone()
            for n, p in module.named_parameters() if p.requires_grad}


def one_rank(recipe, overrides):
    """The module in a one-rank Lightning fit in this process (no process group: Lightning's own single-device
    strategy); its accumulation and logging are what the module does on any number of ranks."""
    cfg = load_recipe(str(recipe), list(overrides))
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg, sharded_load=False)
    data = SFTDataModule(cfg, build_tokenizer(cfg))
    capture = FirstStepGradients()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=cfg.trainer.max_steps, callbacks=[capture], logger=False,
                         accumulate_grad_batches=cfg.trainer.accumulate_grad_batches, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, default_root_dir=recipe.parent)
    trainer.fit(module, datamodule=data)
    return {"grads": capture.grads, "weights": named(module, lambda p: p), "steps": trainer.global_step,
            "batches": capture.batches}


def worst_relative(actual, expected):
    """The largest ``|a - e| / |e|`` (norms) over the parameters, and its parameter."""
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    errors = {k: float((actual[k] - expected[k]).norm() / expected[k].norm().clamp(min=1e-30)) for k in expected}
    name = max(errors, key=errors.get)
    return errors[name], name


@pytest.fixture(scope="module")
def truths(setup):
    return {"full": reference(setup), "lora": reference(setup, LORA)}


@pytest.fixture(scope="module")
def two_ranks(setup, tmp_path_factory):
    runs = {
        "fsdp2 2x4": ["fsdp.fsdp_version=2", "trainer.micro_batch_size=4"],
        "fsdp2 2x1 acc4": ["fsdp.fsdp_version=2", "trainer.micro_batch_size=1", "trainer.accumulate_grad_batches=4"],
        "fsdp1 2x4": ["fsdp.fsdp_version=1", "trainer.micro_batch_size=4"],
        "fsdp1 2x1 acc4": ["fsdp.fsdp_version=1", "trainer.micro_batch_size=1", "trainer.accumulate_grad_batches=4"],
        "packed fsdp2 2x1 acc2": ["fsdp.fsdp_version=2", *PACKED, "trainer.micro_batch_size=1",
                                  "trainer.accumulate_grad_batches=2"],
        "loss_chunks 4 fsdp1 2x2 acc2": ["fsdp.fsdp_version=1", "trainer.loss_chunks=4", "trainer.micro_batch_size=2",
                                         "trainer.accumulate_grad_batches=2"],
        "lora fsdp2 2x2 acc2": ["fsdp.fsdp_version=2", *LORA, "trainer.micro_batch_size=2",
                                "trainer.accumulate_grad_batches=2"],
        "bf16-mixed fsdp2 2x1 acc4": ["fsdp.fsdp_version=2", "trainer.precision=bf16-mixed",
                                      "trainer.micro_batch_size=1", "trainer.accumulate_grad_batches=4"],
    }
    return gloo_fits(setup, 2, runs, tmp_path_factory.mktemp("two_ranks"))


def test_the_examples_are_uneven_and_pack_into_four_blocks(setup):
    """The premise: one example has most of the supervised tokens, and packed they make 4 blocks (each split
    below takes all of them in one step)."""
    cfg = load_recipe(str(setup), [])
    tokenizer = build_tokenizer(cfg)
    data = SFTDataModule(cfg, tokenizer)
    data.setup("fit")
    counts = (data.train_dataset.labels[:, 1:] != -100).sum(1)
    assert len(counts) == 8 and counts.max() >= 10 * counts.min() and counts.max() > counts.sum() / 2, counts
    packed = SFTDataModule(load_recipe(str(setup), [*PACKED, "trainer.micro_batch_size=4"]), tokenizer)
    packed.setup("fit")
    assert len(packed.train_dataset) == 4


@pytest.mark.parametrize("name, overrides", [
    ("1x8", []),
    ("1x1 acc8", ["trainer.micro_batch_size=1", "trainer.accumulate_grad_batches=8"]),
    ("packed 1x4", [*PACKED, "trainer.micro_batch_size=4"]),
    ("packed 1x1 acc4", [*PACKED, "trainer.micro_batch_size=1", "trainer.accumulate_grad_batches=4"]),
])
def test_one_rank_splits_give_the_whole_batch_gradient(setup, truths, name, overrides):
    run = one_rank(setup, overrides)
    grads, weights = truths["full"]
    error, where = worst_relative(run["grads"], grads)
    assert error <= GRAD_RTOL, f"{name}: {where} off by {error:.2e}"
    assert_weights_agree(run["weights"], weights, name)


def test_a_last_partial_window_is_scaled_by_its_own_count(setup):
    """Micro-batch 3 (the loader drops the last 2 rows) accumulating 4: an epoch has 2 micro-batches, so every
    window is cut short by the epoch's end; its gradient is the token mean of the 6 rows it had."""
    run = one_rank(setup, ["trainer.micro_batch_size=3", "trainer.accumulate_grad_batches=4", "trainer.max_steps=1"])
    assert len(run["batches"]) == 2
    cfg = load_recipe(str(setup), [])
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg, sharded_load=False)
    module.configure_model()
    rows = {k: torch.cat([b[k] for b in run["batches"]]) for k in run["batches"][0]}
    total, count = module._loss_sum(rows)
    (total / count).backward()
    error, where = worst_relative(run["grads"], named(module, lambda p: p.grad))
    assert error <= GRAD_RTOL, f"{where} off by {error:.2e}"


@pytest.mark.slow
def test_gloo_splits_give_the_whole_batch_gradient(two_ranks, truths):
    """2 gloo ranks, FSDP1 and FSDP2: micro-batches, accumulation (no_sync), packing, loss pieces, LoRA."""
    for name, run in two_ranks.items():
        if name.startswith("bf16"):
            continue
        grads, weights = truths["lora" if name.startswith("lora") else "full"]
        assert run["steps"] == STEPS, name
        error, where = worst_relative(run["grads"], grads)
        assert error <= GRAD_RTOL, f"{name}: {where} off by {error:.2e}"
        assert_weights_agree({k: v for k, v in run["weights"].items() if k in weights}, weights, name)


@pytest.mark.slow
def test_bf16_splits_stay_within_bf16_rounding_of_the_whole_batch_gradient(two_ranks, truths):
    """bf16-mixed, 2 x 1 accumulating 4: its matmuls round to 8 bits of mantissa, so the bound is bf16's, not
    fp32's; the old per-micro-batch mean was 41% off on these examples."""
    run = two_ranks["bf16-mixed fsdp2 2x1 acc4"]
    error, where = worst_relative(run["grads"], truths["full"][0])
    assert error <= BF16_RTOL, f"{where} off by {error:.2e}"


@pytest.mark.slow
def test_dp2_x_tp2_counts_each_data_parallel_group_s_tokens_once(setup, truths, tmp_path):
    """4 gloo ranks, FSDP2 over dp 2 x TP 2: the TP pair of each data-parallel rank sees the same tokens."""
    runs = {"dp2 x tp2 2x2 acc2": ["fsdp.fsdp_version=2", "parallelism.tp_size=2", "trainer.micro_batch_size=2",
                                   "trainer.accumulate_grad_batches=2"]}
    run = gloo_fits(setup, 4, runs, tmp_path)["dp2 x tp2 2x2 acc2"]
    grads, weights = truths["full"]
    error, where = worst_relative(run["grads"], grads)
    assert error <= GRAD_RTOL, f"{where} off by {error:.2e}"
    assert_weights_agree(run["weights"], weights, "dp2 x tp2")


def assert_weights_agree(actual, expected, name):
    """After STEPS AdamW steps: within 1e-3 of one step's size (lr) for every weight. Adam divides each gradient
    by its own running magnitude, so a rounding difference in a near-zero gradient entry can move that weight
    by a sizeable part of lr; a split that weighed tokens differently moves weights by whole multiples of it."""
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    worst = max(float((actual[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= 1e-3 * LR * STEPS, f"{name}: weights differ by {worst:.3g} after {STEPS} steps"
