"""Export of a PEFT (LoRA) run: an adapter directory ``PeftModel.from_pretrained`` loads and, with ``merge``,
the merged full model (``merge_and_unload``, ``save_pretrained`` safetensors).

- The end of a run on a pretrained base (``write_referenced_adapter``): only the trainable weights are
  gathered; the adapter file is read back and compared exactly, and loaded into the architecture on the meta
  device. No process holds the base.
- A run whose base exists only in the run (inline ``model.config``), and ``shardlight export`` of a PEFT
  checkpoint (``export_adapter_and_verify``): the model is built in one process, the adapter (and the merged
  model) reloaded in fp32 and its logits on the fixed check batch compared with the trained model's;
  ``max |diff|`` must be within ``EXPORT_TOLERANCE``.

Layout of an export dir ``OUT/`` (the live one is ``run_dir/model/``)::

    adapter/     adapter_config.json + adapter_model.safetensors (+ tokenizer); its base_model_name_or_path
                 names the frozen base: the pretrained model.name_or_path, or base/ below
    base/        only when the base cannot be referenced (an inline model.config exists only in the run)
    merged/      with merge: the full model, base + adapter merged
    export_check.safetensors, export_report.json

``export_live`` and ``export_checkpoint`` here are the package's entry points: they hand a full (non-PEFT)
model to ``export``'s functions of the same names, unchanged.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shardlight.adapters import ADAPTER_NAME, base_is_referenced, is_adapter_model
from shardlight.callbacks.peer_failure import peer_failures_reported
from shardlight.checkpoint.export import (
    DEFAULT_MAX_SHARD_BYTES,
    EXPORT_CHECK_FILE,
    EXPORT_REPORT_FILE,
    EXPORT_TOLERANCE,
    MODEL_DIR,
    _hf_weights,
    check_batch,
    export_full_checkpoint,
    export_full_live,
    live_reference_logits,
    load_saved_weights,
    reference_and_full_state,
)
from shardlight.checkpoint.safetensors_folder import refuse_nonfinite
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

ADAPTER_DIR, BASE_DIR, MERGED_DIR = "adapter", "base", "merged"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _max_abs_diff(model: torch.nn.Module, input_ids: torch.Tensor, reference: torch.Tensor) -> float:
    return float((model(input_ids=input_ids).logits.float().cpu() - reference).abs().max())


@torch.no_grad()
def export_adapter_and_verify(model: Any, tokenizer: Optional[Any], out_dir: Path, reference_logits: torch.Tensor,
                              *, base_model: Optional[str], merge: bool) -> Dict[str, Any]:
    """``model``: the trained ``PeftModel`` with real weights, in one process (it is consumed: the base copy or
    the merge may change it). ``base_model``: the pretrained base to reference, or None to write ``base/``.
    Returns the report (``max_abs_diff``: the worse of the adapter's and the merged model's)."""
    from peft import PeftModel

    refuse_nonfinite(model.state_dict(), across_ranks=False)
    out_dir = Path(out_dir)
    adapter_dir, base_dir, merged_dir = out_dir / ADAPTER_DIR, out_dir / BASE_DIR, out_dir / MERGED_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    if base_model is None:
        # unload() strips the adapters from a copy; the copy's modules_to_save keep their trained values,
        # which the adapter overrides again on load anyway.
        copy.deepcopy(model).unload().save_pretrained(str(base_dir))
    model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_model or str(base_dir.resolve())
    model.save_pretrained(str(adapter_dir))
    del model
    if tokenizer is not None:
        tokenizer.save_pretrained(str(adapter_dir))
    input_ids = check_batch(reference_logits.shape[-1])
    reference = reference_logits.detach().float().cpu().contiguous()
    check_file = out_dir / EXPORT_CHECK_FILE
    save_file({"input_ids": input_ids, "logits": reference}, str(check_file))

    base = AutoModelForCausalLM.from_pretrained(base_model or str(base_dir), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    report: Dict[str, Any] = {"out": str(out_dir), "adapter_dir": str(adapter_dir), "check_file": str(check_file),
                              "adapter_max_abs_diff": _max_abs_diff(reloaded, input_ids.to(base.device), reference),
                              "merged_dir": None, "merged_max_abs_diff": None, "tolerance": EXPORT_TOLERANCE}
    if merge:
        reloaded.merge_and_unload().save_pretrained(str(merged_dir))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(merged_dir))
        del reloaded, base
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
        report.update(merged_dir=str(merged_dir), merged_max_abs_diff=_max_abs_diff(merged, input_ids, reference))
    diffs = [d for d in (report["adapter_max_abs_diff"], report["merged_max_abs_diff"]) if d is not None]
    report.update(max_abs_diff=max(diffs), ok=max(diffs) <= EXPORT_TOLERANCE)
    return report


def _peft_on_meta(config: Any, peft_config: Any) -> Any:
    """The ``PeftModel`` architecture without memory, for weights to be assigned into."""
    from peft import get_peft_model

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
        return get_peft_model(base, copy.deepcopy(peft_config))


def adapter_weights(model: Any, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
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


def export_adapter_state(state: Dict[str, torch.Tensor], *, config: Any, peft_config: Any, tokenizer: Optional[Any],
                         out_dir: Path, reference_logits: torch.Tensor) -> Dict[str, Any]:
    """A gathered PEFT LightningModule state dict of a run whose base exists only in the run (an inline
    ``model.config``; emptied here) → ``out_dir/adapter`` and ``out_dir/base``, verified by
    ``export_adapter_and_verify``."""
    model = _peft_on_meta(config, peft_config)
    model.load_state_dict(_hf_weights(state), strict=True, assign=True)
    state.clear()
    return export_adapter_and_verify(model, tokenizer, out_dir, reference_logits, base_model=None, merge=False)


@torch.no_grad()
def write_referenced_adapter(state: Dict[str, torch.Tensor], *, config: Any, peft_config: Any,
                             tokenizer: Optional[Any], out_dir: Path, reference_logits: Optional[torch.Tensor],
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
            "adapter_max_abs_diff": diff, "merged_dir": None, "merged_max_abs_diff": None, "read_back": True,
            "max_abs_diff": diff, "tolerance": 0.0, "ok": diff == 0.0}


# ---------------------------------------------------------------- from the live run
def export_live(trainer: Any, module: Any, tokenizer: Any, run_dir: Path, max_shard_bytes: int) -> Dict[str, Any]:
    """The trained model → ``run_dir/model/`` (``export.export_full_live``, from the shards, in files of at most
    ``max_shard_bytes``); a PEFT model → ``run_dir/model/adapter`` (no merge: ``shardlight export --merge``
    writes that), verified against the live sharded model's logits. Every rank must call it; elsewhere than
    rank 0 ``export_max_abs_diff`` is None."""
    if not is_adapter_model(module.model):
        return export_full_live(trainer, module, tokenizer, run_dir, max_shard_bytes)
    out_dir = Path(run_dir) / MODEL_DIR
    config, peft_config = module.model.config, module.model.peft_config[ADAPTER_NAME]
    if base_is_referenced(module.cfg):
        # Adapters on a pretrained base (a 70B's LoRA run): only the trainable weights are gathered, to rank 0;
        # the frozen base, which model.name_or_path names, never is.
        reference = live_reference_logits(trainer, module)
        with peer_failures_reported(trainer.global_rank):
            # Sharded first, frozen entries dropped, then gathered: a full state dict of FSDP1 would unshard
            # the whole model before dropping the base.
            from torch.distributed._state_dict_utils import _gather_state_dict

            device = trainer.strategy.root_device
            sharded = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(ignore_frozen_params=True))
            state = _gather_state_dict(sharded, device=device, cpu_offload=device.type != "cpu", ranks_only=(0,))
        if not trainer.is_global_zero:
            return {"model_dir": str(out_dir / ADAPTER_DIR), "export_max_abs_diff": None}
        report = write_referenced_adapter(state, config=config, peft_config=peft_config, tokenizer=tokenizer,
                                          out_dir=out_dir, reference_logits=reference,
                                          base_model=module.cfg.model.name_or_path)
        return {"model_dir": report["adapter_dir"], "export_max_abs_diff": report["max_abs_diff"]}
    # An inline base exists only in this run: it is gathered and written to base/ beside the adapter.
    reference, state = reference_and_full_state(trainer, module)
    if not trainer.is_global_zero:
        return {"model_dir": str(out_dir / ADAPTER_DIR), "export_max_abs_diff": None}
    report = export_adapter_state(state, config=config, peft_config=peft_config, tokenizer=tokenizer,
                                  out_dir=out_dir, reference_logits=reference)
    return {"model_dir": report["adapter_dir"], "export_max_abs_diff": report["max_abs_diff"]}


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


def _trainable_from_checkpoint(checkpoint: Path, config: Any, peft_config: Any) -> Dict[str, torch.Tensor]:
    """The trainable weights of a PEFT checkpoint that references its base (verified here), read by DCP,
    under the LightningModule's names (what the live export gathers)."""
    verify_checkpoint(checkpoint)
    model = _peft_on_meta(config, peft_config)
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in trainable if WEIGHT_PREFIX + n not in saved]
    if missing:
        raise ShardlightError(f"checkpoint {checkpoint} lacks adapter weights: {', '.join(missing[:5])}")
    state = {WEIGHT_PREFIX + n: torch.empty(saved[WEIGHT_PREFIX + n].size,
                                             dtype=saved[WEIGHT_PREFIX + n].properties.dtype) for n in trainable}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return {MODULE_PREFIX + k[len(WEIGHT_PREFIX):]: v for k, v in state.items()}


def load_adapter_checkpoint_model(checkpoint: Path) -> Any:
    """The ``PeftModel`` of a verified PEFT checkpoint: the base (loaded from its reference, or from the
    checkpoint when it was saved there) and the trained weights read by DCP in place."""
    from peft import get_peft_model

    meta = verify_checkpoint(checkpoint)["peft"]
    hf = checkpoint / HF_DIR
    peft_config = _peft_config(checkpoint)
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    dtypes = [m.properties.dtype for k, m in saved.items() if k.startswith(WEIGHT_PREFIX) and hasattr(m, "properties")]
    if not dtypes:
        raise ShardlightError(f"checkpoint {checkpoint} holds no model weights under '{WEIGHT_PREFIX}'")
    if meta["base_model"] is not None and not meta["base_in_checkpoint"]:
        try:
            base = AutoModelForCausalLM.from_pretrained(meta["base_model"], dtype=dtypes[0])
        except OSError as exc:
            raise ShardlightError(f"checkpoint {checkpoint} references its frozen base {meta['base_model']}, "
                                  f"which cannot be loaded: {str(exc).splitlines()[0]}") from None
    else:
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(hf)), dtype=dtypes[0])
    model = get_peft_model(base, peft_config)
    wanted = [n for n, p in model.named_parameters() if p.requires_grad or meta["base_in_checkpoint"]]
    load_saved_weights(model, checkpoint, saved, wanted)
    base.tie_weights()
    return model.eval()


@torch.no_grad()
def export_checkpoint(path: Path, out_dir: Path, merge: bool = False,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Dict[str, Any]:
    """A checkpoint (a ``step-N`` dir, or a run dir: its newest) → a verified export; a full model as
    ``export.export_full_checkpoint``, a PEFT one as ``OUT/adapter`` (+ ``OUT/merged`` with ``merge``). The report
    is also written to ``OUT/export_report.json``; nothing is written when the checkpoint does not verify."""
    checkpoint, out_dir = locate_checkpoint(Path(path)), Path(out_dir)
    peft_meta = adapter_metadata(checkpoint)
    if peft_meta is None:
        if merge:
            raise ShardlightError(f"--merge merges LoRA adapters; checkpoint {checkpoint} holds a full model")
        return export_full_checkpoint(checkpoint, out_dir, max_shard_bytes)
    hf = checkpoint / HF_DIR
    tokenizer = AutoTokenizer.from_pretrained(str(hf)) if (hf / "tokenizer_config.json").is_file() else None
    if not merge and not peft_meta["base_in_checkpoint"]:
        # The checkpoint holds the trainable weights alone: they are the adapter; the base is never loaded.
        config, peft_config = AutoConfig.from_pretrained(str(hf)), _peft_config(checkpoint)
        report = {"checkpoint": str(checkpoint), **write_referenced_adapter(
            _trainable_from_checkpoint(checkpoint, config, peft_config), config=config, peft_config=peft_config,
            tokenizer=tokenizer, out_dir=out_dir, reference_logits=None, base_model=peft_meta["base_model"])}
        write_json(out_dir / EXPORT_REPORT_FILE, report)
        return report
    model = load_adapter_checkpoint_model(checkpoint)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    reference = model.float()(input_ids=check_batch(model.config.vocab_size)).logits
    model.to(dtype)  # the export keeps the run's weight dtype (the fp32 reference upcast the same values)
    base_model = None if peft_meta["base_in_checkpoint"] else peft_meta["base_model"]
    report = {"checkpoint": str(checkpoint),
              **export_adapter_and_verify(model, tokenizer, out_dir, reference, base_model=base_model, merge=merge)}
    write_json(out_dir / EXPORT_REPORT_FILE, report)
    return report
