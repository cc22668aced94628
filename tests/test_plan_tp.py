"""``shardlight plan`` with tensor parallelism: tp candidates (dividing heads, key/value heads, the intermediate
size and a node), TP recommended where data parallelism alone cannot fit or its group exposes more
communication than TP costs, not recommended for a short-sequence small model; the TP all-reduce count per step
exact against the formula and against what torch's ColwiseParallel/RowwiseParallel issue; the fake step on a TP
mesh."""

import json
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardlight.cli.main import main
from shardlight.planner.estimate import estimate, tp_allreduces, tp_candidates
from shardlight.planner.inputs import Workload, make_cluster
from shardlight.planner.model_spec import model_spec
from shardlight.planner.recommend import TIE, per_token

MISTRAL_7B_LONG = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                   "tie_word_embeddings": False}
TINYLLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                "num_key_value_heads": 4, "max_position_embeddings": 2048}
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 128,
              "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096}


def write_config(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def plan(tmp_path, capsys, *args, analytic=True):
    out = tmp_path / "plan.json"
    code = main(["plan", *args, *(["--analytic"] if analytic else []), "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(out.read_text()), captured.out


def hf(data):
    from transformers import AutoConfig

    data = dict(data)
    return AutoConfig.for_model(data.pop("model_type"), **data)


def test_long_sequence_8b_class_where_data_parallelism_cannot_fit_recommends_tp(tmp_path, capsys):
    # 7.2B Mistral shape, 80k tokens per sequence on 8 x 80 GB: even FULL_SHARD with checkpointing needs more than
    # the usable memory (the recomputed block and its gradients are the transient); tp 2 halves that block.
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, MISTRAL_7B_LONG), "--gpus-per-node",
                        "8", "--seq-len", "81920", "--cpu-offload", "off")
    assert result["strategies"] and not any(r["fits"] for r in result["strategies"])
    rec = result["recommendation"]
    assert rec["fits"] and rec["tp_size"] > 1 and rec["activation_checkpointing"]
    chosen = next(r for r in result["tensor_parallel"] if r["sharding_strategy"] == rec["sharding_strategy"]
                  and r["tp_size"] == rec["tp_size"] and r["activation_checkpointing"])
    assert chosen["fits"]
    least = min(result["strategies"], key=lambda r: r["peak_bytes"])
    assert chosen["peak_bytes"] < least["peak_bytes"]
    # The reason is the rule's: nothing data-parallel fits, the TP row does.
    assert any(r.startswith(f"Tensor parallelism (tp {rec['tp_size']}): no data-parallel configuration fits")
               for r in rec["reasons"]), rec["reasons"]
    assert f"parallelism.tp_size={rec['tp_size']}" in text and "fsdp.fsdp_version=2" in text
    header = next(line for line in text.splitlines() if line.startswith("configuration"))
    assert header.split()[1] == "tp"
    assert "tensor parallelism: tp 2, 4, 8 costed" in text


def test_short_sequence_small_model_keeps_data_parallelism(tmp_path, capsys):
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, TINYLLAMA_1B), "--gpus-per-node",
                        "8", "--seq-len", "1024")
    rec = result["recommendation"]
    assert rec["tp_size"] == 1 and result["tensor_parallel"]
    assert result["tp"]["candidates"] == [2, 4]  # 4 key/value heads: not 8
    best_tp = min((r for r in result["tensor_parallel"] if r["fits"]), key=per_token)
    chosen = min((r for r in result["strategies"] if r["fits"]), key=per_token)
    assert per_token(best_tp) > per_token(chosen)
    assert any(r.startswith("Tensor parallelism not chosen") for r in rec["reasons"]), rec["reasons"]
    assert "parallelism.tp_size" not in text
    # Every row prints its tp (the column after the label); data-parallel rows are tp 1.
    table = text[text.index("configuration"):text.index("(GB per rank")].splitlines()[2:]
    tps = [line[len(line.split("  ")[0]):].split()[0] for line in table]
    assert len(table) == len(result["strategies"]) + len(result["tensor_parallel"])
    assert tps == ["1"] * len(result["strategies"]) + [str(r["tp_size"]) for r in result["tensor_parallel"]]


def test_large_data_parallel_group_over_ethernet_goes_tensor_parallel(tmp_path, capsys):
    # 32 data-parallel ranks over 10 GB/s Ethernet cannot hide FSDP's gathers; tp 8 inside each node cuts the
    # data-parallel group to 4 and the bytes each rank gathers to an eighth.
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, LLAMA_70B), "--nodes", "4",
                     "--gpus-per-node", "8", "--interconnect", "ethernet", "--seq-len", "4096",
                     "--micro-batch-size", "2")
    rec = result["recommendation"]
    assert rec["tp_size"] == 8
    dp_best = min((r for r in result["strategies"] if r["fits"]), key=per_token)
    chosen = next(r for r in result["tensor_parallel"] if r["tp_size"] == 8 and r["fits"]
                  and r["sharding_strategy"] == rec["sharding_strategy"]
                  and r["activation_checkpointing"] == rec["activation_checkpointing"])
    assert per_token(chosen) * (1 + TIE) < per_token(dp_best)
    margin = round((per_token(dp_best) / per_token(chosen) - 1) * 100)
    reason = next(r for r in rec["reasons"] if r.startswith("Tensor parallelism (tp 8)"))
    assert f"estimated {margin}% faster per token" in reason and "not hidden" in reason, reason


def test_tp_allreduce_bytes_are_4_x_layers_x_batch_x_seq_x_hidden_for_the_fused_layout():
    # Megatron's layout (fused q/k/v and gate/up projections, Phi-3's modules): per block one row-sharded output
    # in forward per half and one column-sharded input gradient in backward per half.
    config = hf({"model_type": "phi3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8,
                 "max_position_embeddings": 4096, "pad_token_id": 0})
    plan = {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    spec = model_spec(config, tp_plan=plan)
    cluster = make_cluster(nodes=1, gpus_per_node=8)
    for precision, dtype_bytes in (("bf16-mixed", 2), ("32-true", 4)):
        work = Workload(micro_batch_size=3, seq_len=1000, precision=precision)
        row = estimate(spec, cluster, work, "FULL_SHARD", False, False, None, tp=2).to_json()
        assert row["tp_allreduce_bytes"] == 4 * 3 * 3 * 1000 * 256 * dtype_bytes
        assert row["tp_allreduce_count"] == 4 * 3
        # Accumulation repeats them per micro-batch; checkpointing repeats the forward ones in the recompute.
        work.accumulate_grad_batches = 2
        assert estimate(spec, cluster, work, "FULL_SHARD", False, False, None, tp=2).communication.tp.bytes == \
            2 * 4 * 3 * 3 * 1000 * 256 * dtype_bytes
        assert tp_allreduces(spec, work, True).count == 2 * 6 * 3


class AllReduceCounter(TorchDispatchMode):
    """Counts the all-reduces DTensor issues (functional collectives, seen at dispatch), as CommDebugMode does
    without its module tracker. That tracker breaks on the module-level function modules transformers >= 5.25
    calls inside attention (``kernels``' ``Func``, one object shared by every model), and the forward hook it
    then leaves on that object breaks every later forward in the process."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_reduce" in str(func.overloadpacket):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_tp_allreduce_count_is_what_torch_issues_for_llama():
    """Llama's plan: o_proj, down_proj row-sharded (2 forward all-reduces per block); q, k, v, gate, up
    column-sharded, and torch's ColwiseParallel all-reduces each one's input gradient (5 in backward), so the
    planner's count is 7 per block and micro-batch, as a fake 2-rank group running shardlight's TP counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from shardlight.strategy.tensor_parallel import ParallelDims, apply_tensor_parallel

    config = hf(TINY_LLAMA)
    spec = model_spec(config)
    work = Workload(micro_batch_size=2, seq_len=16, precision="32-true")
    expected = tp_allreduces(spec, work, False)
    assert (expected.forward, expected.backward) == (2, 5)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        apply_tensor_parallel(model, ParallelDims(1, 1, 2), init_device_mesh("cpu", (2,)))
        with AllReduceCounter() as forward:
            logits = model(input_ids=torch.randint(0, 4096, (2, 16))).logits
        with AllReduceCounter() as backward:
            logits.float().sum().backward()
    finally:
        dist.destroy_process_group()

    assert forward.count == expected.forward * spec.num_layers
    assert backward.count == expected.backward * spec.num_layers
    assert expected.count == 7 * spec.num_layers
    assert expected.bytes == expected.count * 2 * 16 * 128 * 4


def test_tp_that_does_not_divide_heads_is_not_a_candidate(tmp_path, capsys):
    cluster = make_cluster(nodes=1, gpus_per_node=8)
    work = Workload()
    # 6 heads over 2 key/value heads: only tp 2 divides both (and 344); 4 and 8 do not divide the heads.
    spec = model_spec(hf({**TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 192}))
    assert tp_candidates(spec, cluster, work) == [2]
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, {
        **TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 192}), "--gpus-per-node", "8")
    assert {r["tp_size"] for r in result["tensor_parallel"]} == {2}
    assert " tp4" not in text and " tp8" not in text
    # 3 key/value heads: no tp divides them; GPT-2 has no TP plan. Both say why in the output.
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, {
        **TINY_LLAMA, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 192}), "--gpus-per-node", "8")
    assert result["tensor_parallel"] == [] and "3 key/value heads" in result["tp"]["skipped"]
    assert "tensor parallelism: not costed (no tp size in 2..8 divides" in text
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, {
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1024}), "--gpus-per-node", "8",
        "--seq-len", "512")
    assert result["tensor_parallel"] == [] and "base_model_tp_plan" in text


def test_fake_step_on_a_tp_mesh_holds_the_tp_shards():
    from shardlight.planner.fake_step import step_memory

    spec = model_spec(hf(TINY_LLAMA))
    # tp 2 on 2 ranks: one data-parallel rank, so FSDP keeps whole (TP-local) parameters: exact bytes.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = step_memory(hf(TINY_LLAMA), 2, "FULL_SHARD", False, "32-true", 2, 64, tp=2)
    # transformers >= 5.25's nested function modules set ModTracker's hierarchy warning off; the plan says nothing.
    assert not [w for w in caught if "hierarchy" in str(w.message)]
    assert step["peak_by_category"]["params"] == spec.tp_local_params(2)[2] * 4
    no_tp = step_memory(hf(TINY_LLAMA), 2, "FULL_SHARD", False, "32-true", 2, 64)
    assert step["activations"] < no_tp["activations"]


def test_plan_measures_the_tp_row_it_would_pick(tmp_path, capsys):
    # Long sequences on small GPUs, checkpointing off: no data-parallel row fits, tp 2 does; the row the rule
    # picks is measured by a fake step on the (dp_shard, tp) mesh, the other TP rows stay analytic.
    small = {**TINY_LLAMA, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 8}
    result, text = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, small), "--gpus-per-node", "2",
                        "--seq-len", "2048", "--micro-batch-size", "2", "--gpu-memory", "0.3GB", "--overhead-gb",
                        "0.01", "--activation-checkpointing", "off", "--cpu-offload", "off", analytic=False)
    rec = result["recommendation"]
    assert not any(r["fits"] for r in result["strategies"])
    assert rec["tp_size"] == 2 and rec["fits"]
    measured = [r for r in result["tensor_parallel"] if r["memory_source"] == "fake-step"]
    assert [r["sharding_strategy"] for r in measured] == [rec["sharding_strategy"]]
    assert result["tp"]["measured"] == [rec["label"]]
    row = measured[0]
    # The analytic TP model against the fake step on this case: within 5%.
    assert abs(row["analytic_peak_bytes"] - row["peak_bytes"]) / row["peak_bytes"] < 0.05
    assert "fake step with a TP mesh" in text


@pytest.mark.parametrize("restrict", [("--activation-checkpointing", "on"), ("--cpu-offload", "on")])
def test_restrictions_apply_to_tp_rows(tmp_path, capsys, restrict):
    result, _ = plan(tmp_path, capsys, "--hf-config", write_config(tmp_path, TINYLLAMA_1B), "--gpus-per-node",
                     "8", "--seq-len", "1024", *restrict)
    if restrict[0] == "--cpu-offload":
        assert result["tensor_parallel"] == []  # CPU offload with TP is not costed
    else:
        assert result["tensor_parallel"] and all(r["activation_checkpointing"] for r in result["tensor_parallel"])
