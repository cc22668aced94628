"""Sharded checkpoints: exact resume (FSDP1, FSDP2, mid-epoch and at an epoch end), resharding 2 -> 1 -> 2
ranks, verified Hugging Face export, `inspect`, `full_params`, and faults (a rank SIGKILLed, a run killed
mid-save, missing/corrupt shards). Every Lightning fit runs in its own process (2 gloo ranks unless said)."""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import REPO, forbid_training, gloo_fits, run_cli, save_tiny_llama

from shardlight.launch.launchers import without_run_env

pytestmark = pytest.mark.slow

TOKENIZER = REPO / "recipes" / "assets" / "tiny-tokenizer"
TRAIN_DATA = REPO / "recipes" / "data" / "tiny_sft_train.jsonl"
FAST = ["callbacks.comm.enabled=false", "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false",
        "logging.wandb.enabled=false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny Llama and a recipe whose epoch is 4 optimizer steps (so 10 steps cross two epochs)."""
    root = tmp_path_factory.mktemp("ckpt")
    save_tiny_llama(root / "init")
    rows = TRAIN_DATA.read_text().splitlines()[:16]  # one packed block each at seq_len 32: 4 batches per rank
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")
    recipe = root / "tiny.yaml"
    recipe.write_text(textwrap.dedent(f"""
        model: {{name_or_path: {root / 'init'}}}
        tokenizer: {{name_or_path: {TOKENIZER}}}
        data: {{train_files: [{root / 'train.jsonl'}], val_fraction: 0.0, seq_len: 32}}
        optim: {{lr: 1.0e-3, warmup_steps: 1, weight_decay: 0.1}}
        trainer: {{max_steps: 10, micro_batch_size: 2, accelerator: cpu, devices: 2, limit_val_batches: 0,
                   progress_bar: false, log_every_n_steps: 1, num_threads: 1, collective_timeout_s: 30}}
        checkpoint: {{every_n_steps: 2, keep_last: 5}}
        fsdp: {{transformer_cls_names_to_wrap: [LlamaDecoderLayer]}}
    """))
    return root, recipe


def train(recipe, out_dir, *overrides, env=None, expect_ok=True):
    summary = Path(out_dir) / "summary.json"
    result = run_cli(["train", str(recipe), f"output_dir={out_dir}", "--summary-json", str(summary), *FAST,
                      *overrides], env=env)
    if expect_ok:
        assert result.returncode == 0, result.stderr[-4000:]
        return json.loads(summary.read_text()), result
    return None, result


def losses(run_dir):
    """Per-step train/loss from metrics.csv, keyed by optimizer step (1-based)."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as fh:
        return {int(r["step"]) + 1: float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")}


def whole_runs(runs, out):
    """{name: overrides} → gloo_fits' whole runs (``shardlight.train.train``), console kept, under ``out``."""
    return {name: {"train": True, "capture": True,
                   "overrides": [*FAST, f"output_dir={out}", *overrides, f"name={name}"]}
            for name, overrides in runs.items()}


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    """The 2-rank runs, one process pair (``conftest.gloo_fits``): ``a``, the uninterrupted reference (10 steps,
    FSDP1, a checkpoint every 2 steps); ``a`` resumed from step 6 (mid-epoch) and from step 4 (an epoch's end);
    FSDP2 accumulating 2 with a checkpoint every 3 steps, and the same resumed from its step 6."""
    _, recipe = tiny
    out = tmp_path_factory.mktemp("two_ranks")
    ckpts = out / "runs" / "a" / "checkpoints"
    fsdp2 = ["fsdp.fsdp_version=2", "trainer.accumulate_grad_batches=2"]
    runs = {"a": [], "from6": [f"resume={ckpts / 'step-6'}"], "from4": [f"resume={ckpts / 'step-4'}"],
            "fsdp2": [*fsdp2, "checkpoint.every_n_steps=3"],
            "fsdp2-from6": [*fsdp2, f"resume={out / 'runs' / 'fsdp2' / 'checkpoints' / 'step-6'}"]}
    return gloo_fits(recipe, 2, whole_runs(runs, out / "runs"), out)


@pytest.fixture(scope="module")
def run_a(two_ranks):
    summary = two_ranks["a"]["summary"]
    return Path(summary["run_dir"]), summary


def assert_same_losses(reference, resumed, steps):
    assert sorted(resumed) == list(steps), resumed
    for step in steps:
        assert abs(resumed[step] - reference[step]) <= 1e-6, (step, resumed[step], reference[step])


def test_checkpoint_layout_and_exact_resume_mid_epoch_and_at_epoch_end(two_ranks, run_a):
    run_dir, summary = run_a
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == [f"step-{s}" for s in (10, 2, 4, 6, 8)]
    assert (ckpts / "latest").read_text().strip() == "step-10"
    assert summary["checkpoint"] == str(ckpts / "step-10")
    assert not list(ckpts.glob(".tmp-*"))
    step6 = ckpts / "step-6"
    meta = json.loads((step6 / "shardlight.json").read_text())
    assert meta["step"] == 6 and meta["world_size"] == 2 and (meta["epoch"], meta["batch_in_epoch"]) == (1, 2)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra_rank0.pt", "extra_rank1.pt"} <= set(meta["files"])
    extra = torch.load(step6 / "extra_rank1.pt", weights_only=True)
    assert extra["global_step"] == 6 and extra["rank"] == 1

    reference = losses(run_dir)
    assert sorted(reference) == list(range(1, 11))
    # step 6 is mid-epoch (2 of 4 batches of epoch 1); step 4 ends epoch 0.
    for start in (6, 4):
        resumed = two_ranks[f"from{start}"]
        assert f"resumed from {ckpts / f'step-{start}'} at step {start}" in resumed["output"]
        assert resumed["summary"]["steps"] == 10
        assert_same_losses(reference, losses(resumed["summary"]["run_dir"]), range(start + 1, 11))


def test_fsdp2_exact_resume_with_gradient_accumulation(two_ranks):
    reference = losses(two_ranks["fsdp2"]["summary"]["run_dir"])
    assert_same_losses(reference, losses(two_ranks["fsdp2-from6"]["summary"]["run_dir"]), range(7, 11))


def test_reshard_two_to_one_to_two_ranks_and_export_at_end(tiny, run_a, tmp_path, capsys):
    _, recipe = tiny
    run_dir, _ = run_a
    reference = losses(run_dir)
    out = tmp_path / "runs"
    one = gloo_fits(recipe, 1, whole_runs({"one": [f"resume={run_dir / 'checkpoints' / 'step-6'}"]}, out),
                    tmp_path / "one")["one"]
    assert "resumed from" in one["output"] and one["summary"]["world_size"] == 1
    one_dir = Path(one["summary"]["run_dir"])
    first = losses(one_dir)[7]
    # Different data order on one rank, same weights: close to the 2-rank loss, far from the untrained one.
    assert abs(first - reference[7]) < abs(first - reference[1]), (first, reference)
    two = gloo_fits(recipe, 2, whole_runs({"two": ["trainer.max_steps=12", "resume=auto", f"resume_dir={one_dir}",
                                                   "export.checkpoint=true"]}, out), tmp_path / "two")["two"]
    assert f"resumed from {one_dir / 'checkpoints' / 'step-10'}" in two["output"]
    two = two["summary"]
    assert sorted(losses(two["run_dir"])) == [11, 12] and two["world_size"] == 2
    assert two["checkpoint_export_max_abs_diff"] <= 1e-5
    assert (Path(two["export_dir"]) / "model.safetensors").is_file()

    from shardlight.cli.main import main

    capsys.readouterr()
    assert main(["inspect", str(one_dir / "checkpoints" / "step-10")]) == 0
    assert "1 rank(s) wrote shards" in capsys.readouterr().out
    assert main(["inspect", two["run_dir"]]) == 0
    assert "2 rank(s) wrote shards" in capsys.readouterr().out


def test_export_cli_matches_trained_model_and_inspect_lists_shards(run_a, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from shardlight.cli.main import main

    run_dir, summary = run_a
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(run_dir / "checkpoints" / "step-10"), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"read back tensor by tensor: max \|diff\| = 0: OK", stdout), stdout
    report = json.loads((out / "export_report.json").read_text())
    assert report["ok"] and report["max_abs_diff"] <= 1e-5
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    # The export of the final checkpoint is the model training ended with (written by the full-state path).
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(summary["model_dir"], dtype=torch.float32).eval()(input_ids=ids).logits
    assert float((a - b).abs().max()) <= 1e-6
    # In files of at most 100 KB (the model is 214 KB): several files and an index, written one at a time.
    small = tmp_path / "hf-small"
    assert main(["export", str(run_dir / "checkpoints" / "step-10"), "--out", str(small), "--max-shard-size",
                 "100KB"]) == 0
    stdout = capsys.readouterr().out
    assert "3 safetensors file(s)" in stdout, stdout
    assert len(list(small.glob("model-0000?-of-00003.safetensors"))) == 3
    assert (small / "model.safetensors.index.json").is_file() and not (small / "model.safetensors").exists()
    with torch.no_grad():
        c = AutoModelForCausalLM.from_pretrained(str(small), dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.equal(a, c)

    listing = tmp_path / "inspect.json"
    assert main(["inspect", str(run_dir / "checkpoints" / "step-10"), "--json", str(listing)]) == 0
    stdout = capsys.readouterr().out
    line = next(ln for ln in stdout.splitlines() if ln.startswith("model.layers.0.self_attn.q_proj.weight"))
    assert "(32, 32)" in line and "float32" in line and "r0:" in line and "r1:" in line
    data = json.loads(listing.read_text())
    assert data["ranks"] == [0, 1]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert data["model_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert data["other_bytes"] > data["model_bytes"]  # AdamW's two moments per parameter
    q = next(e for e in data["entries"] if e["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert [s["rank"] for s in q["shards"]] == [0, 1] and q["shape"] == [32, 32]
    assert not any(e["name"].startswith("optim") for e in data["entries"])


def _children(pid):
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _rank1(pid):
    """Lightning's subprocess launcher starts rank 1 as a child of rank 0 with LOCAL_RANK=1."""
    return next(c for c in _children(pid) if c.environ().get("LOCAL_RANK") == "1")


@pytest.mark.parametrize("victim", ["rank1", "rank0", "rank1-stopped"])
def test_sigkill_one_rank_other_exits_with_clear_message(tiny, tmp_path, victim):
    """SIGKILL of either rank; and SIGSTOP (a hung rank), which only the collective timeout can detect.

    Which error the survivor sees depends on which collective the signal finds it in, and nothing here
    controls that: a SIGSTOP while the survivor waits in Lightning's per-batch SIGTERM broadcast (which
    swallows its own timeout) surfaces only as gloo's "Application timeout caused pair closure" in the next
    all-gather; elsewhere as "Timed out waiting ... for recv/send". Every form must give the same one line.
    """
    import psutil

    _, recipe = tiny
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("LOCAL_RANK", None)
    env.pop("SHARDLIGHT_RUN_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardlight.cli", "train", str(recipe), f"output_dir={tmp_path}", *FAST,
         "trainer.max_steps=100000", "checkpoint.every_n_steps=100000", "trainer.collective_timeout_s=15"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = None
    try:
        started = time.time()
        while time.time() - started < 300:  # until a few steps have been logged
            files = list(tmp_path.glob("*/*/csv/metrics.csv"))
            if files and files[0].read_text().count("\n") > 3:
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        rank1 = _rank1(proc.pid)
        killed, survivor = (proc.pid, rank1) if victim == "rank0" else (rank1.pid, proc)
        t0 = time.time()
        os.kill(killed, signal.SIGSTOP if victim == "rank1-stopped" else signal.SIGKILL)
        if victim != "rank0":
            proc.wait(timeout=60)
        else:
            survivor.wait(timeout=60)
        elapsed = time.time() - t0
        if victim == "rank1-stopped":
            rank1.kill()  # stopped, it cannot act on the launcher's SIGTERM and still holds our stderr pipe
        _, stderr = proc.communicate(timeout=60)
    finally:
        if rank1 is not None and rank1.is_running():
            try:
                rank1.kill()  # a stopped rank 1 outlives rank 0 unless the launcher reaped it
            except psutil.NoSuchProcess:
                pass
        proc.kill()
    assert elapsed < 60
    survivor_rank = 1 if victim == "rank0" else 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]  # the survivor's one line; the victim never got to say anything
    assert errors[0].startswith(f"error: rank {survivor_rank}: a collective failed, another rank probably died")
    assert "Traceback" not in stderr, stderr[-3000:]
    if victim == "rank1-stopped":
        assert proc.returncode == 1
    elif victim == "rank1":
        assert proc.returncode not in (0, None)  # 1, or SIGKILL from Lightning's child-process observer


EXPORT_FAULT_WORKER = REPO / "tests" / "workers" / "export_fault_train.py"
PR_SET_CHILD_SUBREAPER = 36
# How long the survivor waits for the stopped peer (the rendezvous has trainer.startup_timeout_s of its own).
EXPORT_FAULT_TIMEOUT_S = 15


def _adopt_orphans(on):
    """Make this process the subreaper of its descendants (Linux): a rank orphaned by its launcher's death
    becomes our child, so its exit status can be read. Off again after the test."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0, ctypes.get_errno()


def _reap(pid, deadline):
    """Exit code of ``pid`` once it has exited and is our child (an adopted orphan included); None at
    ``deadline``."""
    while time.time() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours (yet): its launcher still lives
            done, status = 0, 0
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    return None


@pytest.mark.parametrize("fault", ["0:kill", "1:stop"])
def test_peer_dies_or_hangs_in_the_export_after_fit_other_exits_with_clear_message(tiny, tmp_path, fault):
    """The export after fit gathers the full weights on every rank, outside Lightning: a peer SIGKILLed there
    (rank 0, whose survivor Lightning's child-process observer cannot SIGKILL first) or SIGSTOPped there
    (rank 1: only the collective timeout can tell) still gives the survivor's one line, exit 1, no traceback."""
    _, recipe = tiny
    victim = int(fault.split(":")[0])
    survivor = 1 - victim
    marks = tmp_path / "marks"
    env = without_run_env(os.environ)
    env.update(PYTHONPATH=str(REPO), EXPORT_FAULT=fault, EXPORT_FAULT_DIR=str(marks))
    stderr_path = tmp_path / "stderr.txt"
    pids, code, finished = {}, None, None
    _adopt_orphans(True)
    try:
        with open(stderr_path, "w") as err, open(tmp_path / "stdout.txt", "w") as out:
            proc = subprocess.Popen(  # rank 0; Lightning's launcher starts rank 1 as its child
                [sys.executable, str(EXPORT_FAULT_WORKER), "train", str(recipe), f"output_dir={tmp_path / 'runs'}",
                 *FAST, "trainer.max_steps=2", "checkpoint.every_n_steps=100000", f"trainer.collective_timeout_s={EXPORT_FAULT_TIMEOUT_S}"],
                cwd=REPO, env=env, stdout=out, stderr=err)
        try:
            deadline = time.time() + 300
            while len(pids) < 2 and time.time() < deadline and proc.poll() is None:
                pids = {r: int(text) for r in (0, 1)
                        if (f := marks / f"rank{r}.pid").is_file() and (text := f.read_text())}
                time.sleep(0.2)
            assert len(pids) == 2, stderr_path.read_text()[-3000:]
            if survivor == 0:
                try:
                    code = proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    pass
            else:  # rank 1, ours once SIGKILL takes its launcher
                code = _reap(pids[1], time.time() + 300)
            finished = time.time()
        finally:
            for rank, pid in pids.items():
                if rank != 0 and not (rank == survivor and code is not None):
                    try:
                        os.kill(pid, signal.SIGKILL)  # the stopped victim; whatever a failure left behind
                    except ProcessLookupError:
                        pass
            proc.kill()
            proc.wait()
            if 1 in pids and not (survivor == 1 and code is not None):
                _reap(pids[1], time.time() + 30)
    finally:
        _adopt_orphans(False)
    stderr = stderr_path.read_text()
    assert (marks / "fault").is_file(), stderr[-3000:]  # the victim went where it was meant to: in the export
    assert code is not None, stderr[-3000:]  # the survivor exited
    elapsed = finished - float((marks / "fault").read_text())
    assert elapsed < EXPORT_FAULT_TIMEOUT_S + 45, elapsed  # the collective timeout, or at once for a dead peer
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith(f"error: rank {survivor}: a collective failed, another rank probably died"), errors
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    assert code == 1, (code, stderr[-3000:])


def test_a_failed_export_loses_nothing_and_says_how_to_retry(tiny, tmp_path):
    """Every rank's safetensors write raises (a full disk) with checkpoints off: the final step is still saved
    (before the export), the run exits 1 with one ``error:`` line naming the ``shardlight export`` command that
    retries, no traceback; that command, run as written, writes the model."""
    _, recipe = tiny
    env = without_run_env(os.environ)
    env.update(PYTHONPATH=str(REPO), EXPORT_FAULT="all:raise", EXPORT_FAULT_DIR=str(tmp_path / "marks"))
    result = subprocess.run(
        [sys.executable, str(EXPORT_FAULT_WORKER), "train", str(recipe), f"output_dir={tmp_path / 'runs'}", *FAST,
         "trainer.max_steps=2", "checkpoint.enabled=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "No space left on device (injected)" in errors[0], errors
    retry = re.search(r"retry with: shardlight (export \S+ --out \S+)", errors[0])
    assert retry, errors
    checkpoint = Path(retry.group(1).split()[1])
    from shardlight.checkpoint.store import META
    from shardlight.cli.main import main

    assert checkpoint.name == "step-2" and (checkpoint / META).is_file()
    assert main(retry.group(1).split()) == 0
    model_dir = Path(retry.group(1).split()[-1])
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(model_dir))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_keeps_previous_checkpoint_and_resume_auto_uses_it(tiny, run_a, tmp_path, mode):
    _, recipe = tiny
    out = tmp_path / "runs"
    _, result = train(recipe, out, f"checkpoint.async_save={mode == 'async'}",
                      env={"SHARDLIGHT_FAULT_KILL_IN_SAVE_STEP": "4"}, expect_ok=False)
    assert result.returncode != 0
    (killed,) = list((out / "tiny").iterdir())
    ckpts = killed / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-2"
    assert [p.name for p in ckpts.glob("step-*")] == ["step-2"]
    assert (ckpts / ".tmp-step-4").is_dir() and not (ckpts / ".tmp-step-4" / "shardlight.json").exists()

    if mode == "async":
        return  # the checkpoint left is the synchronous case's; resuming from it is tested there
    resumed, result = train(recipe, out, "resume=auto")  # the newest run of this recipe: the killed one
    assert f"resumed from {ckpts / 'step-2'} at step 2" in result.stderr
    assert_same_losses(losses(run_a[0]), losses(resumed["run_dir"]), range(3, 11))


SLOW_WRITE_WORKER = REPO / "tests" / "workers" / "slow_write_train.py"


def _checkpoint_tensors(path, tmp):
    """Every value of a DCP checkpoint (model and optimizer), flattened to dotted keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", torch.load(tmp, weights_only=True))
    return flat


def test_async_checkpoints_let_training_go_on_and_equal_the_synchronous_ones(tiny, run_a, tmp_path):
    """A file system whose write of step N's shards waits until training has finished step N + 1: with
    checkpoint.async_save every save but the last overlaps at least one step (a save that held training would
    wait for a step that never comes and report 0), whatever the machine's load; and every checkpoint holds
    exactly what run_a's synchronous save of that step holds (model and optimizer, every value), so the
    background write saved the step it was asked for, not the one training had reached."""
    _, recipe = tiny
    summary_path = tmp_path / "summary.json"
    env = without_run_env(os.environ)
    env.update(PYTHONPATH=str(REPO), SLOW_WRITE_TIMEOUT_S="60")
    result = subprocess.run(
        [sys.executable, str(SLOW_WRITE_WORKER), "train", str(recipe), f"output_dir={tmp_path / 'runs'}",
         "--summary-json", str(summary_path), *FAST, "checkpoint.async_save=true"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    went_on = [int(n) for n in re.findall(r"written in the background in [\d.]+ s; training went on (\d+) step",
                                          result.stderr)]
    # Saves at steps 2, 4, 6, 8 are overlapped by the next steps (the next save waits for them); the last is
    # waited for at the end.
    assert len(went_on) == 5 and all(n >= 1 for n in went_on[:4]), (went_on, result.stderr[-3000:])
    run_dir = Path(summary["run_dir"])
    assert_same_losses(losses(run_a[0]), losses(run_dir), range(1, 11))
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-10" and not list(ckpts.glob(".tmp-*"))
    for step in (2, 10):
        ours = _checkpoint_tensors(ckpts / f"step-{step}", tmp_path / f"ours{step}.pt")
        theirs = _checkpoint_tensors(run_a[0] / "checkpoints" / f"step-{step}", tmp_path / f"theirs{step}.pt")
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            same = torch.equal(ours[key], value) if torch.is_tensor(value) else ours[key] == value
            assert same, (step, key)


def test_missing_or_corrupt_shard_is_one_clear_error_before_loading(tiny, run_a, tmp_path, monkeypatch, capsys):
    from shardlight.cli.main import main

    forbid_training(monkeypatch)
    monkeypatch.delenv("SHARDLIGHT_RESUME_FROM", raising=False)
    _, recipe = tiny
    source = run_a[0] / "checkpoints" / "step-10"
    cases = {
        "corrupt": lambda d: (d / "__1_0.distcp").write_bytes(b"\0" * (d / "__1_0.distcp").stat().st_size),
        "truncated": lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
        "missing": lambda d: (d / "__1_0.distcp").unlink(),
    }
    for name, damage in cases.items():
        ckpt = tmp_path / name / "step-10"
        shutil.copytree(source, ckpt)
        damage(ckpt)
        shard = "__1_0.distcp" if name != "truncated" else "__0_0.distcp"
        for argv in (["train", str(recipe), f"output_dir={tmp_path / 'out'}", f"resume={ckpt}", *FAST],
                     ["export", str(ckpt), "--out", str(tmp_path / "export")]):
            monkeypatch.delenv("SHARDLIGHT_RESUME_FROM", raising=False)
            assert main(argv) == 2, (name, argv[0])
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and err.startswith("error: "), err
            assert str(ckpt / shard) in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "export").exists()
    monkeypatch.delenv("SHARDLIGHT_RESUME_FROM", raising=False)


def test_torch_load_only_with_weights_only():
    import ast

    offenders, calls = [], 0
    for path in list((REPO / "framework").rglob("*.py")) + list((REPO / "callbacks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "load" \
                    and isinstance(func.value, ast.Name) and func.value.id == "torch":
                calls += 1
                if not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords):
                    offenders.append(f"{path}:{node.lineno}")
    assert calls >= 1 and not offenders, offenders


def test_full_params_fsdp1_and_fsdp2(tmp_path):
    out = tmp_path / "seen.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), FP_PORT=str(29500 + os.getpid() % 400))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "full_params_worker.py"), str(out)],
                            env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    for version in ("fsdp1", "fsdp2"):
        s = seen[version]
        assert s["shape"] == [32, 32] and s["embed_shape"] == [512, 32], (version, s)
        assert s["equal_to_init"] and s["discarded"] and s["written_back"] and s["embed_zero"], (version, s)
    assert seen["fsdp1"]["sharded_after"] != [32, 32]  # back to FSDP1's flat shard views
    assert seen["fsdp2"]["sharded_numel"] == 512  # half of q_proj per rank


def test_checkpoint_keys_and_collective_timeout():
    from shardlight.build import build_strategy
    from shardlight.errors import ShardlightError
    from shardlight.recipe import load_recipe

    cfg = load_recipe(None, ["checkpoint.every_n_steps=7", "checkpoint.keep_last=null", "resume=auto",
                             "resume_dir=/x", "export.checkpoint=true", "trainer.collective_timeout_s=45",
                             "trainer.startup_timeout_s=300"])
    assert (cfg.checkpoint.every_n_steps, cfg.checkpoint.keep_last, cfg.resume, cfg.export.checkpoint) == (7, None, "auto", True)
    strategy = build_strategy(cfg)
    # init_process_group waits the start-up timeout (Lightning's _timeout); the collectives, the other
    assert (strategy._timeout, strategy.collective_timeout) == (timedelta(seconds=300), timedelta(seconds=45))
    for bad in ("checkpoint.keep_last=0", "checkpoint.every_n_steps=-1", "trainer.collective_timeout_s=0",
                "trainer.startup_timeout_s=0"):
        with pytest.raises(ShardlightError):
            load_recipe(None, [bad])


def test_resume_discovery_skips_incomplete_checkpoints(tmp_path, monkeypatch):
    from shardlight.checkpoint.resume import find_resume
    from shardlight.checkpoint.store import META, newest_checkpoint
    from shardlight.errors import ShardlightError
    from shardlight.recipe import load_recipe

    def fake(run, step, complete=True):
        d = tmp_path / "runs" / "r" / run / "checkpoints" / f"step-{step}"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"")
        if complete:
            (d / META).write_text(json.dumps({"files": {}}))
        return d

    monkeypatch.setattr("shardlight.checkpoint.resume.verify_checkpoint", lambda path: {})
    old = fake("20260101-000000", 4)
    assert newest_checkpoint(old.parent) == old
    fake("20260101-000000", 6, complete=False)  # a save that never finished
    (old.parent / "latest").write_text("step-6\n")  # stale pointer to it
    assert newest_checkpoint(old.parent) == old
    cfg = load_recipe(None, [f"output_dir={tmp_path / 'runs'}", "name=r", "resume=auto"])
    assert find_resume(cfg) == old
    (tmp_path / "runs" / "r" / "20260202-000000").mkdir()  # a newer run without checkpoints
    assert find_resume(cfg) == old
    cfg.resume_dir = str(tmp_path / "runs" / "r" / "20260202-000000")
    assert find_resume(cfg) is None  # auto: nothing there, start fresh
    cfg.resume = str(tmp_path / "nowhere")
    with pytest.raises(ShardlightError, match="does not exist"):
        find_resume(cfg)
