"""data.datasets: a weighted mixture of sources, each with its own format, drawn in proportion to its weight,
with a validation loss per source and overall."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from shardlight.build import build_tokenizer
from shardlight.data import IGNORE_INDEX, SFTDataModule
from shardlight.errors import ShardlightError
from shardlight.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "tiny-llama-sft.yaml"
SHIPPED = REPO / "recipes" / "data"


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path: Path, datasets: str, extra: str = "") -> Path:
    recipe = tmp_path / "mixture.yaml"
    recipe.write_text(f"base: {DEFAULT_RECIPE}\noutput_dir: {tmp_path / 'runs'}\n"
                      f"data:\n  train_files: []\n  val_files: []\n  cache_dir: {tmp_path / 'cache'}\n"
                      f"  datasets:\n{datasets}{extra}")
    return recipe


def test_a_3_to_1_mixture_draws_its_sources_3_to_1(tmp_path):
    """Each training example comes from source A with probability 3/4: over about 10k draws the share of A is
    within 4 standard errors of 0.75, counted on the blocks themselves (A's prompts start with 'A')."""
    _write(tmp_path / "a.jsonl", [{"prompt": f"A{i}", "response": "x"} for i in range(3000)])
    _write(tmp_path / "b.jsonl", [{"prompt": f"B{i}", "response": "y"} for i in range(2500)])
    recipe = _recipe(tmp_path, "    - {train_files: [a.jsonl], weight: 3, val_fraction: 0, prompt_template: '{prompt}='}\n"
                               "    - {train_files: [b.jsonl], weight: 1, val_fraction: 0, prompt_template: '{prompt}='}\n")
    cfg = load_recipe(str(recipe), ["data.packing=false", "data.seq_len=16"])
    tokenizer = build_tokenizer(cfg)
    dm = SFTDataModule(cfg, tokenizer)
    dm.setup("fit")
    first = dm.train_dataset.input_ids[:, 1]  # after bos: the prompt's first byte
    a, b = (int((first == tokenizer.convert_tokens_to_ids(letter)).sum()) for letter in "AB")
    n = a + b
    assert n == len(dm.train_dataset) and n > 9000
    assert abs(a / n - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n), (a, b)
    assert dm.stats["train_examples_by_source"] == {"a": a, "b": b}
    assert b >= 2500  # every example of every source is drawn at least once (all_exhausted)
    assert dm.val_names == [] and dm.val_dataloader() == []


def test_a_mixture_trains_and_reports_each_sources_validation_loss(tmp_path, cli):
    """One rank, 4 steps, an instruction source and a chat source: val/loss/<name> for each, and val/loss is
    their token-weighted mean (the supervised-token counts read from the data module)."""
    _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"},
                                                   {"role": "assistant", "content": f"hello {i}"}]}
                                     for i in range(300)])
    recipe = _recipe(tmp_path, f"    - {{name: arith, train_files: [{SHIPPED / 'tiny_sft_train.jsonl'}], "
                               f"val_files: [{SHIPPED / 'tiny_sft_val.jsonl'}], weight: 3}}\n"
                               "    - {name: talk, train_files: [chat.jsonl], format: chat, val_fraction: 0.1}\n")
    overrides = ["trainer.devices=1", "trainer.max_steps=4", "trainer.val_every_n_steps=4",
                 "trainer.log_every_n_steps=2", "logging.wandb.enabled=false", "callbacks.comm.enabled=false"]
    summary = tmp_path / "summary.json"
    result = cli(["train", str(recipe), *overrides, "--summary-json", str(summary)])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("shardlight: data ") == 1
    run_dir = Path(json.loads(summary.read_text())["run_dir"])
    rows = [r for path in run_dir.rglob("metrics.csv") for r in csv.DictReader(path.open())]
    final = [r for r in rows if r.get("val/loss/arith") and r.get("val/loss") and r["step"] != "0"][-1]

    dm = SFTDataModule(load_recipe(str(recipe), overrides), None)
    dm.tokenizer = build_tokenizer(dm.cfg)
    dm.setup("validate")  # read from the run's cache
    assert dm.val_names == ["arith", "talk"]
    tokens = {name: int((ds.labels[:, 1:] != IGNORE_INDEX).sum()) for name, ds in dm.val_datasets.items()}
    losses = {name: float(final[f"val/loss/{name}"]) for name in tokens}
    mean = sum(losses[n] * tokens[n] for n in tokens) / sum(tokens.values())
    assert float(final["val/loss"]) == pytest.approx(mean, rel=1e-5)
    assert losses["arith"] != pytest.approx(losses["talk"], rel=1e-3)


@pytest.mark.parametrize("datasets, extra, pattern", [
    ("    - {train_files: [a.jsonl]}\n", "  train_files: [a.jsonl]\n",
     r"^data\.datasets \(a mixture\) replaces data\.train_files"),
    ("    - {train_files: [a.jsonl]}\n    - {train_files: [x/a.jsonl]}\n", "",
     r"^data\.datasets: more than one source is named 'a'; give each a distinct name"),
    ("    - {train_files: [a.jsonl], weight: 0}\n", "", r"^data\.datasets\[0\]\.weight must be positive, got 0"),
    ("    - {train_files: [a.jsonl], wieght: 2}\n", "",
     r"^unknown recipe key 'data\.datasets\[0\]\.wieght' in .*; did you mean 'data\.datasets\[0\]\.weight'\?"),
    ("    - {format: chat}\n", "", r"^data\.datasets\[0\]: set data\.datasets\[0\]\.train_files"),
    ("    - {train_files: [a.jsonl], format: prose}\n", "", r"^data\.datasets\[0\]\.format: 'prose' is not allowed"),
])
def test_mixture_recipe_errors(tmp_path, datasets, extra, pattern):
    with pytest.raises(ShardlightError, match=pattern) as exc:
        load_recipe(str(_recipe(tmp_path, datasets, extra)), [])
    assert "\n" not in str(exc.value)
