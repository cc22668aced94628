"""Tied embeddings on every path: the output projection that is the input embedding (Llama-3.2, Qwen2.5, Gemma,
SmolLM: ``tie_word_embeddings: true``) stays one parameter through sharding, training, checkpoints and the
export, and its gradient is the sum of both uses, as in one process.

A tied tiny Llama and a tied Qwen2-shaped model, each from an inline ``model.config`` and from a pretrained
checkpoint saved in several files: 10 steps of ``shardlight.train.train`` (preflight, fit, checkpoints at steps 5
and 10, the export) on FSDP1, FSDP2 and LoRA over FSDP2 (2 gloo ranks), and on TP 2 x FSDP 2 (4 ranks). In each:
the live model's embedding and head are one parameter after the run, every checkpoint holds them equal, and the
export holds the tensor once and reloads with ``from_pretrained`` to the live sharded model's logits. Eight
examples are one optimizer step, so the first step's gradient of a pretrained run equals one process's on the
whole batch (where a tie broken by sharding would give the embedding half its gradient, and a second tensor).

The ranks of each world size are one process tree (``conftest.gloo_fits``) that runs all its fits in one gloo
process group.
"""

import json
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, gloo_fits
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.data import default_collate

from shardlight.build import build_module, build_tokenizer
from shardlight.causal_lm import clean_param_name
from shardlight.checkpoint.store import WEIGHT_PREFIX, complete_checkpoints, read_dcp_metadata
from shardlight.data import SFTDataModule
from shardlight.recipe import load_recipe

TOKENIZER = REPO / "recipes" / "assets" / "tiny-tokenizer"
TRAIN = REPO / "recipes" / "data" / "tiny_sft_train.jsonl"
STEPS = 10
GRAD_RTOL = 1e-5  # fp32, relative to each parameter's gradient norm (as tests/test_split_invariance.py)
LOGITS_ATOL = 1e-5
SHAPES = {  # architecture: (inline config, decoder layer class)
    "llama": ({"model_type": "llama", "num_key_value_heads": 4}, "LlamaDecoderLayer"),
    "qwen2": ({"model_type": "qwen2", "num_key_value_heads": 2}, "Qwen2DecoderLayer"),
}
COMMON = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 128, "tie_word_embeddings": True,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
LORA = ["peft.method=lora", "peft.r=4", "peft.alpha=8", "peft.dropout=0.0", "peft.target_modules=[q_proj,v_proj]"]
PATHS = {"fsdp1": ["fsdp.fsdp_version=1"], "fsdp2": ["fsdp.fsdp_version=2"], "lora": ["fsdp.fsdp_version=2", *LORA]}
TP = ["fsdp.fsdp_version=2", "parallelism.tp_size=2"]


def save_tied(arch, path):
    """A tied model of ``arch`` saved in several safetensors files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**COMMON, **SHAPES[arch][0]})
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    return path


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """{(arch, source): recipe path}; 8 examples (one step: 4 per rank on 2 ranks) with no validation."""
    root = tmp_path_factory.mktemp("tied")
    rows = TRAIN.read_text().splitlines()[:8]
    data = root / "eight.jsonl"
    data.write_text("\n".join(rows) + "\n")
    out = {}
    for arch, (shape, layer) in SHAPES.items():
        for source in ("config", "pretrained"):
            model = (f"{{name_or_path: {save_tied(arch, root / f'{arch}-init')}}}" if source == "pretrained" else
                     json.dumps({"config": {**COMMON, **shape}}))
            recipe = root / f"{arch}-{source}.yaml"
            recipe.write_text(textwrap.dedent(f"""
                name: {arch}-{source}
                output_dir: {root / 'runs'}
                model: {model}
                tokenizer: {{name_or_path: {TOKENIZER}}}
                data: {{train_files: [{data}], val_fraction: 0.0, seq_len: 48, packing: false,
                        cache_dir: {root / 'cache'}}}
                optim: {{lr: 1.0e-2, warmup_steps: 0, schedule: constant, weight_decay: 0.0}}
                trainer: {{max_steps: {STEPS}, micro_batch_size: 4, accelerator: cpu, limit_val_batches: 0,
                           progress_bar: false, log_every_n_steps: 5, num_threads: 1, gc_freeze: false}}
                logging: {{wandb: {{enabled: false}}, csv: false}}
                checkpoint: {{every_n_steps: 5, keep_last: null}}
                export: {{at_end: true, max_shard_size: 40KB}}
                callbacks: {{comm: {{enabled: false}}, memory: {{enabled: false}}, throughput: {{enabled: false}}}}
                fsdp: {{transformer_cls_names_to_wrap: [{layer}]}}
            """))
            out[arch, source] = recipe
    return out


def runs_for(recipes, paths, tag):
    return {f"{arch} {source} {path}": {"recipe": str(recipe), "train": True,
                                         "overrides": [*overrides, f"name={arch}-{source}-{path}-{tag}"]}
            for (arch, source), recipe in recipes.items() for path, overrides in paths.items()}


RESUMED = "llama pretrained fsdp2 resumed"


@pytest.fixture(scope="module")
def two_ranks(recipes, tmp_path_factory):
    """Every (architecture, source, path) on 2 ranks, then the FSDP2 run of the pretrained Llama again, resumed
    from its step-5 checkpoint."""
    runs = runs_for(recipes, PATHS, "2")
    first = recipes["llama", "pretrained"].parent / "runs" / "llama-pretrained-fsdp2-2"
    runs[RESUMED] = {"recipe": str(recipes["llama", "pretrained"]), "train": True,
                     "overrides": [*PATHS["fsdp2"], "name=llama-pretrained-fsdp2-resumed",
                                   f"resume={first / 'checkpoints' / 'step-5'}"]}
    return gloo_fits(None, 2, runs, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(recipes, tmp_path_factory):
    return gloo_fits(None, 4, runs_for(recipes, {"tp2 x fsdp2": TP}, "4"), tmp_path_factory.mktemp("four_ranks"))


def reference_gradients(recipe, overrides=()):
    """One process, no Lightning: the first step's gradient on the whole batch (the eight examples)."""
    cfg = load_recipe(str(recipe), list(overrides))
    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg, sharded_load=False)
    module.configure_model()
    model = module.model
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    data = SFTDataModule(cfg, build_tokenizer(cfg))
    data.setup("fit")
    batch = default_collate([data.train_dataset[i] for i in range(len(data.train_dataset))])
    total, count = module._loss_sum(batch)
    (total / count).backward()
    return {clean_param_name(n).removeprefix("model."): p.grad.detach().clone()
            for n, p in module.named_parameters() if p.requires_grad}


def check_run(name, run, recipes):
    arch, source, path = name.split(" ", 2)
    run_dir = Path(run["summary"]["run_dir"])
    assert run["steps"] == STEPS, name
    resumed = name == RESUMED
    assert run["tied_live"] is True, f"{name}: the live model's embedding and head are two parameters"
    assert not any(k.endswith("lm_head.weight") for k in run["grads"]), f"{name}: lm_head has a gradient of its own"
    checkpoints = complete_checkpoints(run_dir / "checkpoints")
    assert [c.name for c in checkpoints] == (["step-10"] if resumed else ["step-5", "step-10"]), name
    for checkpoint in checkpoints:
        assert_tied_in_checkpoint(checkpoint, name)
    if path == "lora":
        assert_adapter_reloads(run_dir, name)
    else:
        assert_export_reloads(run_dir, name)
    if source == "pretrained" and not resumed:
        overrides = LORA if path == "lora" else []
        expected = reference_gradients(recipes[arch, source], overrides)
        assert set(run["grads"]) == set(expected), set(run["grads"]) ^ set(expected)
        errors = {k: float((run["grads"][k] - expected[k]).norm() / expected[k].norm().clamp(min=1e-30))
                  for k in expected}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= GRAD_RTOL, f"{name}: {worst} off by {errors[worst]:.2e}"


def assert_tied_in_checkpoint(checkpoint, name):
    """Every weight tensor the checkpoint holds of the embedding and the head is the same."""
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    keys = [k for k in saved if k.startswith(WEIGHT_PREFIX) and
            k.endswith(("embed_tokens.weight", "lm_head.weight")) and "lora" not in k]
    if not keys:  # a LoRA run on a pretrained base: its checkpoints reference the frozen base
        return
    tensors = {k: torch.empty(saved[k].size, dtype=saved[k].properties.dtype) for k in keys}
    dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=True)
    first = tensors[keys[0]]
    assert all(torch.equal(first, t) for t in tensors.values()), f"{name}: {checkpoint.name} holds them apart"


def assert_export_reloads(run_dir, name):
    from transformers import AutoModelForCausalLM

    model_dir = run_dir / "model"
    names = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names, f"{name}: {sorted(names)}"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    check = load_file(str(run_dir / "export_check.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=check["input_ids"]).logits
    assert (logits - check["logits"]).abs().max() <= LOGITS_ATOL, name


def assert_adapter_reloads(run_dir, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = run_dir / "model" / "adapter"
    base_name = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_name)
    assert base.lm_head.weight is base.get_input_embeddings().weight
    model = PeftModel.from_pretrained(base, str(adapter))
    check = load_file(str(run_dir / "model" / "export_check.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=check["input_ids"]).logits
    assert (logits - check["logits"]).abs().max() <= LOGITS_ATOL, name


@pytest.mark.slow
def test_tied_embeddings_stay_one_parameter_on_fsdp1_fsdp2_and_lora(two_ranks, recipes):
    for name, run in two_ranks.items():
        check_run(name, run, recipes)


@pytest.mark.slow
def test_a_resumed_tied_run_ends_where_the_uninterrupted_one_does(two_ranks):
    """Resumed from step 5, the tied weight (loaded once into the one parameter) trains to the same step-10
    weights as the run that went through."""
    checkpoints = [Path(two_ranks[name]["summary"]["run_dir"]) / "checkpoints" / "step-10"
                   for name in ("llama pretrained fsdp2", RESUMED)]
    weights = []
    for checkpoint in checkpoints:
        saved = read_dcp_metadata(checkpoint).state_dict_metadata
        tensors = {k[len(WEIGHT_PREFIX):]: torch.empty(v.size, dtype=v.properties.dtype)
                   for k, v in saved.items() if k.startswith(WEIGHT_PREFIX)}
        dcp.load({WEIGHT_PREFIX + k: t for k, t in tensors.items()}, checkpoint_id=str(checkpoint), no_dist=True)
        weights.append(tensors)
    assert set(weights[0]) == set(weights[1]) and "model.embed_tokens.weight" in weights[0]
    worst = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert worst <= 1e-6, worst


@pytest.mark.slow
def test_tied_embeddings_stay_one_parameter_on_tp2_x_fsdp2(four_ranks, recipes):
    for name, run in four_ranks.items():
        check_run(name, run, recipes)
