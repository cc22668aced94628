"""The measuring callbacks of a run, built from the recipe's ``callbacks:`` section.

The registry is that section's dataclass (``shardlight.recipe.instrument_sections.CallbacksConfig``): each field
names a module of this package with ``build(config, ctx, shared) -> Callback``, called on every rank for an
enabled section, in the fields' order, then the per-rank end table (``rank_table``) whenever any is enabled.
Adding a measuring callback: its module, and its section as one field there.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any, List, Optional

from lightning.pytorch.callbacks import Callback

from shardlight.callbacks import rank_table
from shardlight.callbacks._common import Findings, Shared
from shardlight.recipe.instrument_sections import CallbacksConfig
from shardlight.run_context import RunContext

NAMES = [f.name for f in fields(CallbacksConfig)]


def build_enabled(configs: CallbacksConfig, ctx: RunContext, shared: Optional[Shared] = None) -> List[Callback]:
    """The callbacks ``configs`` enables, in the section's order, then the per-rank end table. Every rank."""
    shared = Shared() if shared is None else shared
    callbacks: List[Callback] = []
    for name in NAMES:
        config = getattr(configs, name)
        if config.enabled:
            callbacks.append(importlib.import_module(f"shardlight.callbacks.{name}").build(config, ctx, shared))
    if callbacks:
        callbacks.append(rank_table.build(ctx, shared))  # last: it writes what the others put in the table
    return callbacks


def findings_of(trainer: Any) -> Optional[Findings]:
    """The run's ``Findings`` (rank 0's latest analysis, verdict, memory and throughput), held by its callbacks;
    None when no measuring callback is enabled."""
    for callback in getattr(trainer, "callbacks", []):
        findings = getattr(callback, "findings", None)
        if isinstance(findings, Findings):
            return findings
    return None
