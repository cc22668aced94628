"""Tensor parallelism under FSDP2 on real gloo ranks: tp 2 on 2 ranks, dp_shard 2 x tp 2 and dp_replicate 2 x
tp 2 on 4 ranks against a single-process reference on the same global batch (the data-parallel size is world /
tp), accumulation without reduce-scatters on non-final micro-batches, global-norm clipping, activation
checkpointing, bf16-mixed; sharded (DCP) checkpoints of DTensor shards: exact resume, resharding tp 2 -> no TP
and -> tp 4, export, inspect, ``full_params`` on 2-D shards; TP vs FSDP comm keys by process group and the
verdict's TP action; and the bad-input refusals of the ``parallelism:`` section, one line before any rank
starts."""

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import DEFAULT_RECIPE, REPO, forbid_training, free_port, gloo_fits, run_cli, save_tiny_llama
from strategy_runs import (
    CALLBACKS_OFF,
    MICRO_BATCH,
    SEQ_LEN,
    STEPS,
    TOKENIZER,
    TRAIN_DATA,
    assert_weights_close,
    final_weights,
    reference_weights,
)

from shardlight.cli.main import main

LAYERS = 2


@pytest.fixture(scope="module")
def tp_setup(tmp_path_factory):
    """The strategy tests' tiny Llama (4 heads, 4 key/value heads, MLP width 64: tp 2 divides them all) and
    a recipe with FSDP2 and a small clipping threshold, so that clipping acts on every step."""
    root = tmp_path_factory.mktemp("tp")
    save_tiny_llama(root / "init")
    recipe = root / "tiny.yaml"
    recipe.write_text(textwrap.dedent(f"""
        output_dir: {root / 'runs'}
        model: {{name_or_path: {root / 'init'}}}
        tokenizer: {{name_or_path: {TOKENIZER}}}
        data: {{train_files: [{TRAIN_DATA}], val_fraction: 0.0, seq_len: {SEQ_LEN}}}
        optim: {{lr: 1.0e-3, warmup_steps: 1, weight_decay: 0.1}}
        trainer: {{max_steps: {STEPS}, micro_batch_size: {MICRO_BATCH}, accelerator: cpu, devices: 2,
                   limit_val_batches: 0, progress_bar: false, log_every_n_steps: 1, num_threads: 1,
                   gradient_clip_val: 0.05}}
        logging: {{wandb: {{enabled: false}}}}
        fsdp: {{fsdp_version: 2, transformer_cls_names_to_wrap: [LlamaDecoderLayer]}}
        parallelism: {{tp_size: 2}}
    """))
    return recipe


def _wrap_line(output):
    return next(line for line in output.splitlines() if line.startswith("FSDP "))


def _runs(runs, tp_setup):
    """{name: overrides} → whole runs (``shardlight.train.train``), counted, their console kept."""
    return {name: {"train": True, "counters": True, "capture": True,
                   "overrides": [*CALLBACKS_OFF, *overrides, f"name={name.replace(' ', '-')}"]}
            for name, overrides in runs.items()}


def _step4(tp_setup):
    """The 6-step run's step-4 checkpoint (every resume below starts there)."""
    return tp_setup.parent / "runs" / "checkpointed" / "checkpoints" / "step-4"


@pytest.fixture(scope="module")
def two_ranks(tp_setup, tmp_path_factory):
    """Every 2-rank run in one process pair (``conftest.gloo_fits``): tp 2 with activation checkpointing,
    bf16-mixed, 6 steps checkpointed every 2, and the same resumed from its step 4."""
    runs = {"act ckpt": ["fsdp.activation_checkpointing=true"],
            "bf16": ["trainer.precision=bf16-mixed", "trainer.max_steps=2"],
            "checkpointed": ["trainer.max_steps=6", "checkpoint.every_n_steps=2"],
            "resumed": ["trainer.max_steps=6", f"resume={_step4(tp_setup)}"]}
    return gloo_fits(tp_setup, 2, _runs(runs, tp_setup), tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def four_ranks(tp_setup, two_ranks, tmp_path_factory):
    """Every 4-rank run in one process tree: dp 2 x tp 2 accumulating, HSDP replicas x tp 2, and the 2-rank
    checkpoint resumed on tp 4."""
    runs = {"dp2 x tp2": [f"trainer.accumulate_grad_batches={2}"],
            "hsdp x tp2": ["parallelism.dp_replicate_size=2"],
            "resumed tp4": ["trainer.max_steps=6", f"resume={_step4(tp_setup)}", "parallelism.tp_size=4"]}
    return gloo_fits(tp_setup, 4, _runs(runs, tp_setup), tmp_path_factory.mktemp("four_ranks"))


@pytest.fixture(scope="module")
def one_rank(tp_setup, two_ranks, tmp_path_factory):
    """The 2-rank checkpoint resumed in one process without TP."""
    runs = {"resumed alone": ["trainer.max_steps=6", f"resume={_step4(tp_setup)}", "parallelism.tp_size=1"]}
    return gloo_fits(tp_setup, 1, _runs(runs, tp_setup), tmp_path_factory.mktemp("one_rank"))


@pytest.mark.slow
def test_tp2_on_two_ranks_matches_single_process_with_checkpointing(tp_setup, two_ranks):
    # Both ranks are one TP group: one data-parallel rank, so the reference is one process on one batch.
    run = two_ranks["act ckpt"]
    summary, counts = run["summary"], run["counts"]
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    assert "mesh dp_replicate 1 x dp_shard 1 x tp 2" in _wrap_line(run["output"])
    assert_weights_close(final_weights(summary), reference_weights(tp_setup, 1))
    # One data-parallel rank: the two TP ranks share each packed batch, so its tokens count once (its blocks
    # are more than half real tokens, so counting them twice would pass the whole blocks' size).
    with open(Path(summary["run_dir"]) / "csv" / "metrics.csv") as fh:
        seen = [float(r["train/tokens_seen"]) for r in csv.DictReader(fh) if r.get("train/tokens_seen")]
    assert STEPS * MICRO_BATCH * SEQ_LEN / 2 < seen[-1] <= STEPS * MICRO_BATCH * SEQ_LEN, seen
    # Checkpointed blocks run forward twice per step (plus one forward per rank: the export check's logits).
    assert [c["block_forward"] for c in counts] == [LAYERS * (2 * STEPS + 1)] * 2, counts


@pytest.mark.slow
def test_dp2_x_tp2_on_four_ranks_accumulates_without_reduce_scatter_and_matches(tp_setup, four_ranks):
    accumulate = 2
    run = four_ranks["dp2 x tp2"]
    summary, counts = run["summary"], run["counts"]
    assert summary["steps"] == STEPS and summary["world_size"] == 4
    line = _wrap_line(run["output"])
    assert "mesh dp_replicate 1 x dp_shard 2 x tp 2" in line
    # Per rank: the decoder projections (2 x 10,240) quartered by TP and FSDP, the rest (embeddings, head,
    # norms: 32,800 + 2 x 64) halved by FSDP alone.
    per_rank = (32_800 + 2 * 64) // 2 + 2 * 10_240 // 4
    assert f"params per rank min/max {per_rank:,}/{per_rank:,}" in line
    wrap = json.loads((Path(summary["run_dir"]) / "wrap_report.json").read_text())
    assert wrap["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2} and wrap["params_per_rank"] == [per_rank] * 4
    # Two data-parallel ranks (TP ranks share a batch): the reference is two ranks' batches, not four.
    assert_weights_close(final_weights(summary), reference_weights(tp_setup, 2, accumulate=accumulate))
    units = LAYERS + 1
    # One gradient reduce-scatter per unit per optimizer step, none on the non-final micro-batch.
    assert all(c["reduce_scatter"] == units * STEPS for c in counts), counts


@pytest.mark.slow
def test_hsdp_replicas_x_tp2_on_four_ranks_matches(tp_setup, four_ranks):
    run = four_ranks["hsdp x tp2"]
    assert "mesh dp_replicate 2 x dp_shard 1 x tp 2" in _wrap_line(run["output"])
    assert_weights_close(final_weights(run["summary"]), reference_weights(tp_setup, 2))


@pytest.mark.slow
def test_tp2_bf16_mixed_trains(two_ranks):
    run = two_ranks["bf16"]
    assert run["summary"]["steps"] == 2
    assert "device_type of 'cuda'" not in run["output"]


def _losses(run_dir):
    """Per-step train/loss from metrics.csv, keyed by optimizer step (1-based)."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as fh:
        return {int(r["step"]) + 1: float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")}


@pytest.mark.slow
def test_tp_checkpoint_exact_resume_reshard_to_no_tp_and_tp4_export_and_inspect(tp_setup, two_ranks, four_ranks,
                                                                                 one_rank, tmp_path):
    full = two_ranks["checkpointed"]["summary"]
    reference, step4 = _losses(full["run_dir"]), _step4(tp_setup)
    assert Path(full["run_dir"]) == step4.parents[1]
    meta = json.loads((step4 / "shardlight.json").read_text())
    assert meta["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    # One process without TP, and tp 4 on 4 ranks, read the same batches (one data-parallel rank every time):
    # the same losses.
    assert f"resumed from {step4} at step 4" in one_rank["resumed alone"]["output"]
    resumed = [two_ranks["resumed"], one_rank["resumed alone"], four_ranks["resumed tp4"]]
    for run in resumed:
        got = _losses(run["summary"]["run_dir"])
        assert sorted(got) == [5, 6] and all(abs(got[s] - reference[s]) <= 1e-6 for s in (5, 6)), (got, reference)
    assert_weights_close(final_weights(one_rank["resumed alone"]["summary"]), final_weights(full))

    assert main(["export", str(step4.parent / "step-6"), "--out", str(tmp_path / "hf")]) == 0
    assert_weights_close(final_weights({"model_dir": str(tmp_path / "hf")}), final_weights(full), atol=0)
    listing = run_cli(["inspect", str(step4)])
    assert listing.returncode == 0, listing.stderr
    assert "2 rank(s) wrote shards; mesh dp_replicate 1 x dp_shard 1 x tp 2" in listing.stdout
    q = next(line for line in listing.stdout.splitlines() if line.startswith("model.layers.0.self_attn.q_proj"))
    assert "r0:0:16,0:32  r1:16:32,0:32" in q  # column-parallel: each TP rank holds half the output rows


@pytest.mark.slow
def test_full_params_on_fsdp_x_tp_shards(tmp_path):
    out = tmp_path / "seen.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), FP_PORT=str(29500 + os.getpid() % 400 + 1))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "tp_full_params_worker.py"), str(out)],
                            env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert seen["q_mesh"] == ["dp_shard", "tp"] and seen["q_local_shape"] == [8, 32]  # 32 rows / tp 2 / dp 2
    # Per rank: the non-TP weights (embeddings, head, norms: 32,800 + 2 x 64) halved by FSDP, the decoder
    # projections (2 x 10,240) quartered.
    assert seen["params_this_rank"] == (32_800 + 2 * 64) // 2 + 2 * 10_240 // 4
    assert seen["all_equal_to_init"] and seen["discarded"] and seen["written_back"], seen


NO_PLAN_MODEL = ("model.config={model_type: opt, vocab_size: 512, hidden_size: 32, ffn_dim: 64, "
                 "num_hidden_layers: 2, num_attention_heads: 4, max_position_embeddings: 512, "
                 "word_embed_proj_dim: 32, bos_token_id: 0, eos_token_id: 1, pad_token_id: 2}")
V2 = "fsdp.fsdp_version=2"
BAD_TP = [
    ("heads", [V2, "trainer.devices=3", "parallelism.tp_size=3"],
     "parallelism.tp_size 3 does not divide the model's num_attention_heads (4)"),
    ("kv_heads", [V2, "trainer.devices=4", "parallelism.tp_size=4", "model.config.num_key_value_heads=2"],
     "parallelism.tp_size 4 does not divide the model's num_key_value_heads (2)"),
    ("intermediate", [V2, "parallelism.tp_size=2", "model.config.intermediate_size=257"],
     "does not divide the model's intermediate_size (257)"),
    ("world_vs_tp", [V2, "trainer.devices=3", "parallelism.tp_size=2"],
     "world size 3 (trainer.num_nodes 1 x trainer.devices 3) is not divisible by parallelism.tp_size 2"),
    ("mesh_vs_world", [V2, "trainer.devices=4", "parallelism.tp_size=2", "parallelism.dp_shard_size=3"],
     "dp_replicate 1 x dp_shard 3 x tp 2 = 6 does not match the world size 4"),
    ("replicate_vs_world", [V2, "trainer.devices=4", "parallelism.tp_size=2", "parallelism.dp_replicate_size=3"],
     "world size 4 is not divisible by dp_replicate_size 3 x tp_size 2"),
    ("cross_node", [V2, "trainer.num_nodes=2", "parallelism.tp_size=4"],
     "parallelism.tp_size 4 is larger than the 2 devices per node"),
    ("fsdp1", ["parallelism.tp_size=2"], "parallelism.tp_size 2 needs fsdp.fsdp_version: 2"),
    ("cp_size", [V2, "parallelism.cp_size=2"], "context parallelism is not supported yet"),
    ("dp_sizes_without_tp", [V2, "parallelism.dp_shard_size=2"], "apply with tp_size > 1"),
    ("no_model_plan", [V2, "parallelism.tp_size=2", NO_PLAN_MODEL],
     "OPTForCausalLM has no base_model_tp_plan; give one as parallelism.tp_plan"),
]


@pytest.mark.parametrize("overrides,expected", [c[1:] for c in BAD_TP], ids=[c[0] for c in BAD_TP])
def test_bad_tp_input_is_one_line_before_spawn(tmp_path, capsys, monkeypatch, overrides, expected):
    forbid_training(monkeypatch)
    code = main(["train", f"output_dir={tmp_path / 'out'}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert expected in err
    assert not (tmp_path / "out").exists()


PLAN_CASES = [
    ("missing_module", {"model.layers.*.self_attn.query": "colwise"},
     "parallelism.tp_plan: model.layers.*.self_attn.query matches no module of the model; candidates: "
     "lm_head, model.layers.*.mlp.down_proj"),
    # '*' stands for one name, as parallelize_module matches: a glob spanning dots would silently match nothing.
    ("glob_across_dots", {"*.q_proj": "colwise"}, "*.q_proj matches no module"),
    ("unknown_style", {"model.layers.*.self_attn.q_proj": "diagonal"},
     "parallelism.tp_plan.model.layers.*.self_attn.q_proj: 'diagonal' is not allowed; allowed values: colwise"),
]


@pytest.mark.parametrize("plan,expected", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_bad_recipe_tp_plan(tmp_path, capsys, monkeypatch, plan, expected):
    forbid_training(monkeypatch)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {DEFAULT_RECIPE}\nfsdp: {{fsdp_version: 2}}\n"
                      f"parallelism: {{tp_size: 2, tp_plan: {json.dumps(plan)}}}\n")
    code = main(["train", str(recipe), f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert expected in err
    assert not (tmp_path / "out").exists()


def _nccl_rank0_trace():
    """Rank 0 of 4 on a dp_shard 2 x tp 2 mesh, one step [0, 1000): compute [50, 130], a TP all-reduce
    [100, 300] (group [0, 1]), an FSDP all-gather [500, 600] (group [0, 2]), a whole-world all-reduce
    [700, 750] (the loss: neither)."""
    from test_trace_split import _cpu, _kernel, _launch

    events = [_cpu("ProfilerStep#1", 0, 1000), _launch(45, 1), _kernel("gemm_kernel", 50, 80, 1)]
    comms = (("allreduce", "AllReduce", 100, 300, "1", [0, 1]), ("_allgather_base", "AllGather", 500, 600, "2", [0, 2]),
             ("allreduce", "AllReduce", 700, 750, "0", [0, 1, 2, 3]))
    for correlation, (collective, token, start, end, group, ranks) in enumerate(comms, start=2):
        args = {"Collective name": collective, "In msg nelems": 1000, "Out msg nelems": 1000 * len(ranks),
                "Group size": len(ranks), "dtype": "Float", "Process Group Name": group,
                "Process Group Ranks": str(ranks), "Seq": correlation}
        events += [_launch(start - 5, correlation),
                   _kernel(f"ncclDevKernel_{token}_RING_LL(x)", start, end - start, correlation, stream=20, **args)]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 4},
            "traceEvents": events}


def test_comm_keys_separate_tp_from_fsdp_by_process_group(tmp_path):
    from shardlight.callbacks._comm_metrics import window_metrics
    from shardlight.trace import analyze_trace_file

    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps(_nccl_rank0_trace()))
    result = analyze_trace_file(path, include_last_step=True)
    assert {g["ranks"] and tuple(g["ranks"]) for g in result["by_group"].values()} == {(0, 1), (0, 2), (0, 1, 2, 3)}
    metrics = window_metrics(result, {}, tp_size=2)
    split = {k: round(v, 6) for k, v in metrics.items() if k.startswith(("comm/tp/", "comm/fsdp/"))}
    # TP all-reduce 200 us, 30 of them under compute; the FSDP all-gather 100 us, none hidden; the world
    # all-reduce counts in comm/all_reduce_ms only.
    assert split == {"comm/tp/all_reduce_ms": 0.2, "comm/tp/exposed_ms": 0.17, "comm/fsdp/all_gather_ms": 0.1,
                     "comm/fsdp/exposed_ms": 0.1}, split
    assert round(metrics["comm/all_reduce_ms"], 6) == 0.25
    assert not any(k.startswith("comm/tp/") for k in window_metrics(result, {}, tp_size=None))


def test_verdict_names_exposed_tp_communication():
    from test_diagnosis import analysis, rank

    from shardlight.diagnosis import diagnose

    def with_groups(entry, tp_exposed_ms):
        # 2 steps: the TP group [0, 1] holds tp_exposed_ms per step of the exposed communication, [0, 2] the rest.
        entry["world_size"] = 4
        entry["by_group"] = {
            "1": {"ranks": [0, 1], "by_collective": {"all_reduce": {"exposed_comm_us": tp_exposed_ms * 2000}}},
            "2": {"ranks": [0, 2], "by_collective": {"all_gather": {"exposed_comm_us": 5_000.0}}}}
        return entry

    comm_bound = dict(compute=40, transfer=31, wait=4)
    wrap = {"units": 3, "mesh": {"dp_replicate": 1, "dp_shard": 2, "tp": 2}}
    result = diagnose(analysis(with_groups(rank(**comm_bound), 20.0), with_groups(rank(**comm_bound), 24.0)), wrap=wrap)
    assert result.verdict == "communication-bound" and result.evidence["tp_exposed_ms"] == pytest.approx(22.0)
    tp_action = next(a for a in result.actions if a.text.startswith("tensor-parallel communication"))
    assert tp_action.text == ("tensor-parallel communication is 22.0 ms exposed per step (22% of the step): lower "
                              "parallelism.tp_size (now 2) and shard more with FSDP instead, and keep TP inside a "
                              "node (tp_size <= trainer.devices)")
    assert tp_action.score == pytest.approx(22.0)
    # Without a TP mesh, or with traces that name no groups, the action is not offered.
    plain = diagnose(analysis(with_groups(rank(**comm_bound), 20.0)), wrap={"units": 3})
    assert "tp_exposed_ms" not in plain.evidence
    assert not any(a.text.startswith("tensor-parallel") for a in plain.actions)
    assert not any(a.text.startswith("tensor-parallel")
                   for a in diagnose(analysis(rank(**comm_bound)), wrap=wrap).actions)


@pytest.mark.slow
def test_gloo_comm_is_split_into_tp_and_fsdp_by_the_flight_recorders_groups(tmp_path):
    """A gloo trace names no process group; the collectives the flight recorder saw the window issue do. On a
    dp_shard 2 x tp 2 mesh (tests/workers/tp_groups_worker.py) the split recovers the known truth per rank: per
    step one all-gather and one reduce-scatter in its FSDP shard group, one all-reduce in its TP group, from the
    trace file with its collectives beside it and live from the profiler alike; without them, none."""
    from shardlight.callbacks._comm_metrics import window_metrics
    from shardlight.trace import analyze_trace_file
    from shardlight.trace.records import issued_path

    port = free_port()
    worker = REPO / "tests" / "workers" / "tp_groups_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(tmp_path), str(port)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, KINETO_LOG_LEVEL="6", PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    steps = 3
    for rank in range(4):
        trace = tmp_path / f"rank{rank}.pt.trace.json"
        result = analyze_trace_file(trace)
        groups = {tuple(g["ranks"]): {k: c["count"] for k, c in g["by_collective"].items()}
                  for g in result["by_group"].values()}
        shard, tp = tuple(sorted({rank, rank ^ 2})), tuple(sorted({rank, rank ^ 1}))
        assert groups == {shard: {"all_gather": steps, "reduce_scatter": steps}, tp: {"all_reduce": steps}}, groups
        live = json.loads((tmp_path / f"rank{rank}.live.json").read_text())
        assert live == json.loads(json.dumps(result["by_group"])), rank  # the live path, the same split
        metrics = window_metrics(result, {}, tp_size=2)
        assert {k for k in metrics if k.startswith(("comm/tp/", "comm/fsdp/"))} == {
            "comm/tp/all_reduce_ms", "comm/tp/exposed_ms", "comm/fsdp/all_gather_ms", "comm/fsdp/reduce_scatter_ms",
            "comm/fsdp/exposed_ms"}
        assert metrics["comm/tp/all_reduce_ms"] > 0 and metrics["comm/fsdp/all_gather_ms"] > 0
    issued_path(tmp_path / "rank0.pt.trace.json").unlink()  # a trace alone: every collective in the default group
    alone = analyze_trace_file(tmp_path / "rank0.pt.trace.json")
    assert not any(k.startswith("comm/tp/") for k in window_metrics(alone, {}, tp_size=2))


def test_the_recorders_collectives_are_matched_to_the_traces_calls_from_the_last():
    """The recorder may hold collectives from before the trace began and ones no call in the trace shows (a
    barrier): passed over. A call that finds none gives every call the default group."""
    from shardlight.trace.records import TraceRecord
    from shardlight.trace.sources.gloo import call_groups

    def entry(op, group, ranks):
        return {"op": f"gloo:{op}", "group": group, "desc": "", "ranks": ranks}

    record = TraceRecord(path="x", rank=0, issued=[
        entry("all_gather", "1", [0, 2]),  # the warm-up step, before the trace
        entry("all_gather", "1", [0, 2]), entry("barrier", "0", [0, 1, 2, 3]), entry("all_reduce", "3", [0, 1]),
        entry("all_reduce", "1", [0, 2])])  # gloo runs a reduce-scatter as an all-reduce
    calls = [(1.0, "all_gather"), (2.0, "all_reduce"), (3.0, "reduce_scatter")]
    default = ("0", (0, 1, 2, 3), 4)
    assert call_groups(record, calls, default) == [("1", (0, 2), 2), ("3", (0, 1), 2), ("1", (0, 2), 2)]
    assert call_groups(record, [(0.0, "broadcast"), *calls], default) == [default] * 4
    assert call_groups(TraceRecord(path="x", rank=0), calls, default) == [default] * 3
