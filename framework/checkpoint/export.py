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
from typing import Any, Dict, List, Mapping, Set, TypedDict

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shardlight.callbacks.peer_failure import peer_failures_reported
from shardlight.checkpoint.callback import quiet_state_dict_warnings
from shardlight.checkpoint.safetensors_folder import (
    refuse_nonfinite,
    staged_folder,
    verify_safetensors_folder,
    write_file_by_file,
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
        state = sharded_hf_state(trainer.strategy.model, module.model)
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


def sharded_hf_state(root: nn.Module, hf_model: nn.Module) -> Dict[str, torch.Tensor]:
    """The HF model's weights as the ranks hold them (``get_model_state_dict`` of the strategy's root, which
    speaks FSDP1, FSDP2, TP and plain modules alike), under the HF model's names; of tied weights the first
    name only, as ``save_pretrained`` writes them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(root)
    aliases = tied_aliases(hf_model)
    return {name[len(MODULE_PREFIX):]: tensor for name, tensor in state.items()
            if name.startswith(MODULE_PREFIX) and name[len(MODULE_PREFIX):] not in aliases}


def tied_aliases(hf_model: nn.Module) -> Set[str]:
    """The second name of each tied weight of ``hf_model`` (e.g. ``lm_head.weight``), read from its class built
    on the meta device: the state dict of a sharded model gives each name of a tie a tensor of its own (FSDP1
    and FSDP2 alike), and FSDP1 without ``use_orig_params`` hides the original parameters, so the tie is
    taken from the architecture, where ``tie_weights`` makes it one parameter under two names."""
    with torch.device("meta"):
        skeleton = type(hf_model)(copy.deepcopy(hf_model.config))
    names = skeleton.state_dict(keep_vars=True)
    return set(names) - set(first_names(names))


def first_names(state: Mapping[str, Any]) -> Dict[str, Any]:
    """``state`` (a module's own tensors: ``state_dict(keep_vars=True)``) with each tensor under its first name
    only, as ``save_pretrained`` writes tied weights."""
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


# ---------------------------------------------------------------- from a checkpoint
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's 5GB


def write_hf_extras(source: Path, out_dir: Path, config: Any) -> None:
    """Beside the weights in ``out_dir``: ``config`` (its dtype the weights'), and from the checkpoint's ``hf``
    folder ``source`` the generation config and tokenizer, when it has them."""
    config.save_pretrained(str(out_dir))
    if (source / "generation_config.json").is_file():
        shutil.copy2(source / "generation_config.json", out_dir / "generation_config.json")
    if (source / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(out_dir))


@torch.no_grad()
def export_full_checkpoint(path: Path, out_dir: Path,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> CheckpointExportReport:
    """A checkpoint (a ``step-N`` dir, or a run dir: its newest) → a Hugging Face folder, one output file at a
    time (``safetensors_folder.write_file_by_file``): each file's tensors are read from the shards (DCP; the
    optimizer state is never read), refused if non-finite, written, and read back and compared exactly before
    the next, so the process holds one file of at most ``max_shard_bytes``, never the model. The folder is
    assembled beside ``out_dir`` and moved in when every file verified; nothing is written to ``out_dir`` when
    the checkpoint does not verify. The report is also written to ``out_dir/export_report.json``."""
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

    def read(part: List[str]) -> Dict[str, torch.Tensor]:
        tensors = {n: torch.empty(shapes[n].shape, dtype=shapes[n].dtype) for n in part}
        dcp.load({WEIGHT_PREFIX + n: t for n, t in tensors.items()}, checkpoint_id=str(checkpoint), no_dist=True)
        return tensors

    with staged_folder(out_dir) as partial:
        count, worst = write_file_by_file(partial, shapes, read, max_shard_bytes)
        config.dtype = next(t.dtype for t in shapes.values() if t.dtype.is_floating_point)
        write_hf_extras(hf, partial, config)
    share_with_group(out_dir)
    report: CheckpointExportReport = {"checkpoint": str(checkpoint), "out": str(out_dir), "files": count,
                                      "max_abs_diff": worst, "tolerance": 0.0, "ok": worst == 0.0}
    write_json(out_dir / EXPORT_REPORT_FILE, report)
    return report
