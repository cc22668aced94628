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


# --- runs that several tests only read (each is a real multi-process run; made once per session) ---------

WANDB_SECRET = "wandb-secret-key-must-never-be-written-0123456789"


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default recipe as a user runs it first: 2 gloo ranks, FULL_SHARD, 200 steps, W&B offline (with an API
    key in the environment, which must never be written), the progress bar and the comm windows on. Returns
    (the CompletedProcess, its summary)."""
    import json

    root = tmp_path_factory.mktemp("default_run")
    summary = root / "summary.json"
    result = run_cli(["train", f"output_dir={root / 'runs'}", "--summary-json", str(summary),
                      "logging.wandb.mode=offline"], env={"WANDB_API_KEY": WANDB_SECRET})
    assert result.returncode == 0, result.stderr[-4000:]
    return result, json.loads(summary.read_text())


@pytest.fixture(scope="session")
def profile_sweep(tmp_path_factory):
    """``shardlight profile`` of the default recipe on 2 gloo ranks: the baseline, then NO_SHARD, SHARD_GRAD_OP
    and FULL_SHARD, 6 steps each, each its own process. Returns (the report directory, the CompletedProcess)."""
    out = tmp_path_factory.mktemp("profile_sweep") / "profile"
    result = run_cli(["profile", "--out", str(out), "--steps", "6", "logging.wandb.enabled=false"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


GLOO_FITS_WORKER = REPO / "tests" / "workers" / "gloo_fits.py"


def gloo_fits(recipe, world, runs, out, timeout=600):
    """Every rank of ``world`` started here torchrun-style (tests/workers/gloo_fits.py); each runs every fit of
    ``runs`` ({name: overrides}, or {name: {"overrides": [...], "train": true}}) in one gloo process group.
    Returns {name: rank 0's result}."""
    import json

    import torch

    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    specs = {name: run if isinstance(run, dict) else {"overrides": run} for name, run in runs.items()}
    spec.write_text(json.dumps({"runs": {name: {**run, "recipe": str(run.get("recipe", recipe)),
                                                "overrides": [f"trainer.devices={world}", *run["overrides"]]}
                                         for name, run in specs.items()}}))
    env = without_run_env(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), NODE_RANK="0",
               PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, str(GLOO_FITS_WORKER), str(spec), str(out)], cwd=REPO, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in runs}


# --- the FSDP strategy's runs (tests/strategy_runs.py), shared by test_strategy, test_chunked_loss and
# test_compile_and_checkpointing: each world size's runs once per session, in one process group ---------------

@pytest.fixture(scope="session")
def strategy_setup(tmp_path_factory):
    from strategy_runs import write_setup

    return write_setup(tmp_path_factory.mktemp("strategy"))


@pytest.fixture(scope="session")
def strategy_two_ranks(strategy_setup, tmp_path_factory):
    from strategy_runs import runs_of

    return gloo_fits(strategy_setup[1], 2, runs_of(2), tmp_path_factory.mktemp("strategy_two_ranks"))


@pytest.fixture(scope="session")
def strategy_four_ranks(strategy_setup, tmp_path_factory):
    from strategy_runs import runs_of

    return gloo_fits(strategy_setup[1], 4, runs_of(4), tmp_path_factory.mktemp("strategy_four_ranks"))
