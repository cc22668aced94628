"""The model: its Hugging Face config (cheap, no weights), the model itself (``from_pretrained`` for a path
or hub id, ``from_config`` for an inline architecture), and the LightningModule that trains it."""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from shardlight.build.optimizer import build_optimization
from shardlight.errors import ShardlightError
from shardlight.model import CausalLMModule
from shardlight.recipe import ModelConfig, RecipeConfig


def build_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The architecture config, without weights (cheap; used by preflight checks and the builders)."""
    if cfg.config is not None:
        spec = dict(cfg.config)
        model_type = spec.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **spec)
        except ValueError as exc:
            raise ShardlightError(f"model.config: {str(exc).splitlines()[0]}") from None
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ShardlightError(
            f"model.name_or_path '{cfg.name_or_path}' could not be loaded: {str(exc).splitlines()[0]}"
        ) from None


def build_hf_model(cfg: ModelConfig, weights: bool = True,
                   config: Optional[PretrainedConfig] = None) -> PreTrainedModel:
    """``from_pretrained`` for a path or hub id, ``from_config`` for an inline config (or ``weights=False``)."""
    kwargs: Dict[str, Any] = {"dtype": getattr(torch, cfg.dtype), "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.config is not None or not weights:
        return AutoModelForCausalLM.from_config(config or build_hf_config(cfg), **kwargs)
    return AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)


def build_module(cfg: RecipeConfig) -> CausalLMModule:
    """The LightningModule, with the recipe's model and optimizer builders."""
    return CausalLMModule(
        cfg,
        make_model=partial(build_hf_model, cfg.model),
        make_optimization=partial(build_optimization, optim=cfg.optim, max_steps=cfg.trainer.max_steps),
    )
