"""RankTableCallback: the end-of-run per-rank table.

At the end of training, rank 0 writes each rank's latest comm and memory values (what those callbacks put
in ``Shared.table``) as one W&B Table ``ranks/table`` and its CSV twin ``run_dir/ranks.csv``. It is not
recipe-configured: ``build_enabled`` adds it after the callbacks that fill the table; an empty table
writes nothing.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from shardlight.callbacks._common import RankTable, Shared, wandb_runs
from shardlight.errors import warn
from shardlight.run_context import RunContext

RANK_TABLE_KEY = "ranks/table"
RANK_TABLE_CSV = "ranks.csv"


def log_table(trainer: pl.Trainer, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
              csv_path: Optional[Path] = None) -> None:
    """A W&B Table (rank 0) and its CSV twin (``csv_path``)."""
    if not trainer.is_global_zero or not rows:
        return
    if csv_path is not None:
        try:
            csv_path.parent.mkdir(parents=True, exist_ok=True)
            with open(csv_path, "w", newline="") as fh:
                writer = csv.writer(fh)
                writer.writerow(columns)
                writer.writerows(rows)
        except OSError as exc:
            warn(f"could not write {csv_path}: {exc}")
    runs = wandb_runs(trainer)
    if not runs:
        return
    try:
        import wandb

        table = wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        for run in runs:
            run.log({key: table, "trainer/global_step": trainer.global_step})
    except Exception as exc:  # noqa: BLE001
        warn(f"W&B table {key} failed: {type(exc).__name__}: {exc}")


class RankTableCallback(Callback):
    """At the end of training: one W&B Table with each rank's latest comm and memory values, and its
    CSV twin ``run_dir/ranks.csv``. Runs after the callbacks that fill the table."""

    def __init__(self, table: RankTable, run_dir: Path) -> None:
        self.table = table
        self.run_dir = Path(run_dir)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or not self.table.rows:
            return
        log_table(trainer, RANK_TABLE_KEY, self.table.columns(), self.table.as_rows(),
                  csv_path=self.run_dir / RANK_TABLE_CSV)


def build(ctx: RunContext, shared: Shared) -> RankTableCallback:
    return RankTableCallback(shared.table, Path(ctx.run_dir))
