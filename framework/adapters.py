"""PEFT adapters, the recipe's ``peft:`` section, with Hugging Face ``peft``: its ``LoraConfig``, applying it
to a model, the checks that run before any rank starts, and what a checkpoint must hold of the frozen base.

peft wraps the model (``PeftModel`` → ``LoraModel`` → the HF model) but leaves the transformer block classes
as they are, so FSDP still wraps one unit per block, each now holding frozen base weights next to trainable
``lora_A``/``lora_B``. ``qlora`` is the same adapters on a base loaded in 4 bits (bitsandbytes, GPUs only).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, List, Optional

import torch
from torch import nn

from shardlight.errors import ShardlightError, first_line
from shardlight.recipe import PeftConfig, RecipeConfig

# bitsandbytes (QLoRA's 4-bit base; peft imports it whenever it is installed) looks for an optional CPU kernel
# on the Hub at import and warns, on every CPU with AVX512-BF16, when it cannot have it: offline it never can.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# The one adapter a run trains (peft's default name; it appears in parameter names as ``.default.``).
ADAPTER_NAME = "default"


def lora_config(peft_cfg: PeftConfig) -> Any:
    """peft's ``LoraConfig`` for the recipe (``target_modules`` null: peft's default for the architecture)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=peft_cfg.r,
        lora_alpha=peft_cfg.alpha,
        lora_dropout=peft_cfg.dropout,
        target_modules=list(peft_cfg.target_modules) if peft_cfg.target_modules else None,
        modules_to_save=list(peft_cfg.modules_to_save) or None,
    )


def apply_adapters(model: nn.Module, *, peft_cfg: PeftConfig, seed: int) -> nn.Module:
    """``model`` with the recipe's adapters (only they, and ``modules_to_save``, train); unchanged without.

    The adapters' init is peft's own (``reset_lora_parameters``: ``lora_A`` random, ``lora_B`` zero), drawn
    from ``seed`` in a forked RNG after they exist, so every rank, a resumed run and a single-process reference
    get the same adapters whatever consumed the global RNG before, and a base on the meta device (a sharded
    load's skeleton, whose adapters peft puts on meta with it) gets them too, made real on the CPU."""
    if peft_cfg.method is None:
        return model
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    try:
        model = get_peft_model(model, lora_config(peft_cfg))
    except (ValueError, TypeError, KeyError) as exc:  # e.g. no default targets for this architecture
        raise ShardlightError(f"peft: {first_line(exc)}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
            for part in (getattr(layer, name) for name in layer.adapter_layer_names):
                if ADAPTER_NAME in part and any(p.is_meta for p in part.parameters()):
                    part.to_empty(device="cpu")
            layer.reset_lora_parameters(ADAPTER_NAME, True)
    return model


def is_adapter_model(model: Any) -> bool:
    """Whether ``model`` is a ``PeftModel`` (what ``apply_adapters`` returns for ``peft.method`` set)."""
    # A PeftModel exists only once peft is imported: a full model's checkpoint saves skip peft's import (about
    # a second on every rank of every run).
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_module_names(model: nn.Module) -> List[str]:
    """The distinct last names of the model's Linear modules (what ``target_modules`` may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and isinstance(module, nn.Linear)})


def _names_something(model: nn.Module, target: str) -> bool:
    # peft's rule for a list of names: a module matches when its full name is the target or ends with it.
    return any(name == target or name.endswith("." + target) for name, _ in model.named_modules())


def check_adapter_targets(model: nn.Module, *, peft_cfg: PeftConfig) -> None:
    """Every name in ``target_modules`` and ``modules_to_save`` names a module of ``model`` (the bare HF
    model, e.g. on the meta device); peft itself only refuses when *none* matches, silently dropping typos."""
    if peft_cfg.method is None:
        return
    for key in ("target_modules", "modules_to_save"):
        names = getattr(peft_cfg, key) or []
        missing = [n for n in names if not _names_something(model, n)]
        if missing:
            raise ShardlightError(
                f"peft.{key}: {', '.join(missing)} not found in the model; Linear modules present: "
                f"{', '.join(linear_module_names(model))}")


def check_adapter_machine(cfg: RecipeConfig, *, uses_gpu: bool) -> None:
    """QLoRA's 4-bit base needs bitsandbytes, a GPU and a pretrained checkpoint to quantize."""
    if cfg.peft.method != "qlora":
        return
    if not uses_gpu:
        raise ShardlightError("peft.method qlora loads the base model in 4 bits with bitsandbytes, which needs "
                              "a GPU; use peft.method lora on CPU")
    if cfg.model.name_or_path is None:
        raise ShardlightError("peft.method qlora quantizes pretrained weights; set model.name_or_path "
                              "(an inline model.config has none)")
    try:
        import bitsandbytes  # noqa: F401  (optional, GPU-only dependency)
    except ImportError:
        raise ShardlightError("peft.method qlora needs the bitsandbytes package; install it, or use "
                              "peft.method lora") from None


def quantization_config(cfg: RecipeConfig) -> Optional[Any]:
    """For ``qlora``: NF4 weights with double quantization, computed in bf16, stored in ``model.dtype`` so FSDP
    can flatten and shard the 4-bit weights with the rest of each unit (FSDP-QLoRA); else None."""
    if cfg.peft.method != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_quant_storage=getattr(torch, cfg.model.dtype))


def base_is_referenced(cfg: RecipeConfig) -> bool:
    """Whether checkpoints may leave the frozen base out and reference it: adapters on pretrained weights,
    which any process can load again. An inline ``model.config`` base exists only in the run, so it is saved."""
    return cfg.peft.method is not None and cfg.model.name_or_path is not None
