"""Sharded checkpoints to Hugging Face and back: ``shardlight export``, ``shardlight inspect``, ``full_params``.

``export`` builds the architecture from the checkpoint's ``hf/`` config, lets DCP read the model shards
straight into its parameters (the optimizer state is never read), writes ``save_pretrained`` safetensors,
then reloads the directory with ``AutoModelForCausalLM.from_pretrained`` and compares logits on a fixed
batch with the checkpoint's model. Only one full copy of the weights is held at a time.
``inspect`` reads DCP's ``.metadata`` only: names, full shapes, dtypes, which rank wrote which slice.
"""

from __future__ import annotations

import argparse
import json
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from shardlight.checkpoint_store import (
    HF_DIR,
    checkpoint_in,
    read_dcp_metadata,
    verify_checkpoint,
    verify_metadata_file,
)
from shardlight.errors import ShardlightError

# The LightningModule's HF model is ``model`` and DCP nests the module state under ``model``.
WEIGHT_PREFIX = "model.model."
EXPORT_TOLERANCE = 1e-5
_CHECK_SEED, _CHECK_SHAPE = 1234, (2, 32)


# ---------------------------------------------------------------- full_params
_FSDP1_ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def register_fsdp_root(module: nn.Module) -> None:
    """Remember an FSDP1 root so ``full_params`` on a submodule (the HF model) can unshard the root's
    parameters too (embeddings, final norm and head live in the root's flat parameter)."""
    _FSDP1_ROOTS.add(module)


def _fsdp1_root_for(model: nn.Module) -> Optional[nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP):
        return model
    trainer = getattr(model, "_trainer", None)
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    if isinstance(wrapped, FSDP):
        return wrapped
    for root in list(_FSDP1_ROOTS):
        if any(m is model for m in root.modules()):
            return root
    if any(isinstance(m, FSDP) for m in model.modules()):
        return model
    return None


@contextmanager
def full_params(model: nn.Module, writeback: bool = False) -> Iterator[nn.Module]:
    """Show full, unsharded parameters of an FSDP1 or FSDP2 model (or a module inside one) in the block.

    ``with full_params(module.model): print(module.model.model.layers[0].self_attn.q_proj.weight.shape)``.
    Changes are copied back to the shards only with ``writeback=True``. Every rank must enter (it
    all-gathers); it is for inspecting and editing weights, not for running forward.
    """
    from torch.distributed.tensor import DTensor

    root = _fsdp1_root_for(model)
    if root is not None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(root, writeback=writeback, recurse=True):
            yield model
        return
    swapped: List[tuple] = []
    full_of: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in full_of:  # tied weights stay tied
                    full_of[id(param)] = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
                module._parameters[name] = full_of[id(param)]
                swapped.append((module, name, param))
    try:
        yield model
    finally:
        from torch.distributed.tensor import distribute_tensor

        done = set()
        for module, name, param in swapped:
            full = full_of[id(param)]
            if writeback and id(param) not in done:
                with torch.no_grad():
                    local = distribute_tensor(full.detach().to(param.device), param.device_mesh, param.placements,
                                              src_data_rank=None).to_local()
                    param.to_local().copy_(local)
                done.add(id(param))
            module._parameters[name] = param


# ---------------------------------------------------------------- export
def _check_batch(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_CHECK_SEED)
    return torch.randint(0, vocab_size, _CHECK_SHAPE, generator=generator)


def load_checkpoint_model(checkpoint: Path) -> nn.Module:
    """The HF model of a checkpoint, weights read by DCP in place (one full copy, optimizer untouched)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = Path(checkpoint)
    verify_checkpoint(checkpoint)
    if not (checkpoint / HF_DIR / "config.json").is_file():
        raise ShardlightError(f"checkpoint {checkpoint} has no {HF_DIR}/config.json")
    config = AutoConfig.from_pretrained(str(checkpoint / HF_DIR))
    saved = read_dcp_metadata(checkpoint).metadata.state_dict_metadata
    dtypes = [m.properties.dtype for k, m in saved.items() if k.startswith(WEIGHT_PREFIX) and hasattr(m, "properties")]
    if not dtypes:
        raise ShardlightError(f"checkpoint {checkpoint} holds no model weights under '{WEIGHT_PREFIX}'")
    model = AutoModelForCausalLM.from_config(config, dtype=dtypes[0])
    target = {WEIGHT_PREFIX + n: t for n, t in model.state_dict().items() if WEIGHT_PREFIX + n in saved}
    missing = [n for n, _ in model.named_parameters() if WEIGHT_PREFIX + n not in saved]
    if missing:
        raise ShardlightError(f"checkpoint {checkpoint} lacks weights: {', '.join(missing[:5])}")
    try:
        dcp.load(target, checkpoint_id=str(checkpoint), no_dist=True)
    except Exception as exc:
        raise ShardlightError(f"could not read checkpoint {checkpoint}: {type(exc).__name__}") from None
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def export_checkpoint(checkpoint: Path, out: Path) -> Dict[str, Any]:
    """``save_pretrained`` safetensors + config + generation config + tokenizer, then the reload check."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    model = load_checkpoint_model(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))  # in the checkpoint's dtype
    input_ids = _check_batch(model.config.vocab_size)
    # fp32 reference: the reload below upcasts the same (e.g. bf16) values exactly.
    reference = model.float()(input_ids=input_ids).logits.float()
    del model  # one full copy at a time: the reloaded model comes next
    hf = checkpoint / HF_DIR
    if (hf / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(hf)).save_pretrained(str(out))
    save_file({"input_ids": input_ids, "logits": reference.contiguous()}, str(out / "export_check.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    diff = float((reloaded(input_ids=input_ids).logits.float() - reference).abs().max())
    report = {"checkpoint": str(checkpoint), "out": str(out), "max_abs_diff": diff,
              "tolerance": EXPORT_TOLERANCE, "ok": diff <= EXPORT_TOLERANCE}
    (out / "export_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---------------------------------------------------------------- inspect
def _rank_of(file_name: str) -> Optional[int]:
    if file_name.startswith("__"):
        head = file_name[2:].split("_", 1)[0]
        return int(head) if head.isdigit() else None
    return None


def inspect_checkpoint(checkpoint: Path, include_all: bool = False) -> Dict[str, Any]:
    """Per entry: full shape, dtype, bytes and the slices each rank's file holds; from ``.metadata`` only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint = Path(checkpoint)
    metadata = read_dcp_metadata(checkpoint).metadata
    layout: Dict[str, List[Dict[str, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        layout.setdefault(index.fqn, []).append(
            {"rank": _rank_of(info.relative_path), "file": info.relative_path,
             "offsets": list(index.offset) if index.offset is not None else None})
    entries, totals = [], {"model_bytes": 0, "other_bytes": 0}
    for fqn, meta in sorted(metadata.state_dict_metadata.items()):
        is_weight = fqn.startswith(WEIGHT_PREFIX)
        if not isinstance(meta, TensorStorageMetadata):
            continue
        numel = 1
        for d in meta.size:
            numel *= d
        nbytes = numel * torch.empty((), dtype=meta.properties.dtype).element_size()
        totals["model_bytes" if is_weight else "other_bytes"] += nbytes
        if not (is_weight or include_all):
            continue
        sizes = {tuple(c.offsets): list(c.sizes) for c in meta.chunks}
        shards = []
        for part in sorted(layout.get(fqn, []), key=lambda p: (p["rank"] is None, p["rank"], p["offsets"])):
            offsets = part["offsets"] or [0] * len(meta.size)
            size = sizes.get(tuple(offsets), list(meta.size))
            shards.append({"rank": part["rank"], "file": part["file"],
                           "slices": [[o, o + s] for o, s in zip(offsets, size)]})
        entries.append({"name": fqn[len(WEIGHT_PREFIX):] if is_weight else fqn, "shape": list(meta.size),
                        "dtype": str(meta.properties.dtype).replace("torch.", ""), "bytes": nbytes, "shards": shards})
    totals["total_bytes"] = totals["model_bytes"] + totals["other_bytes"]
    ranks = sorted({r for parts in layout.values() for r in (p["rank"] for p in parts) if r is not None})
    return {"checkpoint": str(checkpoint), "ranks": ranks, "entries": entries, **totals}


def format_inspect(report: Dict[str, Any]) -> str:
    lines = [f"{report['checkpoint']}: {len(report['ranks'])} rank(s) wrote shards"]
    for e in report["entries"]:
        layout = "  ".join(f"r{s['rank']}:" + ",".join(f"{a}:{b}" for a, b in s["slices"]) for s in e["shards"])
        lines.append(f"{e['name']:<60} {str(tuple(e['shape'])):<16} {e['dtype']:<9} {e['bytes']:>12,d} B  {layout}")
    lines.append(f"model weights: {report['model_bytes']:,d} bytes; optimizer and other state: "
                 f"{report['other_bytes']:,d} bytes; total {report['total_bytes']:,d} bytes")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI
def _run_export(args: argparse.Namespace) -> int:
    report = export_checkpoint(Path(args.checkpoint), Path(args.out))
    verdict = "OK" if report["ok"] else "FAILED"
    print(f"exported {report['checkpoint']} -> {report['out']}; reload check (fp32 logits, fixed batch): "
          f"max |diff| = {report['max_abs_diff']:.3g} (tolerance {EXPORT_TOLERANCE:g}): {verdict}")
    return 0 if report["ok"] else 1


def _run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.checkpoint)
    if not path.exists():
        raise ShardlightError(f"checkpoint {path} does not exist")
    found = checkpoint_in(path) or path
    verify_metadata_file(found)
    report = inspect_checkpoint(found, include_all=args.all)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(format_inspect(report))
    return 0


def add_checkpoint_parsers(subparsers: Any) -> None:
    export = subparsers.add_parser(
        "export", help="sharded checkpoint -> Hugging Face save_pretrained dir, verified",
        description="Write save_pretrained safetensors + config + tokenizer from a sharded checkpoint, reload "
        "them with AutoModelForCausalLM.from_pretrained and compare logits with the checkpoint's model.")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoints/step-N dir (or a run dir: its newest)")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.set_defaults(func=lambda a: _run_export(_resolve_checkpoint_arg(a)))
    inspect = subparsers.add_parser(
        "inspect", help="list the tensors of a sharded checkpoint from its metadata",
        description="Parameter names, full shapes, dtypes, shard layout per rank and bytes, from DCP metadata "
        "(no weights are loaded).")
    inspect.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoints/step-N dir (or a run dir)")
    inspect.add_argument("--all", action="store_true", help="also list optimizer state")
    inspect.add_argument("--json", metavar="PATH", help="also write the listing as JSON")
    inspect.set_defaults(func=_run_inspect)


def _resolve_checkpoint_arg(args: argparse.Namespace) -> argparse.Namespace:
    path = Path(args.checkpoint)
    if not path.exists():
        raise ShardlightError(f"checkpoint {path} does not exist")
    found = checkpoint_in(path)
    if found is None:
        raise ShardlightError(f"no complete checkpoint in {path}")
    args.checkpoint = str(found)
    return args

