"""One Lightning Callback per concern: communication time, memory headroom, throughput.

``build_callbacks(cfg, run_dir)`` (called on every rank) returns the callbacks a recipe's ``callbacks:``
section enables, plus the end-of-run per-rank table. Everything is logged by rank 0 through the trainer's
Lightning loggers (W&B and the CSV twin); see each module's docstring for its metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

from lightning.pytorch.callbacks import Callback

from shardlight.callbacks._common import RankTable, log_table

RANK_TABLE_KEY = "ranks/table"
RANK_TABLE_CSV = "ranks.csv"


class RankTableCallback(Callback):
    """At the end of training: one W&B Table with each rank's latest comm and memory values, and its
    CSV twin ``run_dir/ranks.csv``. Runs after the callbacks that fill the table."""

    def __init__(self, table: RankTable, run_dir: Path) -> None:
        self.table = table
        self.run_dir = Path(run_dir)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.is_global_zero or not self.table.rows:
            return
        log_table(trainer, RANK_TABLE_KEY, self.table.columns(), self.table.as_rows(),
                  csv_path=self.run_dir / RANK_TABLE_CSV)


def _positive(name: str, value: Optional[int], allow_none: bool = False) -> None:
    from shardlight.errors import ShardlightError

    if value is None and allow_none:
        return
    if not isinstance(value, int) or value <= 0:
        raise ShardlightError(f"{name} must be a positive integer{' or null' if allow_none else ''}, got {value}")


def build_callbacks(cfg: Any, run_dir: Any) -> List[Any]:
    """The callbacks the recipe enables (comm, memory, throughput) and the per-rank end table."""
    from shardlight.callbacks.comm import CommTimeCallback
    from shardlight.callbacks.memory import MemoryHeadroomCallback
    from shardlight.callbacks.throughput import ThroughputCallback

    section = getattr(cfg, "callbacks", None)
    if section is None:
        return []
    run_dir = Path(run_dir)
    table = RankTable()
    callbacks: List[Any] = []
    comm, memory, throughput = section.comm, section.memory, section.throughput
    if comm.enabled:
        _positive("callbacks.comm.every_n_steps", comm.every_n_steps)
        _positive("callbacks.comm.active", comm.active)
        if comm.wait < 0 or comm.warmup < 0:
            from shardlight.errors import ShardlightError

            raise ShardlightError("callbacks.comm.wait and callbacks.comm.warmup must not be negative")
        callbacks.append(CommTimeCallback(
            run_dir, every_n_steps=comm.every_n_steps, first_step=comm.first_step, wait=comm.wait,
            warmup=comm.warmup, active=comm.active, per_rank=comm.per_rank, keep_windows=comm.keep_windows,
            table=table,
        ))
    if memory.enabled:
        _positive("callbacks.memory.every_n_steps", memory.every_n_steps, allow_none=True)
        callbacks.append(MemoryHeadroomCallback(every_n_steps=memory.every_n_steps, per_rank=memory.per_rank,
                                                table=table))
    if throughput.enabled:
        _positive("callbacks.throughput.every_n_steps", throughput.every_n_steps, allow_none=True)
        trust = bool(getattr(getattr(cfg, "model", None), "trust_remote_code", False))
        callbacks.append(ThroughputCallback(
            every_n_steps=throughput.every_n_steps, peak_tflops=throughput.peak_tflops,
            peak_tflops_table=dict(throughput.peak_tflops_table or {}), baseline_file=throughput.baseline_file,
            measure_flops=throughput.measure_flops, trust_remote_code=trust,
        ))
    if comm.enabled or memory.enabled:
        callbacks.append(RankTableCallback(table, run_dir))
    return callbacks


__all__ = ["build_callbacks", "RankTableCallback"]
