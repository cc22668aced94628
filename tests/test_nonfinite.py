"""Non-finite loss or gradient norm (`trainer.on_nonfinite`): two real 2-rank runs of the default recipe with
lr=1e9 (the first update is finite, the weights it makes overflow the next forward), `stop` and `skip`, and
the export guard against non-finite weights, in-process."""

import csv
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import LlamaConfig, LlamaForCausalLM

from shardlight.checkpoint.safetensors_folder import refuse_nonfinite
from shardlight.checkpoint.store import FORMAT, HF_DIR, META, MODEL_KEY, describe_file
from shardlight.cli.main import main
from shardlight.errors import ShardlightError

# lr=1e9 with no warmup: step 1 is finite and sends the weights to ~1e9; the forward of step 2 overflows.
DIVERGE = ["optim.lr=1e9", "optim.warmup_steps=0", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=2",
           "trainer.progress_bar=false", "trainer.num_threads=1", "checkpoint.every_n_steps=1",
           "checkpoint.keep_last=null", "callbacks.comm.enabled=false", "callbacks.memory.enabled=false",
           "callbacks.throughput.enabled=false", "logging.wandb.enabled=false"]
STOP_LINE = re.compile(r"^error: non-finite (loss|gradient norm) \((nan|inf|-inf)\) at step (\d+) on (.+?); "
                       r"stopped every rank before that update \(trainer.on_nonfinite=stop\), nothing exported; "
                       r"last good checkpoint: (.+)$")
SKIP_LINE = re.compile(r"^shardlight: non-finite (?:loss|gradient norm) \(\S+\) at step (\d+) on .+; "
                       r"optimizer step skipped \((\d+) so far\)$")


def read_metrics(run_dir: Path):
    with open(run_dir / "csv" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def train(tmp_path, *overrides):
    summary = tmp_path / "summary.json"
    result = run_cli(["train", f"output_dir={tmp_path / 'runs'}", "--summary-json", str(summary), *DIVERGE,
                      *overrides])
    return result, (json.loads(summary.read_text()) if summary.is_file() else None)


def checkpoint_tensors(checkpoint: Path, tmp_path: Path):
    """Every tensor of a DCP checkpoint (model and optimizer state), by flattened key."""
    out = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(out))

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            elif torch.is_tensor(value):
                yield f"{prefix}{key}", value

    return dict(flat(torch.load(out, weights_only=True)))


@pytest.mark.slow
def test_stop_is_the_default_one_line_exit_1_nothing_exported(tmp_path):
    # Clipping on (the recipe's 1.0): the global norm from clipping is the signal, no extra collective.
    result, summary = train(tmp_path, "trainer.max_steps=6", "export.checkpoint=true")
    assert result.returncode == 1, result.stderr[-4000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-4000:]
    match = STOP_LINE.match(errors[0])
    assert match, errors[0]
    what, step, where, named = match.group(1), int(match.group(3)), match.group(4), Path(match.group(5))
    # The overflow is in the (shared) weights, so the loss is NaN on both ranks and both are named.
    assert (what, where) == ("loss", "ranks 0, 1") and step >= 2, errors[0]

    run_dir = Path(summary["run_dir"])
    assert named == run_dir / "checkpoints" / f"step-{step - 1}"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [f"step-{s}" for s in range(1, step)]
    saved = checkpoint_tensors(named, tmp_path)
    assert saved and all(torch.isfinite(t).all() for t in saved.values())
    assert summary["stopped"] == errors[0][len("error: "):]
    assert summary["steps"] == step - 1 and summary["model_dir"] is None and summary["checkpoint"] == str(named)
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    for never in ("model", "export", "export_check.safetensors"):
        assert not (run_dir / never).exists(), never
    # No final validation: the only val/loss is the one before the first step.
    assert [r["step"] for r in read_metrics(run_dir) if r.get("val/loss")] == ["0"]


@pytest.mark.slow
def test_skip_leaves_weights_and_optimizer_state_untouched_and_trains_on(tmp_path):
    # Clipping off: the global norm is computed anyway (max_norm=inf), so the ranks still agree.
    result, summary = train(tmp_path, "trainer.max_steps=4", "trainer.on_nonfinite=skip",
                            "trainer.gradient_clip_val=null")
    assert result.returncode == 0, result.stderr[-4000:]
    assert not [line for line in result.stderr.splitlines() if line.startswith("error:")]
    skipped = [(int(m.group(1)), int(m.group(2))) for m in map(SKIP_LINE.match, result.stderr.splitlines()) if m]
    assert skipped and [count for _, count in skipped] == list(range(1, len(skipped) + 1)), result.stderr[-4000:]
    steps = [step for step, _ in skipped]
    assert summary["steps"] == 4 and summary["nonfinite_skips"] == len(steps)

    run_dir = Path(summary["run_dir"])
    logged = [float(r["train/nonfinite_skips"]) for r in read_metrics(run_dir) if r.get("train/nonfinite_skips")]
    assert logged[-1] == len(steps) > 0

    # From the step before the first skip to the end of that run of skips nothing moved: not a weight, not
    # an Adam moment or step count (with weight decay on: a step with gradients would have moved them).
    last = steps[0]
    while last + 1 in steps:
        last += 1
    checkpoints = run_dir / "checkpoints"
    before = checkpoint_tensors(checkpoints / f"step-{steps[0] - 1}", tmp_path)
    after = checkpoint_tensors(checkpoints / f"step-{last}", tmp_path)
    assert any(".exp_avg_sq" in key for key in before) and before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)

    weights = load_file(str(Path(summary["model_dir"]) / "model.safetensors"))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def test_export_refuses_nonfinite_weights_naming_the_first():
    model = tiny_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.0.mlp.up_proj.weight"][3, 1] = float("inf")
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(ShardlightError, match=r"non-finite weights: model\.layers\.0\.mlp\.up_proj\.weight has 1 "):
        refuse_nonfinite(state, across_ranks=False)


def test_export_cli_on_a_nonfinite_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    """A checkpoint in shardlight's format (DCP shards, hf/ config, shardlight.json) with one NaN weight."""
    model = tiny_model()
    weights = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    weights["model.lm_head.weight"][0, 0] = float("nan")
    checkpoint = tmp_path / "checkpoints" / "step-1"
    dcp.save({MODEL_KEY: weights}, checkpoint_id=str(checkpoint), no_dist=True)
    model.config.save_pretrained(str(checkpoint / HF_DIR))
    files = {str(p.relative_to(checkpoint)): describe_file(p) for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    (checkpoint / META).write_text(json.dumps({"format": FORMAT, "step": 1, "world_size": 1, "files": files}))

    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: refusing to export non-finite weights: lm_head.weight"), err
    assert not (tmp_path / "out").exists()
