"""shardlight plan / profile: decision-table cases from HF configs, bad input, recipes, and a real 2-rank
sweep whose measured local shard bytes must equal the predicted ones (±1%)."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest

import shardlight.planner
from shardlight.cli.main import main
from shardlight.errors import ShardlightError
from shardlight.planner.inputs import OPTIMIZERS, parse_memory
from shardlight.planner.plan import (
    ClusterOptions,
    WorkloadOptions,
    cluster_for,
    plan_for,
    spec_from_hf_config,
    workload_for,
)
from shardlight.planner.runs import child_env
from shardlight.planner.sweep import ProfileRequest, profile
from shardlight.recipe import OptimConfig

REPO = Path(__file__).resolve().parents[1]

LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 500000.0}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096,
              "tie_word_embeddings": False}
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}


def write_config(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def plan(tmp_path, capsys, *args):
    """``shardlight plan --analytic``: these decision cases are 1B-70B models on 8-32 ranks, whose fake-tensor
    steps take a minute each on 2 cores (tests/test_plan_fake.py runs the measured path on small models)."""
    out = tmp_path / "plan.json"
    code = main(["plan", *args, "--analytic", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(out.read_text()), captured.out


def test_parse_memory():
    assert parse_memory("80GB") == 80e9
    assert parse_memory("24GiB") == 24 * 2**30
    assert parse_memory("141 G") == 141e9
    assert parse_memory(80) == 80e9
    for bad in ("eighty", "80XB", "-5GB", "0GB", ""):
        with pytest.raises(ShardlightError):
            parse_memory(bad)


def test_1b_on_80gb_gpus_is_ddp(tmp_path, capsys):
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, LLAMA_1B), "--gpus-per-node", "8",
                        "--gpu-memory", "80GB")
    rec = result["recommendation"]
    assert rec["sharding_strategy"] == "NO_SHARD" and not rec["activation_checkpointing"] and not rec["cpu_offload"]
    assert any("DDP" in r for r in rec["reasons"])
    assert result["model"]["block_class"] == "LlamaDecoderLayer" and result["model"]["num_blocks"] == 16
    assert 1.2e9 < result["model"]["total_params"] < 1.3e9  # tied embeddings counted once
    assert {"sharding_strategy", "activation_checkpointing", "cpu_offload", "reasons"} <= set(rec)
    assert {"nodes", "gpus_per_node", "gpu_memory_bytes"} <= set(result["cluster"])
    strategies = {r["sharding_strategy"] for r in result["strategies"]}
    assert strategies == {"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"}  # one node: no HYBRID_SHARD
    assert "recommendation: NO_SHARD" in text


def test_7b_on_8x80gb_shards_optimizer_state_not_weights(tmp_path, capsys):
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, MISTRAL_7B), "--gpus-per-node", "8")
    rec = result["recommendation"]
    ddp = next(r for r in result["strategies"] if r["sharding_strategy"] == "NO_SHARD"
               and not r["activation_checkpointing"])
    assert not ddp["fits"]  # 7.2B x (4 + 4 + 8) bytes replicated does not fit in 80 GB
    assert rec["sharding_strategy"] == "SHARD_GRAD_OP"
    assert any("DDP does not fit" in r and "optimizer state" in r for r in rec["reasons"])
    # Sharded state is 1/8 of the replicated one (up to FSDP padding).
    full = next(r for r in result["strategies"] if r["sharding_strategy"] == "FULL_SHARD"
                and not r["activation_checkpointing"] and not r["cpu_offload"])
    assert full["optim_bytes"] == pytest.approx(ddp["optim_bytes"] / 8, rel=1e-4)
    assert full["comm_bytes_intra"] > next(r for r in result["strategies"] if r["sharding_strategy"] ==
                                           "SHARD_GRAD_OP")["comm_bytes_intra"]


def test_7b_on_24gb_gpus_needs_full_shard(tmp_path, capsys):
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, MISTRAL_7B), "--gpus-per-node", "8",
                     "--gpu-memory", "24GB", "--interconnect", "pcie")
    rec = result["recommendation"]
    assert rec["sharding_strategy"] == "FULL_SHARD" and rec["fits"]
    assert any("model does not fit unsharded" in r for r in rec["reasons"])
    assert any(r.startswith("Comm-bound") and "pcie" in r for r in rec["reasons"])


@pytest.mark.parametrize("network", ["infiniband", "ethernet"])
def test_70b_on_4_nodes_one_node_hybrid_cannot_hold_it(tmp_path, capsys, network):
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, LLAMA_70B), "--nodes", "4",
                     "--gpus-per-node", "8", "--gpu-memory", "80GB", "--interconnect", network,
                     "--seq-len", "4096", "--micro-batch-size", "2")
    rec = result["recommendation"]
    # fp32 shards + AdamW: ~1.1 TB of state, more than one node's 640 GB of GPU memory.
    one_node = [r for r in result["strategies"] if r["sharding_strategy"] == "HYBRID_SHARD"
                and r["shard_group_size"] == 8]
    assert one_node and not any(r["fits"] for r in one_node)
    assert any("one-node shard group" in r and "cannot hold" in r for r in rec["reasons"])
    assert rec["fits"] and rec["mesh_shape"] != [4, 8]
    assert rec["sharding_strategy"] in ("FULL_SHARD", "HYBRID_SHARD")
    chosen = next(r for r in result["strategies"] if r["sharding_strategy"] == rec["sharding_strategy"]
                  and r["activation_checkpointing"] == rec["activation_checkpointing"]
                  and r["cpu_offload"] == rec["cpu_offload"] and r["mesh_shape"] == rec["mesh_shape"])
    if network == "ethernet":
        assert chosen["bound"] == "comm-bound"
        assert any(r.startswith("Comm-bound") and "ethernet" in r for r in rec["reasons"])
    else:
        assert chosen["bound"] == "compute-bound"


def test_70b_bf16_weights_on_ethernet_prefers_intra_node_sharding(tmp_path, capsys):
    """Slow interconnect: keeping all-gathers inside a node beats FULL_SHARD across Ethernet."""
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, LLAMA_70B), "--nodes", "4",
                     "--interconnect", "ethernet", "--param-dtype", "bfloat16", "--micro-batch-size", "8")
    rec = result["recommendation"]
    assert rec["sharding_strategy"] == "HYBRID_SHARD" and rec["mesh_shape"] == [4, 8]
    assert rec["cpu_offload"]  # 70B bf16 state over 8 GPUs does not fit on them
    full = [r for r in result["strategies"] if r["sharding_strategy"] == "FULL_SHARD" and r["fits"]]
    assert full and min(r["step_time_s"] for r in full) > rec["step_time_s"]


@pytest.mark.parametrize("recipe,expected", [
    ("llama-3-8b-sft.yaml", None), ("mistral-7b-sft.yaml", None), ("llama-3-70b-hybrid.yaml", "HYBRID_SHARD")])
def test_shipped_recipes_plan_offline_and_print_config(tmp_path, capsys, recipe, expected):
    path = str(REPO / "recipes" / recipe)
    assert main(["train", path, "--print-config"]) == 0
    assert "model_type:" in capsys.readouterr().out
    result, text = plan(tmp_path, capsys, path)
    assert result["model"]["total_params"] > 7e9 and result["recommendation"]["fits"]
    if expected:
        assert result["recommendation"]["sharding_strategy"] == expected
        assert result["recommendation"]["mesh_shape"] == [2, 16]
        assert result["cluster"]["nodes"] == 4


NOT_CAUSAL = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 512}
MASKED = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 256}


@pytest.mark.parametrize("case", [
    ("config", NOT_CAUSAL, [], "not a causal language model"),
    ("config", MASKED, [], "not a causal language model"),
    ("config", {**LLAMA_1B, "hidden_size": 0}, [], "hidden_size must be a positive integer"),
    ("config", {**LLAMA_1B, "num_hidden_layers": -2}, [], "num_hidden_layers must be a positive integer"),
    ("config", LLAMA_1B, ["--nodes", "0"], "--nodes must be positive"),
    ("config", LLAMA_1B, ["--gpus-per-node", "-8"], "--gpus-per-node must be positive"),
    ("config", LLAMA_1B, ["--micro-batch-size", "0"], "--micro-batch-size must be positive"),
    ("config", LLAMA_1B, ["--seq-len", "abc"], "--seq-len must be an integer"),
    ("config", LLAMA_1B, ["--interconnect", "carrier-pigeon"], "unknown interconnect 'carrier-pigeon'"),
    ("config", LLAMA_1B, ["--gpu-memory", "eighty gigs"], "GPU memory 'eighty gigs' does not parse"),
    ("config", LLAMA_1B, ["--gpu-memory=-80GB"], "does not parse"),
    ("raw", "{not json", [], "not JSON"),
    ("raw", json.dumps({"hidden_size": 10}), [], "no model_type"),
    ("missing", None, [], "cannot read"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    kind, data, extra, message = case
    path = tmp_path / "config.json"
    if kind == "config":
        path.write_text(json.dumps(data))
    elif kind == "raw":
        path.write_text(data)
    code = main(["plan", "--hf-config", str(path), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_wandb_profile_table_offline(tmp_path):
    from shardlight.planner.sweep_report import log_wandb_table

    result = {"recipe": "t", "measured_best": "FULL_SHARD", "plan_prediction": "FULL_SHARD",
              "runs": {"FULL_SHARD": {"world_size": 2, "measured": {"tokens_per_sec_per_device": 10.0},
                                      "predicted": {"params_bytes": 1e6}}}}
    assert log_wandb_table(result, tmp_path, "offline") == "profile/strategies"
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_profile_two_ranks_shard_bytes_match_plan(profile_sweep):
    """A real sweep on 2 gloo ranks: baseline, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD (each its own process)."""
    out, result = profile_sweep
    assert "measured best:" in result.stdout and "plan predicted:" in result.stdout
    report = json.loads((out / "profile.json").read_text())
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
        run = report["runs"][strategy]
        assert run["returncode"] == 0, run.get("error")
        for key in ("params", "grads", "optim"):
            measured, predicted = run["measured"][f"{key}_bytes"], run["predicted"][f"{key}_bytes"]
            assert measured > 0
            assert predicted == pytest.approx(measured, rel=0.01), (strategy, key, predicted, measured)
        assert run["measured"]["tokens_per_sec_per_device"] > 0
        assert run["measured"]["scaling_efficiency"] > 0
        assert run["measured"]["compute_ms"] > 0 and run["measured"]["comm_total_ms"] > 0
    full, replicated = report["runs"]["FULL_SHARD"]["measured"], report["runs"]["NO_SHARD"]["measured"]
    assert full["params_bytes"] == pytest.approx(replicated["params_bytes"] / 2, rel=0.01)
    baseline = json.loads((out / "baseline.json").read_text())
    assert baseline["tokens_per_sec_per_device"] > 0
    text = (out / "profile_report.md").read_text()
    assert "measured best" in text and "plan's prediction" in text
    for image in ("comm.png", "memory.png", "step_time.png"):
        assert (out / image).stat().st_size > 1000 and f"({image})" in text
    # One frame, three views: the printed best is the table's fastest row, and the plots draw the same step times.
    steps = {s: report["runs"][s]["measured"]["step_ms"] for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")}
    best = min(steps, key=steps.get)
    assert report["measured_best"] == best and f"measured best: {best} ({steps[best]:.1f} ms per step" in result.stdout
    for strategy, step in steps.items():
        m = report["runs"][strategy]["measured"]
        assert m["compute_ms"] + m["exposed_transfer_ms"] + m["other_ms"] == pytest.approx(step)
        assert f"| {strategy} | 2 | {step:.4g} |" in text
    assert report["plan_prediction"] in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")


def test_default_recipe_restricted_to_checkpointing_and_no_wrap(tmp_path, capsys):
    result, text = plan(tmp_path, capsys, "--activation-checkpointing", "on", "--cpu-offload", "off")
    assert result["strategies"] and all(r["activation_checkpointing"] and not r["cpu_offload"]
                                        for r in result["strategies"])
    assert result["recommendation"]["activation_checkpointing"] is True
    assert result["cluster"]["gpus_per_node"] == 2  # the recipe's trainer.devices
    wrapped, _ = plan(tmp_path, capsys, "fsdp.auto_wrap_policy=NO_WRAP")
    full = next(r for r in wrapped["strategies"] if r["sharding_strategy"] == "FULL_SHARD")
    assert wrapped["model"]["num_units"] == 1
    assert full["gather_buffer_bytes"] == wrapped["model"]["total_params"] * 4  # the whole model at once


def test_plan_for_from_python_without_argparse(tmp_path, capsys):
    """The library call gives what ``shardlight plan`` prints and writes."""
    path = write_config(tmp_path, MISTRAL_7B)
    cli_result, _ = plan(tmp_path, capsys, "--hf-config", path, "--gpu-memory", "24GB", "--interconnect", "pcie",
                         "--seq-len", "1024", "--cpu-offload", "off")
    cluster = cluster_for(ClusterOptions(gpu_memory="24GB", interconnect=("pcie",)))
    result = plan_for(spec_from_hf_config(path), cluster, workload_for(WorkloadOptions(seq_len=1024)),
                      restrict_offload=False)
    assert json.loads(json.dumps(result, default=str)) == cli_result
    assert result["cluster"]["gpus_per_node"] == 8 and result["workload"]["seq_len"] == 1024


@pytest.mark.parametrize("request_kwargs,message", [
    ({"steps": 3}, "--steps must be at least 6"),
    ({"strategies": ("FULL_SHARD", "ZERO9")}, "unknown strategy 'ZERO9'"),
    ({"strategies": ("HYBRID_SHARD",)}, "--strategies: nothing to run"),
    ({"timeout": 0}, "--timeout must be positive"),
])
def test_profile_request_checked_before_any_run(tmp_path, monkeypatch, request_kwargs, message):
    def no_model(_model_cfg):
        raise AssertionError("a bad request must fail before the model is built or any run starts")

    monkeypatch.setattr(shardlight.planner.sweep, "build_hf_config", no_model)
    request = ProfileRequest(out_dir=str(tmp_path / "profile"), **request_kwargs)
    with pytest.raises(ShardlightError, match=message):
        profile(request)
    assert not (tmp_path / "profile").exists()


def test_planner_imports_no_command_line_or_training_path():
    """The planner is a library: no ``shardlight.cli``/``train`` import (it may use the core's builders), no
    import hidden in a function except third-party ones (transformers, matplotlib, wandb)."""
    for path in sorted(Path(shardlight.planner.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    assert not name.startswith(("shardlight.cli", "shardlight.train")), (path, name)
                    if node not in tree.body:
                        assert not name.startswith("shardlight"), (path.name, node.lineno, name)


def test_optimizer_names_are_one_list():
    allowed = next(f for f in dataclasses.fields(OptimConfig) if f.name == "name").metadata["allowed"]
    assert tuple(allowed) == OPTIMIZERS == ("adamw", "adam", "sgd", "adamw8bit")


def test_profile_child_env_is_a_fresh_run(monkeypatch):
    for key in ("SHARDLIGHT_RUN_DIR", "SHARDLIGHT_RESUME_FROM", "SHARDLIGHT_WANDB_RUN_ID", "LOCAL_RANK", "RANK",
                "WORLD_SIZE", "NODE_RANK"):
        monkeypatch.setenv(key, "x")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("KEEP_ME", "1")
    env = child_env()
    assert not {"SHARDLIGHT_RUN_DIR", "SHARDLIGHT_RESUME_FROM", "LOCAL_RANK", "RANK", "WORLD_SIZE"} & set(env)
    assert env["KEEP_ME"] == "1" and "PYTHONPATH" not in env


TINYLLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                "num_key_value_heads": 4, "max_position_embeddings": 2048}
MIXTRAL_8X7B = {**MISTRAL_7B, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 8, "num_experts_per_tok": 2}


def test_1b_class_that_fits_one_gpu_is_ddp_not_shard_grad_op(tmp_path, capsys):
    """The issue's case: DDP's all-reduce and FSDP's reduce-scatter both leave the root unit's gradient
    collective exposed after backward, so SHARD_GRAD_OP is no longer ahead by more than the tie tolerance."""
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, TINYLLAMA_1B), "--gpus-per-node",
                        "8", "--seq-len", "1024", "--cpu-offload", "off")
    rows = result["strategies"]
    ddp = next(r for r in rows if r["sharding_strategy"] == "NO_SHARD" and not r["activation_checkpointing"])
    sgo = next(r for r in rows if r["sharding_strategy"] == "SHARD_GRAD_OP" and not r["activation_checkpointing"])
    assert ddp["fits"] and sgo["step_time_s"] > ddp["step_time_s"] / (1 + 0.03)
    assert result["recommendation"]["sharding_strategy"] == "NO_SHARD"
    assert "as fast as DDP" not in text


@pytest.mark.parametrize("args", [
    ("--seq-len", "512", "--micro-batch-size", "2"),
    ("--seq-len", "1024", "--interconnect", "pcie"),
    ("--seq-len", "2048", "--gpu-memory", "16GB"),
    ("--seq-len", "256", "--micro-batch-size", "4", "--interconnect", "nvlink"),
])
def test_every_reason_is_true_of_the_rule_that_chose(tmp_path, capsys, args):
    """Not DDP while a DDP configuration fits means the winner is more than TIE faster, and says by how much."""
    from shardlight.planner.recommend import TIE

    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, TINYLLAMA_1B), *args)
    rec, rows = result["recommendation"], result["strategies"]
    ddp = [r for r in rows if r["sharding_strategy"] == "NO_SHARD" and r["fits"]]
    if rec["sharding_strategy"] != "NO_SHARD":
        reason = next(r for r in rec["reasons"] if r.startswith(rec["sharding_strategy"]))
        if ddp:
            fastest = min(r["step_time_s"] for r in ddp)
            assert rec["step_time_s"] * (1 + TIE) < fastest
            margin = round((fastest / rec["step_time_s"] - 1) * 100)
            assert f"estimated {margin}% faster than DDP" in reason, reason
        else:
            assert "DDP does not fit" in reason, reason
    else:
        assert ddp


def test_mixture_of_experts_shards_all_experts_computes_active_ones(tmp_path, capsys):
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, MIXTRAL_8X7B), "--nodes", "2",
                        "--seq-len", "1024")
    model = result["model"]
    assert 46.5e9 < model["total_params"] < 46.9e9          # Mixtral 8x7B: every expert stored
    assert 12.7e9 < model["active_params"] < 13.0e9         # 2 of 8 experts per token
    assert model["num_experts"] == 8 and model["experts_per_token"] == 2
    dense = 6 * (model["active_params"] - model["vocab_size"] * model["hidden_size"])
    assert dense < model["flops_per_token"] < dense * 1.1  # compute follows the active experts only
    full = next(r for r in result["strategies"] if r["sharding_strategy"] == "FULL_SHARD"
                and not r["activation_checkpointing"] and not r["cpu_offload"])
    assert full["params_bytes"] == pytest.approx(model["total_params"] * 4 / 16, rel=1e-3)  # sharded: all experts


def test_wrap_granularity_advice_for_blocks_far_from_the_unit_range(tmp_path, capsys):
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, MIXTRAL_8X7B), "--nodes", "2",
                     "--seq-len", "1024", "--activation-checkpointing", "on")
    advice = [r for r in result["recommendation"]["reasons"] if r.startswith("Wrap granularity")]
    assert len(advice) == 1 and "1.45B parameters" in advice[0], advice
    assert "fsdp.min_num_params=125000000" in advice[0] and "0.2 GB per all-gather" in advice[0]
    small, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, LLAMA_1B), "--gpu-memory", "16GB")
    assert not any(r.startswith("Wrap granularity") for r in small["recommendation"]["reasons"])  # 61M blocks


def test_plan_prints_the_host_ram_of_the_load(tmp_path, capsys):
    """The 70B recipe (bf16, FSDP1, 8 GPUs a node): a sharded load reads one FSDP1 unit whole per rank, the
    root (embeddings and head, 2.1B parameters) the largest; every rank calling from_pretrained holds 141 GB."""
    result, out = plan(tmp_path, capsys, str(REPO / "recipes" / "llama-3-70b-hybrid.yaml"))
    model, load = result["model"], result["load"]
    assert model["largest_unit_params"] == model["root_params"]
    assert load["weights_bytes"] == model["total_params"] * 2
    assert load["sharded_per_node_bytes"] == 8 * model["root_params"] * 2
    assert load["whole_per_node_bytes"] == 8 * model["total_params"] * 2
    assert (f"load: 141 GB of weights; host RAM per node {8 * model['root_params'] * 2 / 1e9:.0f} GB reading each "
            "rank's shards (the default), 1129 GB (MORE THAN THE NODE HAS)") in out, out
