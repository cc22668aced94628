"""Real Lightning fits in subprocesses: 2 gloo ranks with FULL_SHARD (the default recipe) and 1 rank."""

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import WANDB_SECRET
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow


def read_metrics(run_dir: Path):
    with open(run_dir / "csv" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def assert_export_reloads(run_dir: Path, model_dir: Path):
    check = load_file(str(run_dir / "export_check.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=check["input_ids"]).logits
    assert torch.equal(logits, check["logits"]), float((logits - check["logits"]).abs().max())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.eos_token is not None and len(tokenizer) <= model.config.vocab_size


def test_default_recipe_two_ranks_full_shard_learns_and_exports(default_run):
    result, summary = default_run
    assert "FSDP FULL_SHARD: 3 units on 2 ranks" in result.stdout + result.stderr
    assert summary["steps"] == 200 and summary["world_size"] == 2
    assert summary["final_val_loss"] <= 0.6 * summary["first_val_loss"], summary
    assert summary["export_max_abs_diff"] <= 1e-5
    run_dir, model_dir = Path(summary["run_dir"]), Path(summary["model_dir"])
    assert run_dir.parent.name == "tiny-llama-sft" and run_dir.parent.parent.name == "runs"
    assert model_dir == run_dir / "model"
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == summary["final_val_loss"]

    recipe = (run_dir / "recipe.yaml").read_text()
    assert "sharding_strategy: FULL_SHARD" in recipe and "max_steps: 200" in recipe

    rows = read_metrics(run_dir)
    train_losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val_losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(train_losses) >= 10 and train_losses[-1] < train_losses[0]
    assert val_losses[0] == pytest.approx(summary["first_val_loss"], rel=1e-5)
    assert val_losses[-1] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    assert any(r.get("lr") for r in rows) and any(r.get("train/tokens_seen") for r in rows)
    assert any(r.get("val/perplexity") for r in rows)

    wandb_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1, "W&B logs offline inside the run dir"
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert WANDB_SECRET.encode() not in path.read_bytes(), f"API key written to {path}"

    assert_export_reloads(run_dir, model_dir)


def test_one_rank_run(tmp_path, cli):
    summary_path = tmp_path / "summary.json"
    result = cli(
        ["train", "trainer.devices=1", "trainer.max_steps=30", "trainer.val_every_n_steps=20",
         "logging.wandb.enabled=false", f"output_dir={tmp_path}", "--summary-json", str(summary_path)]
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 30
    # 30 is not a multiple of 20: a last validation runs after fit so final_val_loss is at step 30.
    assert summary["final_val_loss"] < summary["first_val_loss"]
    run_dir = Path(summary["run_dir"])
    assert not (run_dir / "wandb").exists()
    assert_export_reloads(run_dir, Path(summary["model_dir"]))
