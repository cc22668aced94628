import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardlight.launch.launchers import without_run_env

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "tiny-llama-sft.yaml"

# Tests never reach the network: W&B offline, HF hub offline.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_cli(args, cwd=None, timeout=600, env=None):
    """Run ``python -m shardlight.cli ARGS`` in a fresh process (each Lightning fit gets its own)."""
    # A fresh run: nothing of a surrounding run (its dir, resume decision, rank) leaks into it.
    full_env = without_run_env(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "shardlight.cli", *args],
        cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


def forbid_training(monkeypatch):
    """Bad-input tests call the CLI in-process; if validation ever let a case through, Lightning would
    re-launch pytest itself as rank 1. Fail at the Trainer instead."""
    import shardlight.train

    def refuse(*args, **kwargs):
        raise AssertionError("bad input reached the Trainer")

    monkeypatch.setattr(shardlight.train, "build_trainer", refuse)


def save_tiny_llama(path):
    """A saved tiny Llama (the shipped tokenizer's vocabulary), so every run and its single-process
    reference start from the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path
