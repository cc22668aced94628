"""The observability callbacks, one Lightning Callback per concern, and their registry.

* ``comm`` (``CommTimeCallback``): communication vs compute time, from short profiler windows;
* ``memory`` (``MemoryHeadroomCallback``): memory headroom and the local shard's bytes per rank;
* ``throughput`` (``ThroughputCallback``): tokens/s per device, MFU, scaling efficiency;
* ``rank_table`` (``RankTableCallback``): the end-of-run per-rank table; not recipe-configured, added after
  the others whenever any is enabled;
* ``_common``: what they share (``Shared``, the ``RankTable``, gathering and logging helpers);
* ``preemption``: not an observability callback (no recipe section); ``shardlight.build`` adds it.

Each registered module exports

* ``Config``: a dataclass, the recipe section ``callbacks.<name>``; its first field is ``enabled: bool``;
  every field has its help text and ``allowed`` / ``positive`` / ``non_negative`` rules in its metadata
  (checked once, by the recipe validator; ``every_n_steps: null`` means the trainer's
  ``log_every_n_steps``, read at run time with ``_common.interval``);
* ``build(config, ctx, shared) -> Callback``: called on every rank for an enabled section, with the
  ``RunContext`` and the run's ``Shared`` state.

The recipe schema's ``callbacks:`` section is generated from ``REGISTRY``, so adding a callback is one module
(``Config`` + ``build``) and one line in ``REGISTRY``: its keys, validation, did-you-mean and README row
(``make docs``) follow. Callbacks never import the recipe (they sit below it).

Everything is logged by rank 0 through the trainer's Lightning loggers (W&B and the CSV twin); see each
module's docstring for its metrics.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, List, Optional

from lightning.pytorch.callbacks import Callback

from shardlight.callbacks import comm, memory, rank_table, throughput
from shardlight.callbacks._common import Findings, Shared
from shardlight.runtime import RunContext

# Recipe section name → module with ``Config`` and ``build``; built (and run) in this order.
REGISTRY: Dict[str, ModuleType] = {"comm": comm, "memory": memory, "throughput": throughput}


def build_enabled(configs: Any, ctx: RunContext, shared: Optional[Shared] = None) -> List[Callback]:
    """The callbacks ``configs`` (the recipe's ``callbacks:`` section: one ``Config`` per registry name)
    enables, in registry order, then the per-rank end table. Called on every rank."""
    shared = Shared() if shared is None else shared
    callbacks: List[Callback] = []
    for name, module in REGISTRY.items():
        config = getattr(configs, name)
        if config.enabled:
            callbacks.append(module.build(config, ctx, shared))
    if callbacks:
        callbacks.append(rank_table.build(ctx, shared))  # last: it writes what the others put in the table
    return callbacks


def findings_of(trainer: Any) -> Optional[Findings]:
    """The run's ``Findings`` (rank 0's latest analysis, verdict, memory and throughput), held by its callbacks;
    None when no observability callback is enabled."""
    for callback in getattr(trainer, "callbacks", []):
        findings = getattr(callback, "findings", None)
        if isinstance(findings, Findings):
            return findings
    return None


__all__ = ["REGISTRY", "Findings", "Shared", "build_enabled", "findings_of"]
