"""The FSDP strategy on real gloo ranks: every sharding strategy × FSDP1/FSDP2 against a single-process
reference, no_sync accumulation (equal results, fewer reduce-scatters), activation checkpointing, and the
Accelerate vocabulary (plugin parsing, `accelerate config` import, bad input).

Every run is a whole ``shardlight.train.train`` with its collectives and block forwards counted
(tests/strategy_runs.py); the 2-rank runs share one process pair and the 4-rank ones one process tree, with
test_chunked_loss's and test_compile_and_checkpointing's runs on the same model (conftest's
``strategy_two_ranks``, ``strategy_four_ranks``)."""


import pytest
from conftest import forbid_training, run_cli
from strategy_runs import MATRIX, STEPS, assert_weights_close, final_weights, matrix_overrides, reference_weights

from shardlight.cli.main import main


@pytest.mark.slow
@pytest.mark.parametrize("version,strategy", MATRIX, ids=[f"fsdp{v}-{s}" for v, s in MATRIX])
def test_sharded_training_matches_single_process(strategy_setup, request, version, strategy):
    root, recipe = strategy_setup
    world, _ = matrix_overrides(version, strategy)
    runs = request.getfixturevalue("strategy_four_ranks" if world == 4 else "strategy_two_ranks")
    run = runs[f"fsdp{version}-{strategy}"]
    summary, counts = run["summary"], run["counts"]
    assert summary["steps"] == STEPS and summary["world_size"] == world
    assert f"FSDP {strategy}: 3 units on {world} ranks" in run["output"]
    assert_weights_close(final_weights(summary), reference_weights(recipe, world))
    assert len(counts) == world
    if strategy != "NO_SHARD":
        assert all(c["all_gather"] > 0 and c["reduce_scatter"] > 0 for c in counts)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_no_sync_accumulation_skips_reduce_scatter_and_matches(strategy_setup, strategy_two_ranks, version):
    root, recipe = strategy_setup
    runs = strategy_two_ranks
    skipped, synced = runs[f"fsdp{version} no_sync"], runs[f"fsdp{version} sync_each_batch"]
    units = 3
    # one reduce-scatter per unit per optimizer step vs one per unit per micro-batch
    assert all(c["reduce_scatter"] == units * STEPS for c in skipped["counts"]), skipped["counts"]
    assert all(c["reduce_scatter"] == units * STEPS * 4 for c in synced["counts"]), synced["counts"]
    assert_weights_close(final_weights(skipped["summary"]), final_weights(synced["summary"]))
    assert_weights_close(final_weights(skipped["summary"]), reference_weights(recipe, 2, accumulate=4))


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_activation_checkpointing_recomputes_each_block(strategy_two_ranks, version):
    runs = strategy_two_ranks
    plain, ckpt = runs[f"fsdp{version}-FULL_SHARD"], runs[f"fsdp{version} activation checkpointing"]
    layers = 2
    # One extra forward per rank: the export check's reference logits (the export is verified tensor by
    # tensor, no reload).
    extra = [1, 1]
    assert [c["block_forward"] for c in plain["counts"]] == [layers * (STEPS + e) for e in extra], plain["counts"]
    assert [c["block_forward"] for c in ckpt["counts"]] == [layers * (2 * STEPS + e) for e in extra], ckpt["counts"]
    assert_weights_close(final_weights(ckpt["summary"]), final_weights(plain["summary"]), atol=1e-6)


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_POST
  fsdp_cpu_ram_efficient_loading: false
  fsdp_forward_prefetch: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_accelerate_config_file_is_accepted_unchanged(tmp_path, capsys):
    import yaml

    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_YAML)
    assert main(["train", "--accelerate-config", str(path), "--print-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    fsdp, trainer = resolved["fsdp"], resolved["trainer"]
    assert fsdp["sharding_strategy"] == "SHARD_GRAD_OP" and fsdp["backward_prefetch"] == "BACKWARD_POST"
    assert fsdp["activation_checkpointing"] is True and fsdp["forward_prefetch"] is True
    assert fsdp["transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]
    assert fsdp["state_dict_type"] == "SHARDED_STATE_DICT" and fsdp["sync_module_states"] is True
    assert trainer["precision"] == "bf16-mixed" and trainer["devices"] == 2 and trainer["num_nodes"] == 1

    from shardlight.recipe import load_recipe
    from shardlight.strategy import resolve_recipe_fsdp

    plan = resolve_recipe_fsdp(load_recipe(None, accelerate_config=str(path)))
    assert (plan.sharding_strategy, plan.backward_prefetch, plan.forward_prefetch) == (
        "SHARD_GRAD_OP", "BACKWARD_POST", True)
    assert plan.mixed_precision == "bf16" and plan.state_dict_type == "SHARDED_STATE_DICT"


def test_fsdp2_defaults_follow_accelerate():
    from shardlight.recipe import FSDPConfig
    from shardlight.strategy import resolve_fsdp

    v2 = resolve_fsdp(FSDPConfig(fsdp_version=2))
    assert v2.reshard_after_forward is True and v2.state_dict_type == "SHARDED_STATE_DICT"
    assert v2.backward_prefetch is None
    v1 = resolve_fsdp(FSDPConfig())
    assert v1.sharding_strategy == "FULL_SHARD" and v1.state_dict_type == "FULL_STATE_DICT"
    assert v1.backward_prefetch == "BACKWARD_PRE" and v1.use_orig_params is True
    zero2 = resolve_fsdp(FSDPConfig(fsdp_version=2, reshard_after_forward=False))
    assert zero2.sharding_strategy == "SHARD_GRAD_OP"


BAD_FSDP = [
    (["fsdp.shardng_strategy=FULL_SHARD"], "did you mean 'fsdp.sharding_strategy'"),
    (["fsdp.auto_wrap_policy=LAYER_WRAP"], "allowed values: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP"),
    (["fsdp.fsdp_version=3"], "fsdp.fsdp_version: '3' is not allowed; allowed values: 1, 2"),
    (["fsdp.fsdp_version=2", "fsdp.backward_prefetch=BACKWARD_PRE"], "backward_prefetch is not supported in FSDP2"),
    (["fsdp.fsdp_version=2", "fsdp.forward_prefetch=true"], "forward_prefetch is not yet implemented in FSDP2"),
    (["fsdp.fsdp_version=2", "fsdp.reshard_after_forward=FULL_SHARD"], "fsdp (fsdp_version 2)"),
    (["fsdp.sharding_strategy=HYBRID_SHARD", "fsdp.mesh_shape=[3,1]"], "does not match the world size 2"),
    (["fsdp.sharding_strategy=HYBRID_SHARD", "fsdp.mesh_shape=[2,1]"], "silently stops syncing gradients"),
    (["fsdp.mesh_shape=[1,2]"], "mesh_shape only applies to hybrid sharding"),
    (["fsdp.transformer_cls_names_to_wrap=[Block]"], "Block not found in the model; module classes present"),
    (["trainer.precision=16-mixed"], "needs a GPU; use bf16-mixed on CPU"),
    (["fsdp.sync_module_states=true"], "needs GPUs: FSDP broadcasts module states from GPU memory only"),
]


@pytest.mark.parametrize("overrides,expected", BAD_FSDP, ids=[b[0][-1] for b in BAD_FSDP])
def test_bad_fsdp_input_is_one_line_before_spawn(tmp_path, capsys, monkeypatch, overrides, expected):
    forbid_training(monkeypatch)
    code = main(["train", f"output_dir={tmp_path / 'out'}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert expected in err
    assert not (tmp_path / "out").exists()


def test_bad_accelerate_config(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: DEEPSPEED\n")
    result = run_cli(["train", "--accelerate-config", str(path), "--print-config"])
    assert result.returncode == 2 and "distributed_type is DEEPSPEED" in result.stderr
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n")
    result = run_cli(["train", "--accelerate-config", str(path), "--print-config"])
    assert result.returncode == 2 and "did you mean 'fsdp_sharding_strategy'" in result.stderr


@pytest.mark.slow
def test_bf16_mixed_autocasts_on_cpu(strategy_two_ranks):
    run = strategy_two_ranks["bf16-mixed"]
    # Lightning's stock plugin autocasts on CUDA even on CPU (and warns); here it autocasts on the CPU.
    assert run["steps"] == STEPS
    assert "CUDA is not available" not in run["output"] and "device_type of 'cuda'" not in run["output"]
