"""The optimizer and learning-rate schedule a recipe's ``optim:`` section names.

The names are the planner's (``adamw``, ``adam``, ``sgd``, ``adamw8bit``), so what ``shardlight plan``
costs is what training runs. Parameter groups are decided before FSDP flattens anything (2-D weights
decay, biases and norms do not).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch

from shardlight.errors import ShardlightError
from shardlight.recipe import OptimConfig
from shardlight.recipe.schema import OPTIMIZERS


def check_optimizer(optim: OptimConfig, uses_gpu: bool) -> None:
    """Before any rank starts: an optimizer this machine cannot run is one clear line."""
    if optim.name == "adamw8bit":
        try:
            import bitsandbytes  # noqa: F401  (optional, GPU-only dependency)
        except ImportError:
            raise ShardlightError("optim.name adamw8bit needs the bitsandbytes package; allowed here: "
                                  "adamw, adam, sgd") from None
        if not uses_gpu:
            raise ShardlightError("optim.name adamw8bit runs on GPUs only; use adamw, adam or sgd on CPU")


def build_optimizer(groups: List[Dict[str, Any]], optim: OptimConfig) -> torch.optim.Optimizer:
    """``groups``: torch parameter groups (each may carry its own ``weight_decay``)."""
    groups = [g for g in groups if g["params"]]
    betas = tuple(optim.betas)
    if optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=optim.eps)
    if optim.name == "adam":
        return torch.optim.Adam(groups, lr=optim.lr, betas=betas, eps=optim.eps)
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=betas[0])
    if optim.name == "adamw8bit":
        import bitsandbytes as bnb  # checked by check_optimizer before spawn

        return bnb.optim.AdamW8bit(groups, lr=optim.lr, betas=betas, eps=optim.eps)
    raise ShardlightError(f"optim.name '{optim.name}' is not allowed; allowed values: {', '.join(OPTIMIZERS)}")


def lr_lambda(optim: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine/linear decay to ``min_lr_ratio`` (or constant)."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor


def build_optimization(groups: List[Dict[str, Any]], optim: OptimConfig, max_steps: int) -> Dict[str, Any]:
    """What ``LightningModule.configure_optimizers`` returns: the optimizer and a per-step schedule."""
    optimizer = build_optimizer(groups, optim)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, max_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
