"""Export of a PEFT (LoRA) run, in which no process holds the whole model: peft's adapter folder
(``PeftModel.from_pretrained`` loads it) and, with ``merge``, the merged full model.

- The adapter (``write_referenced_adapter``): only the trainable weights are gathered (from the live shards, or
  read from a checkpoint); the file is read back and compared exactly, and loaded into the architecture on the
  meta device, where no adapter may be missing or unexpected.
- ``base/``, when the base cannot be referenced (an inline ``model.config`` exists only in the run): the frozen
  weights, written as a full model's are (live: from the shards; from a checkpoint: one file at a time).
- ``merged/`` (``shardlight export --merge``): one output file at a time, each wrapped layer merged by peft's
  own ``merge`` on that layer alone (its base weight and its adapters), so the result is ``merge_and_unload``'s
  bit for bit without the model ever being whole.

Layout of an export dir ``OUT/`` (the live one is ``run_dir/model/``)::

    adapter/     adapter_config.json + adapter_model.safetensors (+ tokenizer); its base_model_name_or_path
                 names the frozen base: the pretrained model.name_or_path, or base/ below
    base/        only when the base cannot be referenced
    merged/      with merge: the full model, base + adapter merged
    export_check.safetensors (the live model's logits on the check batch), export_report.json

``export_live`` and ``export_checkpoint`` here are the package's entry points: they hand a full (non-PEFT)
model to ``export``'s functions of the same names, unchanged.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shardlight.adapters import ADAPTER_NAME, base_is_referenced, is_adapter_model
from shardlight.callbacks.peer_failure import peer_failures_reported
from shardlight.checkpoint.callback import quiet_state_dict_warnings
from shardlight.checkpoint.export import (
    DEFAULT_MAX_SHARD_BYTES,
    EXPORT_CHECK_FILE,
    EXPORT_REPORT_FILE,
    MODEL_DIR,
    _hf_weights,
    check_batch,
    export_full_checkpoint,
    export_full_live,
    live_reference_logits,
    write_hf_extras,
)
from shardlight.checkpoint.safetensors_folder import (
    refuse_nonfinite,
    staged_folder,
    verify_safetensors_folder,
    write_file_by_file,
    write_safetensors_folder,
)
from shardlight.checkpoint.store import (
    HF_DIR,
    META,
    MODULE_PREFIX,
    WEIGHT_PREFIX,
    locate_checkpoint,
    read_dcp_metadata,
    verify_checkpoint,
)
from shardlight.errors import ShardlightError
from shardlight.files import share_with_group, write_json
from shardlight.strategy.sharded_load import checkpoint_keys, file_key

ADAPTER_DIR, BASE_DIR, MERGED_DIR = "adapter", "base", "merged"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where peft keeps a base tensor it wraps: a layer with adapters, a modules_to_save module's frozen original.
_WRAPPED, _ORIGINAL, _TRAINED_COPY = ".base_layer.", ".original_module.", ".modules_to_save.default."

Tensors = Dict[str, torch.Tensor]
Reader = Callable[[List[str]], Tensors]  # read(names) -> those tensors


def _peft_on_meta(config: Any, peft_config: Any) -> Any:
    """The ``PeftModel`` architecture without memory, for weights to be assigned into."""
    from peft import get_peft_model

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
        return get_peft_model(base, copy.deepcopy(peft_config))


def frozen_names(model: Any) -> Dict[str, str]:
    """The base model's weight names (of tied weights the first, as ``save_pretrained`` writes them), each
    with the ``PeftModel``'s name of that frozen tensor (a wrapped layer's ``base_layer``, a
    ``modules_to_save`` module's ``original_module``), in the model's order."""
    return {file_key(name): name for name, p in model.named_parameters() if not p.requires_grad}


def adapter_weights(model: Any, weights: Tensors) -> Tensors:
    """Of a gathered PEFT state dict, the entries of ``model``'s trainable parameters (the adapters and
    ``modules_to_save``: what the adapter file holds). For a quantized base (QLoRA) they are all the export
    takes: the base's gathered entries are bitsandbytes' packed 4-bit storage and quantization state
    (``weight`` as ``[n, 1]``, ``weight.absmax``, ``weight.quant_map``, ...), which fit no full-precision
    module, and the base is referenced by name anyway."""
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    missing = [name for name in trainable if name not in weights]
    if missing:
        raise ShardlightError(f"export is missing adapter weights: {', '.join(missing[:5])}")
    return {name: weights[name] for name in trainable}


@torch.no_grad()
def write_referenced_adapter(state: Tensors, *, config: Any, peft_config: Any, tokenizer: Optional[Any],
                             out_dir: Path, reference_logits: Optional[torch.Tensor],
                             base_model: str) -> Dict[str, Any]:
    """The trainable weights of a gathered PEFT state dict (any other entry, such as a 4-bit base's packed
    storage, is left alone) → peft's adapter folder ``out_dir/adapter`` naming ``base_model``, without any base
    weight. The check reads the file back and compares every tensor exactly, and loads it into the
    ``PeftModel`` architecture on the meta device, where no adapter may be missing or unexpected. The
    reference logits (the live model's; none from a checkpoint) go to ``out_dir/export_check.safetensors`` for
    whoever reloads base + adapter."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    adapter_dir = out_dir / ADAPTER_DIR
    model = _peft_on_meta(config, peft_config)
    weights = adapter_weights(model, _hf_weights(state))
    refuse_nonfinite(weights, across_ranks=False)
    model.load_state_dict(weights, strict=False, assign=True)
    model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_model
    model.save_pretrained(str(adapter_dir))  # the adapter weights only: the base is on the meta device
    if tokenizer is not None:
        tokenizer.save_pretrained(str(adapter_dir))
    check_file = out_dir / EXPORT_CHECK_FILE if reference_logits is not None else None
    if check_file is not None:
        save_file({"input_ids": check_batch(reference_logits.shape[-1]),
                   "logits": reference_logits.detach().float().cpu().contiguous()}, str(check_file))
    expected = get_peft_model_state_dict(model)
    written = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    if written.keys() != expected.keys():
        differ = sorted(written.keys() ^ expected.keys())[:5]
        raise ShardlightError(f"the adapter file differs from the model in {differ}")
    diff = max((float((written[k].float() - expected[k].float()).abs().max()) for k in expected if expected[k].numel()),
               default=0.0)
    fresh = _peft_on_meta(config, peft_config)
    loaded = set_peft_model_state_dict(fresh, written)
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    wrong = list(loaded.unexpected_keys) + [k for k in loaded.missing_keys if k in trainable]
    if wrong:
        raise ShardlightError(f"the adapter does not load into the model: {', '.join(wrong[:5])}")
    share_with_group(out_dir)
    return {"out": str(out_dir), "adapter_dir": str(adapter_dir), "check_file": check_file and str(check_file),
            "base_model": base_model, "max_abs_diff": diff}


# ---------------------------------------------------------------- from the live run
def export_live(trainer: Any, module: Any, tokenizer: Any, run_dir: Path, max_shard_bytes: int) -> Dict[str, Any]:
    """The trained model → ``run_dir/model/`` (``export.export_full_live``, from the shards, in files of at most
    ``max_shard_bytes``); a PEFT model → ``run_dir/model/adapter`` (and ``base/`` for an inline base; no merge:
    ``shardlight export --merge`` writes that). Only the trainable weights are gathered, to rank 0; the frozen
    base, which ``model.name_or_path`` names, never is. Every rank must call it; elsewhere than rank 0
    ``export_max_abs_diff`` is None."""
    if not is_adapter_model(module.model):
        return export_full_live(trainer, module, tokenizer, run_dir, max_shard_bytes)
    from torch.distributed._state_dict_utils import _gather_state_dict

    out_dir = Path(run_dir) / MODEL_DIR
    config, peft_config = module.model.config, module.model.peft_config[ADAPTER_NAME]
    root, device = trainer.strategy.model, trainer.strategy.root_device
    base_model, base_diff = module.cfg.model.name_or_path, 0.0
    reference = live_reference_logits(trainer, module)
    with peer_failures_reported(trainer.global_rank), quiet_state_dict_warnings():
        if not base_is_referenced(module.cfg):
            # An inline base exists only in this run: its frozen weights are written beside the adapter from
            # the shards, as a full model's are.
            frozen = frozen_names(_peft_on_meta(config, peft_config))
            sharded = get_model_state_dict(root)
            base = {name: sharded[MODULE_PREFIX + peft_name] for name, peft_name in frozen.items()}
            refuse_nonfinite(base)
            write_safetensors_folder(base, out_dir / BASE_DIR, max_shard_bytes)
            if trainer.is_global_zero:
                _base_config(config, base).save_pretrained(str(out_dir / BASE_DIR))
            base_diff = verify_safetensors_folder(base, out_dir / BASE_DIR)
            base_model = str((out_dir / BASE_DIR).resolve())
            del sharded, base
        # Sharded first, frozen entries dropped, then gathered: a full state dict of FSDP1 would unshard the
        # whole model before dropping the base.
        sharded = get_model_state_dict(root, options=StateDictOptions(ignore_frozen_params=True))
        state = _gather_state_dict(sharded, device=device, cpu_offload=device.type != "cpu", ranks_only=(0,))
    if not trainer.is_global_zero:
        return {"model_dir": str(out_dir / ADAPTER_DIR), "export_max_abs_diff": None}
    report = write_referenced_adapter(state, config=config, peft_config=peft_config, tokenizer=tokenizer,
                                      out_dir=out_dir, reference_logits=reference, base_model=base_model)
    return {"model_dir": report["adapter_dir"], "export_max_abs_diff": max(report["max_abs_diff"], base_diff)}


def _base_config(config: Any, weights: Tensors) -> Any:
    base = copy.deepcopy(config)
    base.dtype = next(t.dtype for t in weights.values() if t.dtype.is_floating_point)
    return base


# ---------------------------------------------------------------- from a checkpoint
def adapter_metadata(checkpoint: Path) -> Optional[Dict[str, Any]]:
    """What ``shardlight.json`` records of a PEFT checkpoint's adapters and base, or None (a full model)."""
    meta_file = Path(checkpoint) / META
    return json.loads(meta_file.read_text()).get("peft") if meta_file.is_file() else None


def _peft_config(checkpoint: Path) -> Any:
    from peft import LoraConfig

    hf = checkpoint / HF_DIR
    if not (hf / ADAPTER_CONFIG).is_file():
        raise ShardlightError(f"checkpoint {checkpoint} has no {HF_DIR}/{ADAPTER_CONFIG}")
    return LoraConfig.from_pretrained(str(hf))


def _base_folder(name: str, checkpoint: Path) -> Path:
    """The safetensors folder of the pretrained base a checkpoint references: a directory, or a hub id's
    snapshot in the local cache (the run loaded it; an export downloads nothing)."""
    folder: Optional[Path] = Path(name) if os.path.isdir(name) else None
    if folder is None:
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
        except Exception:  # noqa: BLE001 - huggingface_hub raises several kinds for "not here"
            raise ShardlightError(f"checkpoint {checkpoint} references its frozen base {name}, which is neither a "
                                  f"directory nor in the Hugging Face cache") from None
    if checkpoint_keys(folder) is None:
        raise ShardlightError(f"checkpoint {checkpoint} references its frozen base {name}, which holds no "
                              f"safetensors files")
    return folder


def _tensor_reader(checkpoint: Path, saved: Dict[str, Any], base: Optional[Path],
                   dtype: torch.dtype) -> Reader:
    """``read(names)``: a PEFT checkpoint's tensors by the ``PeftModel``'s names; what the checkpoint holds (the
    trainable weights; the frozen base too when it was saved there) read by DCP, the rest from the referenced
    base's safetensors in ``base``, in ``dtype`` (the run's: the base was loaded so)."""
    from safetensors import safe_open

    files = checkpoint_keys(base) if base is not None else {}

    def read(names: List[str]) -> Tensors:
        out = {n: torch.empty(saved[WEIGHT_PREFIX + n].size, dtype=saved[WEIGHT_PREFIX + n].properties.dtype)
               for n in names if WEIGHT_PREFIX + n in saved}
        if out:
            dcp.load({WEIGHT_PREFIX + n: t for n, t in out.items()}, checkpoint_id=str(checkpoint), no_dist=True)
        for name in names:
            if name not in out:
                key = file_key(name)
                if key not in (files or {}):
                    raise ShardlightError(f"checkpoint {checkpoint} lacks weights: {name}")
                with safe_open(str(base / files[key]), framework="pt") as f:
                    out[name] = f.get_tensor(key).to(dtype)
        return out

    return read


def _merged_maker(model: Any, frozen: Dict[str, str], read: Reader) -> Reader:
    """``make(names)``: the merged model's tensors ``names`` (base names). A wrapped layer is merged by peft's own
    ``merge`` on a copy of that layer alone, its base weight and adapters read into it; a ``modules_to_save``
    module is its trained copy; anything else is the frozen base tensor."""

    def source(name: str) -> str:
        return frozen[name].replace(_ORIGINAL, _TRAINED_COPY)

    def make(names: List[str]) -> Tensors:
        layers = {frozen[n].split(_WRAPPED)[0] for n in names if _WRAPPED in frozen[n]}
        wanted = [source(n) for n in names if _WRAPPED not in frozen[n]]
        wanted += [f"{path}.{rel}" for path in sorted(layers)
                   for rel, _ in model.get_submodule(path).named_parameters()]
        values = read(wanted)
        merged: Tensors = {}
        for path in layers:
            layer = copy.deepcopy(model.get_submodule(path))  # on meta: free; the copy gets the real weights
            layer.load_state_dict({k[len(path) + 1:]: v for k, v in values.items() if k.startswith(path + ".")},
                                  assign=True)
            layer.merge(adapter_names=[ADAPTER_NAME])
            merged.update({f"{path}{_WRAPPED}{leaf}": t.detach()
                           for leaf, t in layer.get_base_layer().named_parameters()})
        return {n: merged[frozen[n]] if _WRAPPED in frozen[n] else values[source(n)] for n in names}

    return make


@torch.no_grad()
def export_checkpoint(path: Path, out_dir: Path, merge: bool = False,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Dict[str, Any]:
    """A checkpoint (a ``step-N`` dir, or a run dir: its newest) → a verified export; a full model as
    ``export.export_full_checkpoint``, a PEFT one as ``OUT/adapter`` (+ ``OUT/base`` when the checkpoint holds
    its base, + ``OUT/merged`` with ``merge``), every file read back and compared exactly, no more than one
    output file in memory at a time. The report is also written to ``OUT/export_report.json``; nothing is
    written when the checkpoint does not verify, or the export fails."""
    checkpoint, out_dir = locate_checkpoint(Path(path)), Path(out_dir)
    peft_meta = adapter_metadata(checkpoint)
    if peft_meta is None:
        if merge:
            raise ShardlightError(f"--merge merges LoRA adapters; checkpoint {checkpoint} holds a full model")
        return export_full_checkpoint(checkpoint, out_dir, max_shard_bytes)
    verify_checkpoint(checkpoint)
    hf = checkpoint / HF_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(hf)) if (hf / "tokenizer_config.json").is_file() else None
    config, peft_config = AutoConfig.from_pretrained(str(hf)), _peft_config(checkpoint)
    model = _peft_on_meta(config, peft_config)
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in trainable if WEIGHT_PREFIX + n not in saved]
    if missing:
        raise ShardlightError(f"checkpoint {checkpoint} lacks adapter weights: {', '.join(missing[:5])}")
    dtype = saved[WEIGHT_PREFIX + trainable[0]].properties.dtype
    in_checkpoint = peft_meta["base_in_checkpoint"]
    read = _tensor_reader(checkpoint, saved, None if in_checkpoint or not merge else
                          _base_folder(peft_meta["base_model"], checkpoint), dtype)
    frozen = frozen_names(model)

    def shape(peft_name: str) -> torch.Tensor:
        kept = saved.get(WEIGHT_PREFIX + peft_name)
        return torch.empty(model.get_parameter(peft_name).shape, device="meta",
                           dtype=kept.properties.dtype if kept is not None else dtype)

    report: Dict[str, Any] = {"checkpoint": str(checkpoint), "out": str(out_dir),
                              "adapter_dir": str(out_dir / ADAPTER_DIR), "base_dir": None, "merged_dir": None,
                              "files": {}}
    worst = 0.0
    base_model = peft_meta["base_model"]
    with staged_folder(out_dir) as partial:
        if in_checkpoint:  # an inline base exists only in the checkpoint: written beside the adapter
            shapes = {n: shape(p) for n, p in frozen.items()}
            report["files"]["base"], diff = write_file_by_file(
                partial / BASE_DIR, shapes, lambda names: {n: read([frozen[n]])[frozen[n]] for n in names},
                max_shard_bytes)
            _base_config(config, shapes).save_pretrained(str(partial / BASE_DIR))
            worst, base_model = max(worst, diff), str((out_dir / BASE_DIR).resolve())
            report["base_dir"] = str(out_dir / BASE_DIR)
        state = {MODULE_PREFIX + n: t for n, t in read(trainable).items()}
        adapter = write_referenced_adapter(state, config=config, peft_config=peft_config, tokenizer=tokenizer,
                                           out_dir=partial, reference_logits=None, base_model=base_model)
        worst, report["files"]["adapter"] = max(worst, adapter["max_abs_diff"]), 1
        if merge:
            shapes = {n: shape(p.replace(_ORIGINAL, _TRAINED_COPY)) for n, p in frozen.items()}
            report["files"]["merged"], diff = write_file_by_file(
                partial / MERGED_DIR, shapes, _merged_maker(model, frozen, read), max_shard_bytes)
            write_hf_extras(hf, partial / MERGED_DIR, _base_config(config, shapes))
            worst = max(worst, diff)
            report["merged_dir"] = str(out_dir / MERGED_DIR)
    share_with_group(out_dir)
    report.update(base_model=base_model, read_back=True, max_abs_diff=worst, tolerance=0.0, ok=worst == 0.0)
    write_json(out_dir / EXPORT_REPORT_FILE, report)
    return report
