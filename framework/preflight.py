"""Everything that can be checked without training, before any rank is spawned or anything is written: bad
input fails here with one clear line (``ShardlightError``), never as a traceback on every rank."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from shardlight.build import build_hf_config, build_tokenizer
from shardlight.build.optimizer import check_optimizer
from shardlight.data_files import check_data
from shardlight.errors import ShardlightError
from shardlight.recipe import RecipeConfig
from shardlight.strategy import find_block_classes, resolve_recipe_fsdp


def preflight(cfg: RecipeConfig):
    """Everything that can be checked without training: bad input fails here with one clear line."""
    check_data(cfg)
    check_optimizer(cfg.optim, _uses_gpu(cfg))
    tokenizer = build_tokenizer(cfg)
    config = build_hf_config(cfg.model)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and cfg.data.seq_len > max_positions:
        raise ShardlightError(
            f"data.seq_len {cfg.data.seq_len} exceeds the model's maximum positions ({max_positions})"
        )
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ShardlightError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}")
    resolved = resolve_recipe_fsdp(cfg)
    if cfg.trainer.precision.startswith("16") and not _uses_gpu(cfg):
        raise ShardlightError(f"trainer.precision {cfg.trainer.precision} needs a GPU; use bf16-mixed on CPU")
    if resolved.sync_module_states and not _uses_gpu(cfg):
        raise ShardlightError(
            "fsdp.sync_module_states / cpu_ram_efficient_loading need GPUs: FSDP broadcasts module states from "
            "GPU memory only (Accelerate refuses them on CPU too)"
        )
    if resolved.cpu_ram_efficient_loading and (resolved.version == 2 or cfg.model.name_or_path is None):
        raise ShardlightError(
            "fsdp.cpu_ram_efficient_loading needs fsdp_version: 1 and a pretrained model.name_or_path"
        )
    if cfg.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        # A model on the meta device costs no memory and shows the block classes before ranks spawn.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
        find_block_classes(skeleton, cfg.fsdp.transformer_cls_names_to_wrap)
    return tokenizer


def _uses_gpu(cfg: RecipeConfig) -> bool:
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        return True
    return cfg.trainer.accelerator == "auto" and torch.cuda.is_available()
