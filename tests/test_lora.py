"""LoRA (peft) under FSDP on real 2-rank gloo runs: FSDP1 and FSDP2 against a single-process peft reference
on the same global batch (adapters allclose, every base weight bitwise unchanged), no reduce-scatter on
non-final micro-batches, activation checkpointing, bf16-mixed, checkpoints that reference the frozen base,
exact resume, both exports reloaded and compared, and bad input (one line, exit 2, before spawn).

Spawned runs are few and each checks several things (the file must stay fast on 2 cores)."""

import csv
import json
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, forbid_training, gloo_fits, save_tiny_llama
from safetensors.torch import load_file

from shardlight.cli.main import main

TOKENIZER = REPO / "recipes" / "assets" / "tiny-tokenizer"
TRAIN_DATA = REPO / "recipes" / "data" / "tiny_sft_train.jsonl"
STEPS, ACCUMULATE = 4, 2
FAST = ["callbacks.comm.enabled=false", "callbacks.throughput.enabled=false", "logging.wandb.enabled=false"]
LORA_KEY = "lora_"


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """A saved tiny Llama (the frozen base the checkpoints reference) and a LoRA recipe on it: adapters on
    q/v, the head trained in full (modules_to_save), no dropout (the reference draws no masks)."""
    root = tmp_path_factory.mktemp("lora")
    save_tiny_llama(root / "init")
    recipe = root / "lora.yaml"
    recipe.write_text(textwrap.dedent(f"""
        output_dir: {root / 'runs'}
        model: {{name_or_path: {root / 'init'}}}
        tokenizer: {{name_or_path: {TOKENIZER}}}
        data: {{train_files: [{TRAIN_DATA}], val_fraction: 0.0, seq_len: 32}}
        optim: {{lr: 1.0e-2, warmup_steps: 1, weight_decay: 0.1}}
        trainer: {{max_steps: {STEPS}, micro_batch_size: 2, accumulate_grad_batches: {ACCUMULATE}, accelerator: cpu,
                   devices: 2, limit_val_batches: 0, progress_bar: false, log_every_n_steps: 1, num_threads: 1,
                   collective_timeout_s: 60}}
        checkpoint: {{every_n_steps: 2, keep_last: 3}}
        fsdp: {{transformer_cls_names_to_wrap: [LlamaDecoderLayer]}}
        peft: {{method: lora, r: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj],
                modules_to_save: [lm_head]}}
    """))
    return root, recipe


def lora_runs(recipe, root):
    """Every run of this module, in one process pair (``conftest.gloo_fits``), counted, their console and full
    state kept: FSDP1 with activation checkpointing (a checkpoint every 2 steps), the same resumed from its step
    2, FSDP2 with the memory callback every step, and the shipped LoRA recipe under bf16-mixed."""
    runs = {
        "fsdp1": (recipe, ["fsdp.activation_checkpointing=true"]),
        "resumed": (recipe, ["fsdp.activation_checkpointing=true", f"resume={fsdp1_step2(root)}"]),
        "fsdp2": (recipe, ["fsdp.fsdp_version=2", "callbacks.memory.every_n_steps=1"]),
        "bf16 shipped": (REPO / "recipes" / "tiny-llama-lora.yaml", [
            "trainer.precision=bf16-mixed", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
            "trainer.limit_val_batches=0", "trainer.progress_bar=false", "trainer.micro_batch_size=2",
            "data.seq_len=64", "fsdp.fsdp_version=2", "fsdp.activation_checkpointing=true",
            "callbacks.memory.enabled=false", f"output_dir={root / 'runs'}"]),
    }
    return {name: {"recipe": str(path), "train": True, "counters": True, "capture": True, "full_state": True,
                   "overrides": [*FAST, *overrides, f"name={name.replace(' ', '-')}"]}
            for name, (path, overrides) in runs.items()}


def fsdp1_step2(root):
    return root / "runs" / "fsdp1" / "checkpoints" / "step-2"


@pytest.fixture(scope="module")
def runs(lora_setup, tmp_path_factory):
    root, recipe = lora_setup
    return gloo_fits(recipe, 2, lora_runs(recipe, root), tmp_path_factory.mktemp("lora_runs"))


def step_metrics(run_dir, key):
    with open(Path(run_dir) / "csv" / "metrics.csv") as fh:
        return {int(r["step"]) + 1: float(r[key]) for r in csv.DictReader(fh) if r.get(key)}


def reference_adapters(recipe):
    """The same steps in one process on the same global batch with the same peft model (test_strategy's
    reference: mean over ranks and micro-batches, global-norm clipping, AdamW on the trainable groups)."""
    from strategy_runs import reference_weights

    weights = reference_weights(recipe, 2, accumulate=ACCUMULATE)
    return {k: v for k, v in weights.items() if LORA_KEY in k or "modules_to_save" in k}


def check_against_reference(run, reference, init):
    summary = run["summary"]
    full = {k[len("model."):]: v for k, v in run["weights"].items()}
    for name, expected in reference.items():
        assert torch.allclose(full[name], expected, atol=2e-5, rtol=0), (name, float((full[name] - expected).abs().max()))
    frozen = {k: v for k, v in full.items() if LORA_KEY not in k and "modules_to_save" not in k}
    assert len(frozen) == len(init)
    for name, tensor in frozen.items():
        base_name = name.replace("base_model.model.", "", 1).replace(".base_layer", "").replace(".original_module", "")
        assert torch.equal(tensor, init[base_name]), name  # bitwise: the base never moved
    # Training moved the adapters (lora_B starts at zero) and the live export matched the sharded model.
    assert any(float(v.abs().max()) > 0 for k, v in reference.items() if "lora_B" in k)
    assert summary["export_max_abs_diff"] <= 1e-5
    adapter = Path(summary["model_dir"])
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def base_weights(lora_setup):
    return load_file(str(lora_setup[0] / "init" / "model.safetensors"))


@pytest.mark.slow
def test_fsdp1_lora_matches_reference_and_checkpoints_reference_the_base(lora_setup, runs, base_weights, tmp_path):
    root, recipe = lora_setup
    out, run = tmp_path, runs["fsdp1"]
    summary, counts, output = run["summary"], run["counts"], run["output"]
    assert summary["steps"] == STEPS
    assert "FSDP FULL_SHARD: 3 units on 2 ranks (LlamaDecoderLayer)" in output
    assert "trainable 17,408 of " in output  # 2 blocks x (q, v) x r 4 x (32 + 32) + the 512 x 32 head copy
    # One reduce-scatter per unit per optimizer step: none on the non-final micro-batch.
    assert all(c["reduce_scatter"] == 3 * STEPS for c in counts), counts
    wrap = json.loads((Path(summary["run_dir"]) / "wrap_report.json").read_text())
    assert wrap["trainable_per_unit"] == {"min": 512, "median": 512, "max": 512}
    assert wrap["root_trainable_params"] == 512 * 32
    check_against_reference(run, reference_adapters(recipe), base_weights)

    # The checkpoint holds the trainable weights and their optimizer state only; the base is referenced.
    step = Path(summary["checkpoint"])
    meta = json.loads((step / "shardlight.json").read_text())
    assert meta["peft"] == {"method": "lora", "base_model": str(root / "init"), "base_in_checkpoint": False}
    assert main(["inspect", str(step), "--json", str(out / "inspect.json")]) == 0
    names = [e["name"] for e in json.loads((out / "inspect.json").read_text())["entries"]]
    assert names and all(LORA_KEY in n or "modules_to_save" in n for n in names), names
    assert (step / "hf" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_resume_equals_uninterrupted_and_both_exports_reload(lora_setup, runs, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, recipe = lora_setup
    summary, resumed = runs["fsdp1"]["summary"], runs["resumed"]["summary"]
    reference = step_metrics(summary["run_dir"], "train/loss")
    step2 = Path(summary["run_dir"]) / "checkpoints" / "step-2"
    assert step2 == fsdp1_step2(root)
    assert f"resumed from {step2} at step 2" in runs["resumed"]["output"]
    again = step_metrics(resumed["run_dir"], "train/loss")
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert abs(again[step] - reference[step]) <= 1e-6, (step, again[step], reference[step])

    # --merge: every wrapped layer merged by peft's own merge on that layer alone, one output file (of at most
    # 40 kB here: several) at a time; the result is merge_and_unload's, bit for bit.
    export = tmp_path / "export"
    capsys.readouterr()
    assert main(["export", summary["checkpoint"], "--out", str(export), "--merge", "--max-shard-size", "40000"]) == 0
    stdout = capsys.readouterr().out
    assert "adapter/ (1 file(s)), merged/ (" in stdout and "max |diff| = 0: OK" in stdout, stdout
    report = json.loads((export / "export_report.json").read_text())
    assert report["max_abs_diff"] == 0.0 and report["ok"] and report["files"]["merged"] > 2, report
    assert not (export / "base").exists()  # the pretrained base is referenced, not copied
    assert (export / "merged" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(root / "init"), dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, str(export / "adapter")).eval()
        adapter = peft_model(input_ids=ids).logits
        expected = peft_model.merge_and_unload().state_dict()
        merged = AutoModelForCausalLM.from_pretrained(str(export / "merged"), dtype=torch.float32).eval()
        live_base = AutoModelForCausalLM.from_pretrained(str(root / "init"), dtype=torch.float32)
        live = PeftModel.from_pretrained(live_base, summary["model_dir"]).eval()(input_ids=ids).logits
    assert merged.state_dict().keys() == expected.keys()
    assert all(torch.equal(merged.state_dict()[k], expected[k]) for k in expected)
    assert float((merged(input_ids=ids).logits - adapter).abs().max()) <= 1e-5
    assert float((live - adapter).abs().max()) <= 1e-6  # the final checkpoint is the model training ended with
    # Without --merge the base is never loaded: the checkpoint's trainable weights are the adapter, the same
    # tensors as the live export's.
    alone = tmp_path / "alone"
    assert main(["export", summary["checkpoint"], "--out", str(alone)]) == 0
    stdout = capsys.readouterr().out
    assert "adapter/ (1 file(s));" in stdout and ": OK" in stdout, stdout
    written = load_file(str(alone / "adapter" / "adapter_model.safetensors"))
    live_file = load_file(str(Path(summary["model_dir"]) / "adapter_model.safetensors"))
    assert written.keys() == live_file.keys() and all(torch.equal(written[k], live_file[k]) for k in written)
    assert not (alone / "base").exists() and not (alone / "merged").exists()


@pytest.mark.slow
def test_fsdp2_lora_matches_reference_and_holds_only_trainable_state(lora_setup, runs, base_weights):
    _, recipe = lora_setup
    run = runs["fsdp2"]
    summary, counts = run["summary"], run["counts"]
    assert all(c["reduce_scatter"] == 3 * STEPS for c in counts), counts
    check_against_reference(run, reference_adapters(recipe), base_weights)
    # The memory callback measures p.grad and optimizer-state storages: under FSDP2 those are the trainable
    # shards only (17,408 fp32 values over 2 ranks; AdamW's two moments), well below the weights.
    grads, optim, params = (step_metrics(summary["run_dir"], f"memory/{k}_gb") for k in ("grads", "optim", "params"))
    assert grads[STEPS] * 1e9 <= 17_408 * 4 / 2 + 4096, grads
    assert optim[STEPS] * 1e9 <= 2 * 17_408 * 4 / 2 + 4096, optim
    assert params[STEPS] > 3 * grads[STEPS]  # the 512 x 32 head copy is most of what trains


@pytest.mark.slow
def test_bf16_mixed_lora_on_the_shipped_recipe(runs, tmp_path, capsys):
    """The shipped recipe (inline base, so its checkpoints hold the frozen base too) under bf16-mixed."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary = runs["bf16 shipped"]["summary"]
    assert summary["steps"] == 2 and summary["export_max_abs_diff"] is not None
    meta = json.loads((Path(summary["checkpoint"]) / "shardlight.json").read_text())
    assert meta["peft"]["base_in_checkpoint"] is True and meta["peft"]["base_model"] is None
    losses = step_metrics(summary["run_dir"], "train/loss")
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    # The inline base exists only in the run: the live export writes it from the shards beside the adapter,
    # which names it; `shardlight export --merge` writes it from the checkpoint, one file at a time.
    live = Path(summary["run_dir"]) / "model"
    adapter_config = json.loads((live / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((live / "base").resolve())
    export = tmp_path / "export"
    capsys.readouterr()
    assert main(["export", summary["checkpoint"], "--out", str(export), "--merge"]) == 0
    stdout = capsys.readouterr().out
    assert "adapter/ (1 file(s)), base/ (1 file(s)), merged/ (1 file(s))" in stdout, stdout
    base_file = load_file(str(export / "base" / "model.safetensors"))
    live_file = load_file(str(live / "base" / "model.safetensors"))
    assert base_file.keys() == live_file.keys() and all(torch.equal(base_file[k], live_file[k]) for k in base_file)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(export / "base"), dtype=torch.float32)
        expected = PeftModel.from_pretrained(base, str(export / "adapter")).merge_and_unload().state_dict()
        merged = AutoModelForCausalLM.from_pretrained(str(export / "merged"), dtype=torch.float32).state_dict()
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in expected)


BAD_LORA = [
    (["peft.target_modules=[qproj]"],
     "peft.target_modules: qproj not found in the model; Linear modules present: down_proj, gate_proj, k_proj, "
     "lm_head, o_proj, q_proj, up_proj, v_proj"),
    (["peft.modules_to_save=[head]"], "peft.modules_to_save: head not found in the model"),
    (["peft.r=0"], "peft.r must be positive, got 0"),
    (["peft.r=-4"], "peft.r must be positive, got -4"),
    (["peft.dropout=1.0"], "peft.dropout must be in [0, 1), got 1.0"),
    (["peft.dropout=-0.1"], "peft.dropout must be in [0, 1), got -0.1"),
    (["peft.alpha=0"], "peft.alpha must be positive"),
    (["peft.method=dora"], "peft.method: 'dora' is not allowed; allowed values: null, lora, qlora"),
    (["fsdp.use_orig_params=false"], "peft.method lora with fsdp_version 1 needs fsdp.use_orig_params: true"),
    (["peft.method=qlora"], "peft.method qlora loads the base model in 4 bits with bitsandbytes, which needs a GPU"),
    (["peft.target_modules=[]"], "peft.target_modules is empty"),
]


@pytest.mark.parametrize("overrides,expected", BAD_LORA, ids=[b[0][0] for b in BAD_LORA])
def test_bad_lora_input_is_one_line_before_spawn(tmp_path, capsys, monkeypatch, overrides, expected):
    forbid_training(monkeypatch)
    recipe = REPO / "recipes" / "tiny-llama-lora.yaml"
    code = main(["train", str(recipe), f"output_dir={tmp_path / 'out'}", "trainer.accelerator=cpu", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert expected in err
    assert not (tmp_path / "out").exists()


def test_fsdp2_needs_no_orig_params_and_lora_recipe_resolves(tmp_path, capsys):
    code = main(["train", str(REPO / "recipes" / "tiny-llama-lora.yaml"), "fsdp.fsdp_version=2",
                 "fsdp.use_orig_params=false", "--print-config"])
    out = capsys.readouterr().out
    assert code == 0 and "method: lora" in out, out


def test_export_merge_refuses_a_full_model_checkpoint(tmp_path, capsys, monkeypatch):
    from shardlight.checkpoint import export_checkpoint
    from shardlight.errors import ShardlightError

    step = tmp_path / "step-1"
    step.mkdir()
    (step / "shardlight.json").write_text(json.dumps({"files": {}}))
    (step / ".metadata").write_bytes(b"")
    with pytest.raises(ShardlightError, match="--merge merges LoRA adapters"):
        export_checkpoint(step, tmp_path / "out", merge=True)
    assert not (tmp_path / "out").exists()


def test_plan_lora_has_no_gradients_or_optimizer_state_for_the_frozen_base(tmp_path, capsys):
    recipe = str(REPO / "recipes" / "llama-3-8b-sft.yaml")
    for version in (1, 2):
        assert main(["plan", recipe, "--peft", "lora", "--lora-r", "16", f"fsdp.fsdp_version={version}",
                     "--json", str(tmp_path / f"lora{version}.json")]) == 0
    # The LoRA plans' memory is analytic (the fake step builds no adapters): compare with the analytic full plan.
    assert main(["plan", recipe, "--analytic", "--json", str(tmp_path / "full.json")]) == 0
    out = capsys.readouterr().out
    assert "lora r=16 (6,815,744 trainable params, base frozen; FSDP1)" in out  # 32 x (q, v) x 16 x (4096 + 5120)

    def row(name):
        plan = json.loads((tmp_path / f"{name}.json").read_text())
        return next(r for r in plan["strategies"] if r["sharding_strategy"] == "FULL_SHARD"
                    and not r["activation_checkpointing"] and not r["cpu_offload"])

    full, fsdp1, fsdp2 = row("full"), row("lora1"), row("lora2")
    assert fsdp1["optim_bytes"] == fsdp2["optim_bytes"] == 6_815_744 / 8 * 4 * 2  # AdamW on the adapter shards
    assert fsdp2["grads_bytes"] == 6_815_744 / 8 * 4 and fsdp1["grads_bytes"] >= full["grads_bytes"]
    assert fsdp1["params_bytes"] - full["params_bytes"] == 6_815_744 / 8 * 4
    assert fsdp2["peak_bytes"] <= fsdp1["peak_bytes"] < full["peak_bytes"]  # activations dominate the peak
    assert fsdp2["compute_time_s"] < full["compute_time_s"]
    assert main(["plan", recipe, "--peft", "dora"]) == 2
    assert "--peft 'dora' is not one of none, lora, qlora" in capsys.readouterr().err


@pytest.mark.parametrize("targets", [None, ["gate_proj", "self_attn.o_proj"]], ids=["peft-default", "named"])
def test_the_plan_counts_the_adapters_peft_builds(targets):
    """The planner's trainable count for rank-r adapters equals what peft builds on the same model: its
    default targets for the architecture, or the recipe's (a dotted name included)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardlight.planner.model_spec import model_spec

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, task_type="CAUSAL_LM", target_modules=targets))
    built = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_spec(config, lora_targets=targets).lora_params(4) == built > 0
