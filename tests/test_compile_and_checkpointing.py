"""The knobs a verdict can turn: activation checkpointing's choices (selective, every n-th block, offload) give
the gradients of no checkpointing and the activation memory the planner predicts; ``compile: true`` trains the
default recipe to the same losses on FSDP1 and FSDP2, its compile time reported apart; each refused in one
line where it cannot work."""

import copy
import csv
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import DEFAULT_RECIPE, run_cli
from strategy_runs import assert_weights_close, final_weights, reference_weights

from shardlight.strategy.activation_checkpointing import checkpoint_blocks, checkpointed_blocks

CHOICES = [("full", 1, False), ("selective", 1, False), ("full", 2, False), ("selective", 3, False),
           ("full", 1, True), ("selective", 2, True)]


def _llama(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _unwrapped(name):
    return name.replace("._checkpoint_wrapped_module", "").replace("._offload_wrapped_module", "")


def _loss_and_grads(model, ids):
    from shardlight.lm_loss import loss_sum

    model.zero_grad(set_to_none=True)
    total, count = loss_sum(model, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    (total / count).backward()
    return total.detach(), {_unwrapped(n): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,every,offload", CHOICES, ids=[f"{m}-every{e}{'-offload' if o else ''}"
                                                             for m, e, o in CHOICES])
def test_checkpointing_choices_give_the_gradients_of_no_checkpointing(mode, every, offload):
    """fp32: loss and every gradient within 1e-6 of the same model without checkpointing; the blocks checkpointed
    are 0, n, 2n, ... and each is recomputed (its forward starts twice: torch stops the recompute early)."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 48))
    plain_loss, plain = _loss_and_grads(model, ids)
    wrapped_model = copy.deepcopy(model)
    blocks = list(wrapped_model.model.layers)
    wrappers = checkpoint_blocks(wrapped_model, blocks, mode=mode, every=every, offload=offload)
    assert list(wrappers) == [id(b) for b in blocks[::every]] == [id(b) for b in checkpointed_blocks(blocks, every)]
    calls = []
    hooks = [b.register_forward_pre_hook(lambda m, i, k=k: calls.append(k)) for k, b in enumerate(blocks)]
    loss, grads = _loss_and_grads(wrapped_model, ids)
    for hook in hooks:
        hook.remove()
    assert sorted(calls) == sorted(list(range(len(blocks))) + list(range(0, len(blocks), every)))
    assert abs(float(loss - plain_loss)) <= 1e-6 * abs(float(plain_loss))
    assert set(grads) == set(plain)
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_selective_checkpointing_keeps_the_matmul_outputs_and_recomputes_the_rest():
    """The policy saves what is expensive to recompute, by op: matmuls, attention, TP collectives."""
    from shardlight.strategy.activation_checkpointing import saved_ops

    ops = saved_ops()
    assert torch.ops.aten.mm.default in ops and torch.ops.aten.addmm.default in ops
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ops
    assert torch.ops.aten.mul.Tensor not in ops and torch.ops.aten.silu.default not in ops


def test_the_planner_predicts_the_activation_memory_of_each_choice():
    """bf16-mixed, 8 blocks: the fake step (the real model under FakeTensorMode, checkpointed by the strategy's own
    code) and the analytic estimate agree within 10% for every choice (2% today), and both order them the same
    way: none > selective every 2nd > full every 2nd ~ selective > full."""
    from transformers import LlamaConfig

    from shardlight.planner.fake_step import step_memory
    from shardlight.planner.inputs import Workload
    from shardlight.planner.memory_estimate import activation_bytes
    from shardlight.planner.model_spec import model_spec

    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    choices = [(False, "full", 1), (True, "selective", 2), (True, "full", 2), (True, "selective", 1),
               (True, "full", 1)]  # most activation memory first (every 2nd in full and selective about tie)
    fake, analytic = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ckpt, mode, every in choices:
            step = step_memory(config, 1, "FULL_SHARD", ckpt, "bf16-mixed", 4, 512, scale=False,
                               checkpointing_mode=mode, checkpointing_every=every)
            fake.append(step["peak_by_category"]["activations"])
            work = Workload(micro_batch_size=4, seq_len=512, precision="bf16-mixed", checkpointing_mode=mode,
                            checkpointing_every=every)
            analytic.append(activation_bytes(model_spec(config), work, ckpt).total)
    for choice, f, a in zip(choices, fake, analytic):
        assert abs(a - f) <= 0.1 * f, (choice, a, f)
    for bytes_ in (fake, analytic):
        assert bytes_[0] > bytes_[1] > max(bytes_[2:4]) and min(bytes_[2:4]) > bytes_[4], (fake, analytic)
    assert fake[4] < 0.5 * fake[0] and fake[3] < 0.75 * fake[0], fake  # what each choice is for


def test_the_scaled_fake_step_steps_whole_periods_of_every_nth_checkpointing():
    from transformers import LlamaConfig

    from shardlight.planner.fake_step import measured_depths

    config = LlamaConfig(num_hidden_layers=32)
    assert measured_depths(config) == (4, 5)
    a, b = measured_depths(config, 3)
    assert (b - a) % 3 == 0 and a % 3 == 32 % 3 and a + b < 32


@pytest.mark.parametrize("overrides,expected", [
    (["fsdp.activation_checkpointing_mode=selective"],
     "fsdp.activation_checkpointing_mode=selective needs fsdp.activation_checkpointing=true"),
    (["fsdp.activation_checkpointing_every=2"],
     "fsdp.activation_checkpointing_every=2 needs fsdp.activation_checkpointing=true"),
    (["fsdp.activation_checkpointing=true", "fsdp.activation_checkpointing_mode=some"],
     "fsdp.activation_checkpointing_mode"),
    (["fsdp.activation_checkpointing=true", "fsdp.activation_checkpointing_offload=true"],
     "requires `fsdp_version=2`"),
    (["compile=true", "fsdp.use_orig_params=false"],
     "compile: true with fsdp_version 1 needs fsdp.use_orig_params: true (or null)"),
])
def test_bad_block_knobs_are_one_line_before_spawn(overrides, expected):
    result = run_cli(["train", str(DEFAULT_RECIPE), *overrides])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.stderr


def test_compile_without_a_cpp_compiler_is_one_line_before_spawn(tmp_path):
    result = run_cli(["train", str(DEFAULT_RECIPE), "compile=true", f"output_dir={tmp_path}"],
                     env={"CXX": "no-such-c++"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "error: compile: true on CPU needs a C++ compiler for torch.compile's kernels (none of no-such-c++ found "
        "on PATH); install one, set CXX, or set compile: false")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_checkpointing_choices_train_as_the_reference_on_fsdp(strategy_setup, strategy_two_ranks, version):
    """2 gloo ranks, FULL_SHARD: the checkpoint wrappers sit inside FSDP1's units and are FSDP2's units; the
    weights after training equal the single-process reference without checkpointing (FSDP1: selective; FSDP2:
    selective, every 2nd block, offloaded: tests/strategy_runs.py's ``CHECKPOINTING_CHOICES``)."""
    _, recipe = strategy_setup
    summary = strategy_two_ranks[f"fsdp{version} checkpointing choices"]["summary"]
    assert_weights_close(final_weights(summary), reference_weights(recipe, 2))


COMPILE_STEPS = 20


def _losses(run_dir):
    with open(Path(run_dir) / "csv" / "metrics.csv") as fh:
        return {int(r["step"]) + 1: float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")}


def _default_run(tmp_path, name, overrides):
    summary = tmp_path / f"{name}.json"
    result = run_cli(["train", str(DEFAULT_RECIPE), f"output_dir={tmp_path / name}", "--summary-json", str(summary),
                      f"trainer.max_steps={COMPILE_STEPS}", "trainer.log_every_n_steps=1", "trainer.num_threads=1",
                      "trainer.limit_val_batches=0", "export.at_end=false", "checkpoint.enabled=false",
                      "logging.wandb.enabled=false", "callbacks.comm.enabled=false", "diagnosis.enabled=false",
                      *overrides])
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(summary.read_text()), result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_compile_trains_the_default_recipe_to_the_same_losses(tmp_path, version):
    """20 steps of the default recipe (fp32) on 2 gloo ranks with and without ``compile: true``: every step's loss
    within 1e-4; the compile time is in the summary and the last line, apart from the step time."""
    plain, _ = _default_run(tmp_path, "plain", [f"fsdp.fsdp_version={version}"])
    compiled, out = _default_run(tmp_path, "compiled", [f"fsdp.fsdp_version={version}", "compile=true"])
    reference, losses = _losses(plain["run_dir"]), _losses(compiled["run_dir"])
    assert sorted(losses) == sorted(reference) == list(range(1, COMPILE_STEPS + 1))
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst <= 1e-4, (worst, reference, losses)
    assert "compile_s" not in plain and compiled["compile_s"] > 0
    assert f"compile {compiled['compile_s']:.1f} s" in out.strip().splitlines()[-1]


def test_plan_recommends_selective_checkpointing_where_it_fits():
    """An 8B Llama at micro-batch 5 on 8 GPUs needs full checkpointing with 64, 80 and 100 GB. Selective fits with
    100 GB alone, with 80 GB only with the chunked loss, with 64 GB not at all; where the plan recommends it, it
    says the headroom that a plan made for that choice gives."""
    from transformers import LlamaConfig

    from shardlight.planner.inputs import Workload, make_cluster
    from shardlight.planner.model_spec import model_spec
    from shardlight.planner.plan import make_plan, selective_checkpointing
    from shardlight.planner.recommend import find_row

    spec = model_spec(LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False))
    said = {}
    for memory in ("64GB", "80GB", "100GB"):
        cluster = make_cluster(nodes=1, gpus_per_node=8, gpu_memory=memory)
        work = Workload(micro_batch_size=5, seq_len=2048)
        rows = make_plan(spec, cluster, work)["strategies"]
        assert not find_row(rows, "SHARD_GRAD_OP")["fits"] and find_row(rows, "SHARD_GRAD_OP", True)["fits"]
        rec = {"fits": True, "activation_checkpointing": True, "sharding_strategy": "SHARD_GRAD_OP",
               "cpu_offload": False, "mesh_shape": None, "reasons": []}
        selective_checkpointing(rec, rows, spec, cluster, work)
        said[memory] = (rec.get("checkpointing_mode"), rec.get("loss_chunks"))
        if rec.get("checkpointing_mode"):
            chosen = Workload(micro_batch_size=5, seq_len=2048, checkpointing_mode="selective",
                              loss_chunks=rec.get("loss_chunks", 1))
            headroom = find_row(make_plan(spec, cluster, chosen)["strategies"], "SHARD_GRAD_OP", True)["headroom_bytes"]
            assert headroom >= 0 and f"{headroom / 1e9:.1f} GB headroom left" in rec["reasons"][0], rec["reasons"]
        else:
            assert not rec["reasons"]
    assert said == {"64GB": (None, None), "80GB": ("selective", 8), "100GB": ("selective", None)}, said
