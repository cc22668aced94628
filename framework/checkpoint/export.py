"""Hugging Face export of a full model, in which no process holds the whole model; every file written is
read back and compared exactly.

- :func:`export_full_live` (end of training, every rank): from the shards (``safetensors_folder``: each rank
  writes its slices, the files are assembled one tensor at a time, each rank reads its slices back); the live
  model's logits on the check batch go to ``run_dir/export_check.safetensors`` for whoever reloads it.
- :func:`export_full_checkpoint` (``shardlight export``, one process): one output file at a time, its tensors
  read from the checkpoint's shards by DCP (the optimizer state is never read); report in
  ``OUT/export_report.json``.

Weights with a non-finite value are never exported: one error naming the first such weight, before anything
is written (``safetensors_folder.refuse_nonfinite``). PEFT runs: ``adapter_export``.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, TypedDict

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shardlight.callbacks.peer_failure import peer_failures_reported
from shardlight.checkpoint.callback import quiet_state_dict_warnings
from shardlight.checkpoint.safetensors_folder import (
    INDEX_FILE,
    SINGLE_FILE,
    refuse_nonfinite,
    shard_plan,
    tensor_bytes,
    verify_safetensors_folder,
    write_safetensors_folder,
)
from shardlight.checkpoint.store import (
    HF_DIR,
    MODULE_PREFIX,
    WEIGHT_PREFIX,
    locate_checkpoint,
    read_dcp_metadata,
    verify_checkpoint,
)
from shardlight.errors import ShardlightError
from shardlight.files import share_with_group, write_json

MODEL_DIR = "model"  # in the run dir: the live export
EXPORT_CHECK_FILE = "export_check.safetensors"  # the fixed batch and the reference logits
EXPORT_REPORT_FILE = "export_report.json"
EXPORT_TOLERANCE = 1e-5
CHECK_SEED, CHECK_SHAPE = 1234, (2, 32)


class CheckpointExportReport(TypedDict):
    """``shardlight export`` of a full model: the files are read back and compared exactly."""
    checkpoint: str
    out: str
    files: int
    max_abs_diff: float
    tolerance: float
    ok: bool


def check_batch(vocab_size: int) -> torch.Tensor:
    """The fixed batch every export is checked on."""
    return torch.randint(0, vocab_size, CHECK_SHAPE, generator=torch.Generator().manual_seed(CHECK_SEED))


def _hf_weights(module_state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The LightningModule's state dict → the HF model's (the one key rule; other entries are dropped)."""
    return {k[len(MODULE_PREFIX):]: v for k, v in module_state.items() if k.startswith(MODULE_PREFIX)}


def export_full_live(trainer: Any, module: Any, tokenizer: Any, run_dir: Path,
                     max_shard_bytes: int) -> Dict[str, Any]:
    """The trained model → ``run_dir/model/`` from the shards (``safetensors_folder``: each rank writes its
    slices, the ranks assemble the files one tensor at a time and read their slices back to compare exactly),
    with its config, generation config and tokenizer; the live model's logits on the check batch go to
    ``run_dir/export_check.safetensors`` for anyone who reloads it. No process holds the whole model.

    Every rank must call it; ``export_max_abs_diff`` (the read-back's, over all ranks) is None elsewhere than
    rank 0."""
    run_dir = Path(run_dir)
    model_dir = run_dir / MODEL_DIR
    reference = live_reference_logits(trainer, module)
    with peer_failures_reported(trainer.global_rank), quiet_state_dict_warnings():
        state = sharded_hf_state(trainer.strategy.model)
        refuse_nonfinite(state)
        write_safetensors_folder(state, model_dir, max_shard_bytes)
        if trainer.is_global_zero:
            hf = module.model
            config = copy.deepcopy(hf.config)
            config.dtype = next(t.dtype for t in state.values() if t.dtype.is_floating_point)
            config.save_pretrained(str(model_dir))
            if hf.can_generate() and getattr(hf, "generation_config", None) is not None:
                hf.generation_config.save_pretrained(str(model_dir))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(model_dir))
            input_ids = check_batch(hf.config.vocab_size)
            save_file({"input_ids": input_ids, "logits": reference.contiguous()}, str(run_dir / EXPORT_CHECK_FILE))
        diff = verify_safetensors_folder(state, model_dir)
    if not trainer.is_global_zero:
        return {"model_dir": str(model_dir), "export_max_abs_diff": None}
    share_with_group(model_dir)
    share_with_group(run_dir / EXPORT_CHECK_FILE)
    return {"model_dir": str(model_dir), "export_max_abs_diff": diff}


def sharded_hf_state(root: nn.Module) -> Dict[str, torch.Tensor]:
    """The HF model's weights as the ranks hold them (``get_model_state_dict`` of the strategy's root, which
    speaks FSDP1, FSDP2, TP and plain modules alike), under the HF model's names; of tied weights the first
    name only, as ``save_pretrained`` writes them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(root)
    return {name[len(MODULE_PREFIX):]: tensor for name, tensor in first_names(state).items()
            if name.startswith(MODULE_PREFIX)}


def first_names(state: Mapping[str, Any]) -> Dict[str, Any]:
    """``state`` with each tensor under its first name only, as ``save_pretrained`` writes tied weights."""
    seen: set = set()
    out: Dict[str, Any] = {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def live_reference_logits(trainer: Any, module: Any) -> torch.Tensor:
    """The live sharded model's fp32 logits on the check batch (every rank must call it: a sharded forward)."""
    strategy = trainer.strategy
    root = strategy.model
    was_training = root.training
    # The collectives run after fit, outside Lightning: a dead or hung peer is still one clear line.
    with peer_failures_reported(trainer.global_rank):
        root.eval()
        with torch.no_grad():
            batch = check_batch(module.model.config.vocab_size).to(strategy.root_device)
            reference = root(input_ids=batch).float().cpu()
        root.train(was_training)
    return reference


def reference_and_full_state(trainer: Any, module: Any) -> tuple:
    """``(logits, state)``: the live sharded model's logits on the check batch and its full state dict (on rank 0;
    elsewhere what the strategy returns there). Every rank must call it: both are collectives."""
    reference = live_reference_logits(trainer, module)
    strategy = trainer.strategy
    with peer_failures_reported(trainer.global_rank):
        # ShardlightFSDPStrategy gathers the unsharded weights onto rank 0; any other strategy holds them whole.
        state = strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else module.state_dict()
    return reference, state


# ---------------------------------------------------------------- from a checkpoint
def load_saved_weights(model: torch.nn.Module, checkpoint: Path, saved: Dict[str, Any], wanted: List[str]) -> None:
    """Read the checkpoint's weights into ``model`` in place (one process, no ranks): every parameter named in
    ``wanted`` must be saved; whatever else of the model's state the checkpoint holds is read too."""
    missing = [n for n in wanted if WEIGHT_PREFIX + n not in saved]
    if missing:
        raise ShardlightError(f"checkpoint {checkpoint} lacks weights: {', '.join(missing[:5])}")
    target = {WEIGHT_PREFIX + n: t for n, t in model.state_dict().items() if WEIGHT_PREFIX + n in saved}
    try:
        dcp.load(target, checkpoint_id=str(checkpoint), no_dist=True)
    except Exception as exc:
        raise ShardlightError(f"could not read checkpoint {checkpoint}: {type(exc).__name__}") from None


DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's 5GB
PARTIAL_SUFFIX = ".partial"  # an export being written, beside its folder; renamed in when verified


@torch.no_grad()
def export_full_checkpoint(path: Path, out_dir: Path,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> CheckpointExportReport:
    """A checkpoint (a ``step-N`` dir, or a run dir: its newest) → a Hugging Face folder, one output file at a
    time: each file's tensors are read from the shards (DCP), refused if non-finite, written, and read back
    and compared exactly before the next, so the process holds one file of at most ``max_shard_bytes``,
    never the model. The folder is assembled beside ``out_dir`` and moved in when every file verified;
    nothing is written to ``out_dir`` when the checkpoint does not verify. The report is also written to
    ``out_dir/export_report.json``."""
    from safetensors import safe_open

    checkpoint, out_dir = locate_checkpoint(Path(path)), Path(out_dir)
    verify_checkpoint(checkpoint)
    hf = checkpoint / HF_DIR
    if not (hf / "config.json").is_file():
        raise ShardlightError(f"checkpoint {checkpoint} has no {HF_DIR}/config.json")
    config = AutoConfig.from_pretrained(str(hf))
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = list(first_names(skeleton.state_dict(keep_vars=True)))
    missing = [n for n in names if WEIGHT_PREFIX + n not in saved]
    if missing:
        raise ShardlightError(f"checkpoint {checkpoint} lacks weights: {', '.join(missing[:5])}")
    shapes = {n: torch.empty(saved[WEIGHT_PREFIX + n].size, dtype=saved[WEIGHT_PREFIX + n].properties.dtype,
                             device="meta") for n in names}
    plan = shard_plan(shapes, max_shard_bytes)
    count = max(plan.values())
    partial = out_dir.with_name(out_dir.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map: Dict[str, str] = {}
    worst = 0.0
    try:
        for index in range(1, count + 1):
            part = {n: torch.empty(shapes[n].shape, dtype=shapes[n].dtype) for n in names if plan[n] == index}
            dcp.load({WEIGHT_PREFIX + n: t for n, t in part.items()}, checkpoint_id=str(checkpoint), no_dist=True)
            refuse_nonfinite(part, across_ranks=False)
            file = SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"
            save_file(part, str(partial / file), metadata={"format": "pt"})
            with safe_open(str(partial / file), framework="pt") as f:
                for n, t in part.items():
                    if t.numel():
                        worst = max(worst, float((f.get_tensor(n).float() - t.float()).abs().max()))
            weight_map.update(dict.fromkeys(part, file))
            del part
        if count > 1:
            total = sum(tensor_bytes(t) for t in shapes.values())
            write_json(partial / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        config.dtype = next(t.dtype for t in shapes.values() if t.dtype.is_floating_point)
        config.save_pretrained(str(partial))
        if (hf / "generation_config.json").is_file():
            shutil.copy2(hf / "generation_config.json", partial / "generation_config.json")
        if (hf / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(str(hf)).save_pretrained(str(partial))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in partial.iterdir():
        file.replace(out_dir / file.name)
    partial.rmdir()
    share_with_group(out_dir)
    report: CheckpointExportReport = {"checkpoint": str(checkpoint), "out": str(out_dir), "files": count,
                                      "max_abs_diff": worst, "tolerance": 0.0, "ok": worst == 0.0}
    write_json(out_dir / EXPORT_REPORT_FILE, report)
    return report
