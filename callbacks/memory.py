"""MemoryHeadroomCallback: memory headroom per rank and the exact bytes of each rank's shard.

``build(config, ctx, shared)`` makes the callback from the recipe's ``callbacks.memory`` section
(``MemoryConfig``).

Per rank, every ``every_n_steps`` optimizer steps and at the end of training:

* CUDA: ``peak`` = ``torch.cuda.max_memory_allocated``, ``reserved`` = ``memory_reserved``,
  ``capacity`` = total from ``mem_get_info``, ``headroom`` = free memory from ``mem_get_info`` minus what
  the caching allocator held above its current reservation at its peak (``max_memory_reserved -
  memory_reserved``): what is still free at this rank's peak;
* CPU: ``peak`` = the process's peak RSS, ``reserved`` = its current RSS, ``capacity`` = physical memory or
  the cgroup limit if lower, ``headroom`` = available memory (psutil; the cgroup's limit minus its usage
  if lower) minus (peak RSS - current RSS);
* ``params``, ``grads``, ``optim``: bytes of the distinct storages behind this rank's parameters, their
  gradients (measured just before the optimizer step) and the optimizer state: the local shard exactly
  (FSDP1 flat shards with their padding; FSDP2 DTensors' local tensors).

Gathered to rank 0 and logged in decimal GB (10^9 bytes): ``memory/headroom_gb`` (the minimum over ranks)
and ``memory/peak_gb``, ``memory/reserved_gb``, ``memory/capacity_gb``, ``memory/params_gb``,
``memory/grads_gb``, ``memory/optim_gb`` (the maximum over ranks), each also as ``_min``/``_max``/``_mean``;
``memory/fullest_rank`` (the rank with the least headroom, ties broken by the highest peak) and, with
``per_rank``, ``memory/rank<R>/<name>``.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from shardlight.callbacks._common import (
    GB,
    Findings,
    RankTable,
    Shared,
    aggregate,
    define_wandb_group,
    gather,
    interval,
    log_metrics,
    per_rank_key,
    root_module,
    storage_bytes,
)
from shardlight.errors import warn
from shardlight.recipe.instrument_sections import MemoryConfig
from shardlight.run_context import RunContext

BYTE_KEYS = ("peak", "reserved", "capacity", "headroom", "params", "grads", "optim")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < 2**60 else None  # cgroup v1 "unlimited" is a huge number


def _memory_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory() -> Optional[Dict[str, int]]:
    """The tightest cgroup memory limit over this process's cgroup and its parents, with its usage.

    Returns ``{"limit", "usage", "inactive_file"}`` or None when no limit applies (v2 and v1).
    """
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: Optional[Dict[str, int]] = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2
            base, limit_f, usage_f, stat_f, inactive = CGROUP_ROOT, "memory.max", "memory.current", "memory.stat", \
                "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit_f, usage_f, stat_f, inactive = CGROUP_ROOT / "memory", "memory.limit_in_bytes", \
                "memory.usage_in_bytes", "memory.stat", "total_inactive_file"
        else:
            continue
        directory = base / rel.lstrip("/")
        candidates = [directory, *directory.parents]
        for candidate in candidates:
            if base not in (candidate, *candidate.parents):
                break
            limit = _read_int(candidate / limit_f)
            if limit is None:
                continue
            usage = _read_int(candidate / usage_f) or 0
            if best is None or limit - usage < best["limit"] - best["usage"]:
                best = {"limit": limit, "usage": usage, "inactive_file": _memory_stat(candidate / stat_f, inactive)}
    return best


def device_memory(device: torch.device) -> Dict[str, int]:
    """peak, reserved, capacity and headroom bytes of this rank's device (CUDA) or process (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        growth = max(0, torch.cuda.max_memory_reserved(device) - reserved)
        return {"peak": torch.cuda.max_memory_allocated(device), "reserved": reserved, "capacity": total,
                "headroom": max(0, free - growth)}
    import psutil

    vm = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peak = max(peak, rss)
    capacity, available = vm.total, vm.available
    cgroup = cgroup_memory()
    if cgroup is not None:
        capacity = min(capacity, cgroup["limit"])
        available = min(available, cgroup["limit"] - cgroup["usage"] + cgroup["inactive_file"])
    return {"peak": peak, "reserved": rss, "capacity": capacity, "headroom": max(0, available - (peak - rss))}


def optimizer_state_tensors(optimizers: List[torch.optim.Optimizer]) -> List[torch.Tensor]:
    tensors = []
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


class MemoryHeadroomCallback(Callback):
    """Memory headroom and shard bytes per rank, gathered to rank 0 (see the module docstring)."""

    def __init__(self, every_n_steps: Optional[int] = None, per_rank: bool = True,
                 table: Optional[RankTable] = None, findings: Optional[Findings] = None) -> None:
        self.every_n_steps = every_n_steps
        self.per_rank = per_rank
        self.table = table
        self.findings = findings
        self._grads_bytes: Optional[int] = None
        self._last_logged = -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        define_wandb_group(trainer, "memory", {"memory/headroom_gb": "min", "memory/peak_gb": "max"})

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        # Gradients exist (sharded, reduced) only between backward and the optimizer step.
        if (trainer.global_step + 1) % interval(trainer, self.every_n_steps) == 0 or self._grads_bytes is None:
            try:
                params = list(root_module(trainer, pl_module).parameters())
                self._grads_bytes = storage_bytes(p.grad for p in params)
            except Exception as exc:  # noqa: BLE001
                warn(f"gradient bytes unavailable: {type(exc).__name__}: {exc}")
                self._grads_bytes = 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step > 0 and step != self._last_logged and step % interval(trainer, self.every_n_steps) == 0:
            self._last_logged = step
            self.collect_and_log(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_logged:
            self._last_logged = trainer.global_step
            self.collect_and_log(trainer, pl_module)

    def local_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Dict[str, int]:
        try:
            snapshot = device_memory(trainer.strategy.root_device)
        except Exception as exc:  # noqa: BLE001
            warn(f"device memory unavailable: {type(exc).__name__}: {exc}")
            snapshot = {}
        root = root_module(trainer, pl_module)
        snapshot["params"] = storage_bytes(root.parameters())
        snapshot["grads"] = self._grads_bytes or 0
        snapshot["optim"] = storage_bytes(optimizer_state_tensors(trainer.optimizers))
        return snapshot

    def collect_and_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            local: Optional[Dict[str, int]] = self.local_snapshot(trainer, pl_module)
        except Exception as exc:  # noqa: BLE001 - the gather below must still happen on every rank
            warn(f"memory snapshot failed: {type(exc).__name__}: {exc}")
            local = None
        snapshots = gather(local)
        if not trainer.is_global_zero:
            return
        per_rank = [None if s is None else {f"memory/{k}_gb": s[k] / GB for k in BYTE_KEYS if k in s}
                    for s in snapshots]
        metrics = aggregate(["memory/headroom_gb"], per_rank, worst="min")
        metrics.update(aggregate([f"memory/{k}_gb" for k in BYTE_KEYS if k != "headroom"], per_rank, worst="max"))
        ranked = [(s.get("headroom", 0), -s.get("peak", 0), r) for r, s in enumerate(snapshots) if s is not None]
        if ranked:
            metrics["memory/fullest_rank"] = float(min(ranked)[2])
        for r, (snapshot, values) in enumerate(zip(snapshots, per_rank)):
            if values is None:
                continue
            if self.per_rank:
                metrics.update({per_rank_key(k, r): v for k, v in values.items()})
            if self.table is not None:
                self.table.update(r, {f"memory/{k}_bytes": snapshot.get(k) for k in BYTE_KEYS})
        if self.findings is not None:
            self.findings.memory = {r: {f"{k}_bytes": s[k] for k in BYTE_KEYS if k in s}
                                    for r, s in enumerate(snapshots) if s is not None}
        log_metrics(trainer, metrics)


def build(config: MemoryConfig, ctx: RunContext, shared: Shared) -> MemoryHeadroomCallback:
    return MemoryHeadroomCallback(every_n_steps=config.every_n_steps, per_rank=config.per_rank, table=shared.table,
                                  findings=shared.findings)
