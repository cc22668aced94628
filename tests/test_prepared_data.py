"""framework/prepared_data.py: the data is tokenized once, then read by restarts and by the other ranks; a change
to any input builds it again; concurrent processes build it once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardlight.build import build_tokenizer
from shardlight.data import SFTDataModule, _Encoder
from shardlight.recipe import RecipeConfig

REPO = Path(__file__).resolve().parents[1]
TOK_DIR = REPO / "recipes" / "assets" / "tiny-tokenizer"
SHIPPED = REPO / "recipes" / "data" / "tiny_sft_train.jsonl"


def _cfg(tmp_path: Path, train: Path) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.model.config = {"model_type": "llama"}
    cfg.tokenizer.name_or_path = str(TOK_DIR)
    cfg.trainer.micro_batch_size = 2
    cfg.data.train_files, cfg.data.val_fraction, cfg.data.seq_len = [str(train)], 0.05, 128
    cfg.data.cache_dir = str(tmp_path / "cache")
    return cfg


def _setup(cfg, capsys):
    """A fresh data module (a restart, or another rank): its blocks, what it printed and how long it took."""
    dm = SFTDataModule(cfg, build_tokenizer(cfg))
    start = time.perf_counter()
    dm.setup("fit")
    took = time.perf_counter() - start
    return dm, capsys.readouterr().out.strip().splitlines(), took


def test_a_restart_reads_the_data_and_a_changed_byte_builds_it_again(tmp_path, capsys, monkeypatch):
    train = tmp_path / "train.jsonl"
    train.write_bytes(SHIPPED.read_bytes())  # 4,000 examples
    cfg = _cfg(tmp_path, train)
    calls = []
    encode = _Encoder.__call__
    monkeypatch.setattr(_Encoder, "__call__", lambda self, batch: calls.append(1) or encode(self, batch))

    first, said, built_s = _setup(cfg, capsys)
    assert calls and len(said) == 1 and said[0].startswith("shardlight: data tokenized in ")
    assert "3800 training examples" in said[0] and "200 validation examples" in said[0]
    entry = Path(said[0].rsplit(": ", 1)[1])
    assert entry.parent == tmp_path / "cache" and (entry / "meta.json").is_file()

    calls.clear()
    again, said, read_s = _setup(cfg, capsys)
    assert not calls, "a restart tokenized again"
    assert said == [f"shardlight: data read from the cache ({said[0].split('(', 1)[1].split(')')[0]}): {entry}"]
    assert read_s < built_s / 3, (read_s, built_s)
    for name, want in first.train_dataset.arrays.items():
        assert np.array_equal(again.train_dataset.arrays[name].numpy(), want.numpy()), name
    assert again.stats == first.stats

    moved = tmp_path / "elsewhere.jsonl"  # the same bytes under another name: still the same data
    moved.write_bytes(train.read_bytes())
    cfg.data.train_files = [str(moved)]
    assert "read from the cache" in _setup(cfg, capsys)[1][0]

    rows = moved.read_text().splitlines()
    rows[7] = rows[7].replace('"response": "', '"response": "x', 1)  # one byte more in one answer
    moved.write_text("\n".join(rows) + "\n")
    changed, said, _ = _setup(cfg, capsys)
    assert calls and said[0].startswith("shardlight: data tokenized in ") and str(entry) not in said[0]

    calls.clear()
    cfg.data.seq_len = 64  # a setting: built again too
    assert _setup(cfg, capsys)[1][0].startswith("shardlight: data tokenized in ") and calls


BUILD_ONCE = """
import json, sys
from shardlight.build import build_tokenizer
from shardlight.data import SFTDataModule
from shardlight.recipe import RecipeConfig
cfg = RecipeConfig()
cfg.model.config = {"model_type": "llama"}
cfg.tokenizer.name_or_path, cfg.trainer.micro_batch_size = sys.argv[1], 2
cfg.data.train_files, cfg.data.cache_dir = [sys.argv[2]], sys.argv[3]
dm = SFTDataModule(cfg, build_tokenizer(cfg))
dm.setup("fit")
"""


def test_processes_that_start_together_build_the_data_once(tmp_path):
    """Two processes (as two ranks of a node) on one empty cache: one builds while the other waits on the lock
    and then reads what it wrote."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i}"}) + "\n" for i in range(3000)))
    args = [sys.executable, "-c", BUILD_ONCE, str(TOK_DIR), str(train), str(tmp_path / "cache")]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    said = sorted(out.strip().split(" (")[0] for out, _ in outs)
    assert said[0] == "shardlight: data read from the cache" and said[1].startswith("shardlight: data tokenized in ")
    entries = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1  # and no staging directory left behind


def test_a_cache_dir_that_is_a_file_is_refused_before_the_run(tmp_path):
    from shardlight.errors import ShardlightError
    from shardlight.preflight import check_writable_dir
    from shardlight.prepared_data import cache_root

    cfg = _cfg(tmp_path, SHIPPED)
    (tmp_path / "cache").write_text("")
    with pytest.raises(ShardlightError, match=r"^data\.cache_dir '.*cache' is a file; it must be a directory"):
        check_writable_dir(cache_root(cfg), "data.cache_dir")
