"""One measured run of ``shardlight profile``: a ``python -m shardlight.cli train`` child process (one
Lightning fit per process) and the numbers its ``csv/metrics.csv`` holds.

The child finds ``shardlight`` the way this process did (an installed package, editable or wheel): nothing
here depends on a source checkout. Its environment is this one without shardlight's per-run and per-rank
variables (``shardlight.launch.launchers.without_run_env``), so it is a new, independent run.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from shardlight.launch.launchers import without_run_env
from shardlight.planner.inputs import GB

COMPARED = ("params", "grads", "optim")


def read_metrics(run_dir: Path) -> Dict[str, List[float]]:
    """Every logged value per key, in order (empty cells skipped)."""
    values: Dict[str, List[float]] = {}
    path = Path(run_dir) / "csv" / "metrics.csv"
    if not path.exists():
        return values
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            for key, cell in row.items():
                if cell not in (None, ""):
                    try:
                        values.setdefault(key, []).append(float(cell))
                    except ValueError:
                        pass
    return values


def summarize(metrics: Dict[str, List[float]], world_size: int) -> Dict[str, Any]:
    """The numbers the report needs from one run's metrics."""
    def last(key: str) -> Optional[float]:
        return metrics[key][-1] if metrics.get(key) else None

    def median(key: str) -> Optional[float]:
        return statistics.median(metrics[key]) if metrics.get(key) else None

    out: Dict[str, Any] = {
        "tokens_per_sec_per_device": median("throughput/tokens_per_sec_per_device"),
        "comm_total_ms": median("comm/total_ms"),
        "comm_exposed_ms": median("comm/exposed_ms"),
        "compute_ms": median("comm/compute_ms"),
        "overlap_pct": median("comm/overlap_pct"),
        "peak_gb": last("memory/peak_gb"),
    }
    for name in COMPARED:
        value = last(f"memory/{name}_gb")
        out[f"{name}_bytes"] = None if value is None else round(value * GB)
    out["peak_gb_per_rank"] = [last(f"memory/rank{r}/peak_gb") for r in range(world_size)]
    if out["comm_total_ms"] is not None and out["comm_exposed_ms"] is not None:
        out["comm_overlapped_ms"] = max(0.0, out["comm_total_ms"] - out["comm_exposed_ms"])
    return out


def child_env() -> Dict[str, str]:
    """This process's environment for a new, independent ``shardlight train``."""
    env = without_run_env(os.environ)
    env.setdefault("WANDB_SILENT", "true")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_one(recipe: Optional[str], overrides: Sequence[str], out_dir: Path, tag: str,
            timeout: float) -> Dict[str, Any]:
    """One ``shardlight train`` subprocess; returns its summary (or the error) and its log path."""
    summary_path = out_dir / f"{tag}.summary.json"
    log_path = out_dir / f"{tag}.log"
    command = [sys.executable, "-m", "shardlight.cli", "train", *([recipe] if recipe else []), *overrides,
               "--summary-json", str(summary_path)]
    print(f"shardlight profile: running {tag} ...", flush=True)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(command, cwd=os.getcwd(), env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        code: Any = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    result: Dict[str, Any] = {"tag": tag, "log": str(log_path), "returncode": code, "command": command}
    if code == 0 and summary_path.exists():
        result["summary"] = json.loads(summary_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path.exists() else []
        result["error"] = " | ".join(tail) or f"exit {code}"
        print(f"shardlight profile: {tag} failed ({code}); see {log_path}", flush=True)
    return result


def measure(result: Dict[str, Any], world_size: int) -> Optional[Dict[str, Any]]:
    """A finished run's measured numbers (None when it did not finish)."""
    if "summary" not in result:
        return None
    return summarize(read_metrics(Path(result["summary"]["run_dir"])), world_size)
