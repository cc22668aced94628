"""What the observability callbacks share: the ``Shared`` state one run's callbacks are built with (the
per-rank ``RankTable``), and helpers: cross-rank gathering, logging through Lightning's loggers, W&B
grouping, the logging interval, local tensor bytes. Nothing here is a callback."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Tuple

import lightning.pytorch as pl
import torch

from shardlight.collectives import all_gather_objects, dist_ready, gather_objects_to_zero
from shardlight.errors import warn

GB = 1e9  # the *_gb metrics are decimal gigabytes (10^9 bytes)
DEFAULT_INTERVAL = 50  # steps, when neither the callback nor the trainer sets one


def rank() -> int:
    return torch.distributed.get_rank() if dist_ready() else 0


# The callbacks' names for the collectives module's helpers.
gather = all_gather_objects
gather_to_zero = gather_objects_to_zero


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def interval(trainer: pl.Trainer, every_n_steps: Optional[int]) -> int:
    """Steps between a callback's logs: its ``every_n_steps``, or (null) the trainer's ``log_every_n_steps``."""
    return max(1, every_n_steps or trainer.log_every_n_steps or DEFAULT_INTERVAL)


def log_metrics(trainer: pl.Trainer, metrics: Dict[str, float], step: Optional[int] = None) -> None:
    """Rank 0 hands ``metrics`` to every Lightning logger (W&B and the CSV twin); one failing logger
    is a warning and does not keep the others from getting the metrics."""
    if not trainer.is_global_zero or not metrics:
        return
    clean = {k: float(v) for k, v in metrics.items() if finite(v)}
    step = trainer.global_step if step is None else step
    for logger in trainer.loggers:
        try:
            logger.log_metrics(clean, step=step)
        except Exception as exc:  # noqa: BLE001 - a logger must never stop training
            warn(f"{type(logger).__name__} could not log metrics: {type(exc).__name__}: {exc}")


def wandb_runs(trainer: pl.Trainer) -> List[Any]:
    """The live W&B runs behind the trainer's loggers (rank 0 only; none when W&B is off or broken)."""
    if not trainer.is_global_zero:
        return []
    from lightning.pytorch.loggers import WandbLogger

    runs = []
    for logger in trainer.loggers:
        if not isinstance(logger, WandbLogger):
            continue
        try:
            run = logger.experiment
        except Exception as exc:  # noqa: BLE001
            warn(f"W&B unavailable ({type(exc).__name__}: {exc}); metrics still go to the CSV logger")
            continue
        if hasattr(run, "define_metric") and hasattr(run, "log") and "DummyExperiment" not in type(run).__name__:
            runs.append(run)
    return runs


def define_wandb_group(trainer: pl.Trainer, prefix: str, summaries: Optional[Dict[str, str]] = None) -> None:
    """``define_metric`` so a group (``comm/*``, ``memory/*``, ...) shares the step axis and panel section."""
    for run in wandb_runs(trainer):
        try:
            run.define_metric(f"{prefix}/*", step_metric="trainer/global_step", step_sync=True)
            for key, summary in (summaries or {}).items():
                run.define_metric(key, step_metric="trainer/global_step", summary=summary)
        except Exception as exc:  # noqa: BLE001
            warn(f"W&B define_metric for {prefix}/* failed: {type(exc).__name__}: {exc}")


def aggregate(prefix_metrics: Iterable[str], per_rank: List[Optional[Dict[str, float]]],
              worst: str = "max") -> Dict[str, float]:
    """``key`` (the worst rank's value), ``key_min``, ``key_max``, ``key_mean`` over ranks with a value."""
    out: Dict[str, float] = {}
    for key in prefix_metrics:
        values = [r[key] for r in per_rank if r is not None and finite(r.get(key))]
        if not values:
            continue
        out[f"{key}_min"] = min(values)
        out[f"{key}_max"] = max(values)
        out[f"{key}_mean"] = sum(values) / len(values)
        out[key] = min(values) if worst == "min" else max(values) if worst == "max" else out[f"{key}_mean"]
    return out


def per_rank_key(key: str, rank_index: int) -> str:
    """``comm/total_ms`` → ``comm/rank0/total_ms`` (same W&B section as the aggregate)."""
    group, _, name = key.partition("/")
    return f"{group}/rank{rank_index}/{name}"


def local_tensor(tensor: Any) -> Optional[torch.Tensor]:
    """The rank-local part of a parameter/gradient/state tensor (FSDP2 DTensor → ``to_local()``)."""
    if tensor is None or not isinstance(tensor, torch.Tensor):
        return None
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None:
        try:
            tensor = to_local()
        except Exception:  # noqa: BLE001
            return None
    return tensor


def storage_bytes(tensors: Iterable[Any], seen: Optional[set] = None) -> int:
    """Bytes of the distinct storages behind ``tensors``: exact local memory, each storage once.

    FSDP1 (``use_orig_params``) parameters are views into one flat shard per unit, so the flat shard
    (with its padding) is what is counted; FSDP2 DTensors count their padded local shard.
    """
    seen = set() if seen is None else seen
    total = 0
    for raw in tensors:
        tensor = local_tensor(raw)
        if tensor is None or tensor.device.type == "meta":
            continue
        try:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = ("id", id(tensor)), tensor.numel() * tensor.element_size()
        if nbytes == 0 or key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def root_module(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.nn.Module:
    """The module that owns the (possibly sharded) parameters: the FSDP1 root, or the LightningModule."""
    model = getattr(trainer.strategy, "model", None)
    return model if model is not None else pl_module


class RankTable:
    """Latest per-rank values pushed by the callbacks; written once at the end as a W&B Table + CSV."""

    def __init__(self) -> None:
        self.rows: Dict[int, Dict[str, Any]] = {}

    def update(self, rank_index: int, values: Dict[str, Any]) -> None:
        self.rows.setdefault(rank_index, {}).update(values)

    def columns(self) -> List[str]:
        keys: List[str] = []
        for row in self.rows.values():
            keys.extend(k for k in row if k not in keys)
        return ["rank"] + keys

    def as_rows(self) -> List[List[Any]]:
        columns = self.columns()[1:]
        return [[r] + [self.rows[r].get(c) for c in columns] for r in sorted(self.rows)]


@dataclass
class Findings:
    """Rank 0's latest cross-rank facts, what the diagnosis reads: each callback fills its own part right
    after its gather (other ranks leave it empty). The comm window's diagnosis reads the others' latest.

    Arguments:
        memory: rank -> ``headroom_bytes``, ``capacity_bytes``, ``peak_bytes``, ``params_bytes``,
            ``grads_bytes``, ``optim_bytes`` (the memory callback's latest snapshot).
        throughput: ``tokens_per_sec_per_device`` and ``scaling_efficiency`` (when a baseline is known).
        analysis: the latest comm window's trace analysis, combined across ranks (``shardlight.trace``).
        windows: every analysed window, ``(start step, analysis)``, oldest first (the latest ``MAX_WINDOWS``):
            the end-of-run verdict is judged across them.
        run_start: the run's first step (a resumed run's resume step): which windows are warm-up.
    """

    MAX_WINDOWS: ClassVar[int] = 64

    memory: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    throughput: Dict[str, Any] = field(default_factory=dict)
    analysis: Optional[Dict[str, Any]] = None
    windows: List[Tuple[int, Dict[str, Any]]] = field(default_factory=list)
    run_start: int = 0

    def add_window(self, start: int, analysis: Dict[str, Any]) -> None:
        self.analysis = analysis
        self.windows = (self.windows + [(start, analysis)])[-self.MAX_WINDOWS:]


@dataclass
class Shared:
    """What one run's callbacks share, made once by ``build_enabled`` and handed to every ``build``.

    Arguments:
        table: the per-rank table (comm and memory fill it; ``rank_table`` writes it at the end).
        findings: rank 0's latest cross-rank facts, the diagnosis's inputs.
        trust_remote_code: the model's ``trust_remote_code`` (the throughput callback rebuilds the
            architecture on the meta device to count FLOPs).
        diagnosis: the recipe's ``diagnosis:`` section (``DiagnosisConfig``; None: its defaults).
        micro_batch_size: what the diagnosis's advice is about (``trainer.micro_batch_size``).
        tp_size: the tensor-parallel degree: that many ranks share each batch (throughput counts it once).
        collective_timeout_s: torch's collective timeout (``trainer.collective_timeout_s``): the hang watchdog
            acts before it.
        The few facts callbacks need from outside their ``callbacks:`` section, handed in, never imported.
    """

    table: RankTable = field(default_factory=RankTable)
    findings: Findings = field(default_factory=Findings)
    trust_remote_code: bool = False
    diagnosis: Any = None
    micro_batch_size: Optional[int] = None
    tp_size: int = 1
    collective_timeout_s: float = 1800.0
