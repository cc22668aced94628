"""What ``shardlight diagnose`` and ``shardlight profile`` read from a run directory or a trace directory.

A run directory (``shardlight train``'s) holds ``traces/step_<N>/rank<R>.pt.trace.json`` (the comm callback's
windows: the verdict is judged across those it kept, as the run's own end-of-run verdict is,
``across_windows``; ``diagnosis.json`` says which step the run started from), ``csv/metrics.csv`` (memory
and throughput; parsed by the caller, handed in as ``{key: [values]}``), ``wrap_report.json`` and
``recipe.yaml`` (micro-batch, strategy, world size and the ``diagnosis:`` thresholds). A trace directory
is a folder of per-rank trace files.

A rank whose trace is missing gives a partial diagnosis that names it (the caller decides how loudly);
traces of different steps are an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import yaml

from shardlight.diagnosis.across_windows import Window, diagnose_run
from shardlight.diagnosis.result import Diagnosis
from shardlight.diagnosis.step_split import check_same_steps
from shardlight.diagnosis.verdicts import missing_from
from shardlight.errors import ShardlightError
from shardlight.recipe.instrument_sections import DiagnosisConfig
from shardlight.trace import analyze_traces
from shardlight.trace.analysis import is_trace_name

TRACE_DIR = "traces"  # the comm callback's folder in a run directory
WINDOW_RE = re.compile(r"^step_(\d+)$")
MEMORY_KEYS = ("headroom", "capacity", "peak", "params", "grads", "optim")
GB = 1e9


@dataclass
class RunInputs:
    """Everything ``diagnose`` takes, read from one directory. ``analysis``: the latest window's; ``windows``:
    every window read, ``(start step, analysis)``, oldest first."""

    trace_dir: Path
    analysis: Dict[str, Any]
    windows: List[Window] = field(default_factory=list)
    run_start: int = 0
    run_dir: Optional[Path] = None
    window_step: Optional[int] = None
    memory: Dict[int, Dict[str, float]] = field(default_factory=dict)
    throughput: Optional[Dict[str, Any]] = None
    wrap: Optional[Dict[str, Any]] = None
    settings: Dict[str, Any] = field(default_factory=dict)
    config: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    missing_ranks: List[int] = field(default_factory=list)

    def diagnosis(self, *, alternatives: Optional[Sequence[Mapping[str, Any]]] = None,
                  config: Optional[DiagnosisConfig] = None) -> Diagnosis:
        return diagnose_run(self.windows or [(self.window_step or 0, self.analysis)], run_start=self.run_start,
                            memory=self.memory or None, throughput=self.throughput, wrap=self.wrap,
                            alternatives=alternatives, config=config or self.config,
                            micro_batch_size=self.settings.get("micro_batch_size"), missing_ranks=self.missing_ranks)


def _has_traces(directory: Path) -> bool:
    return directory.is_dir() and any(p.is_file() and is_trace_name(p) for p in directory.iterdir())


def window_dirs(run_dir: Path) -> List[tuple]:
    """``(step, folder)`` of every ``traces/step_<N>`` folder holding traces, oldest first."""
    root = Path(run_dir) / TRACE_DIR
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := WINDOW_RE.match(p.name)) and _has_traces(p))


def latest_window(run_dir: Path) -> Optional[Path]:
    """The newest ``traces/step_<N>`` folder holding traces, or None."""
    windows = window_dirs(run_dir)
    return windows[-1][1] if windows else None


def locate(path: Path) -> tuple:
    """(trace dir, run dir or None) of ``path``: a run directory or a directory of per-rank traces."""
    path = Path(path)
    if not path.exists():
        raise ShardlightError(f"{path}: no such directory")
    if not path.is_dir():
        raise ShardlightError(f"{path}: not a directory; give a run directory or a directory of per-rank traces")
    window = latest_window(path)
    if window is not None:
        return window, path
    if (path / TRACE_DIR).is_dir() or (path / "recipe.yaml").exists():
        raise ShardlightError(f"{path}: a run directory without traces (no {TRACE_DIR}/step_*/ with trace files); "
                              "enable callbacks.comm to record profiling windows")
    if _has_traces(path):
        return path, None
    raise ShardlightError(f"{path}: neither a run directory (no {TRACE_DIR}/step_*/) nor a trace directory "
                          "(no *.json / *.json.gz trace files)")


def _last(values: Mapping[str, List[float]], key: str) -> Optional[float]:
    series = values.get(key) or []
    return series[-1] if series else None


def memory_from_metrics(values: Mapping[str, List[float]]) -> Dict[int, Dict[str, float]]:
    """``{rank: {"headroom_bytes", ...}}`` from the memory callback's latest ``memory/rank<R>/<name>_gb``."""
    memory: Dict[int, Dict[str, float]] = {}
    pattern = re.compile(r"^memory/rank(\d+)/(\w+)_gb$")
    for key in values:
        match = pattern.match(key)
        if match and match.group(2) in MEMORY_KEYS and _last(values, key) is not None:
            memory.setdefault(int(match.group(1)), {})[f"{match.group(2)}_bytes"] = _last(values, key) * GB
    return memory


def throughput_from_metrics(values: Mapping[str, List[float]]) -> Optional[Dict[str, Any]]:
    """The throughput callback's latest tokens/s/device, scaling efficiency and MFU (None when never logged)."""
    numbers = {key: _last(values, f"throughput/{key}") for key in ("tokens_per_sec_per_device", "scaling_efficiency",
                                                                   "mfu")}
    return numbers if numbers["tokens_per_sec_per_device"] is not None else None


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_settings(run_dir: Path) -> Dict[str, Any]:
    """Micro-batch, strategy, world size and the ``diagnosis`` section of the run's ``recipe.yaml``."""
    try:
        recipe = yaml.safe_load((Path(run_dir) / "recipe.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    trainer, fsdp = recipe.get("trainer") or {}, recipe.get("fsdp") or {}
    strategy = fsdp.get("sharding_strategy")
    if strategy is None:  # FSDP2 says it with reshard_after_forward; null is FULL_SHARD (the schema's default)
        strategy = "SHARD_GRAD_OP" if fsdp.get("reshard_after_forward") is False else "FULL_SHARD"
    return {"micro_batch_size": trainer.get("micro_batch_size"), "strategy": strategy,
            "world_size": int(trainer.get("devices") or 1) * int(trainer.get("num_nodes") or 1),
            "activation_checkpointing": bool(fsdp.get("activation_checkpointing")),
            "cpu_offload": bool(fsdp.get("cpu_offload") or fsdp.get("offload_params")),
            "diagnosis": recipe.get("diagnosis") or {}}


def config_from(section: Mapping[str, Any]) -> DiagnosisConfig:
    known = {f.name for f in fields(DiagnosisConfig)}
    return DiagnosisConfig(**{k: v for k, v in section.items() if k in known})


def load_run_inputs(path, *, metrics: Optional[Mapping[str, List[float]]] = None) -> RunInputs:
    """Read ``path`` (run or trace directory). ``metrics``: the run's ``csv/metrics.csv`` as ``{key: [values]}``."""
    trace_dir, run_dir = locate(Path(path))
    analysis = analyze_traces(trace_dir)
    check_same_steps(analysis)
    inputs = RunInputs(trace_dir=trace_dir, analysis=analysis, run_dir=run_dir)
    match = WINDOW_RE.match(trace_dir.name)
    inputs.window_step = int(match.group(1)) if match else None
    missing = set(missing_from(analysis))
    if run_dir is not None:
        for step, folder in window_dirs(run_dir)[:-1]:
            earlier = analyze_traces(folder)
            check_same_steps(earlier)
            inputs.windows.append((step, earlier))
        inputs.windows.append((inputs.window_step or 0, analysis))
        inputs.run_start = int((_read_json(run_dir / "diagnosis.json") or {}).get("run_start") or 0)
        inputs.settings = run_settings(run_dir)
        inputs.config = config_from(inputs.settings.get("diagnosis") or {})
        inputs.wrap = _read_json(run_dir / "wrap_report.json")
        world = inputs.settings.get("world_size") or 0
        missing |= {r for r in range(world) if str(r) not in analysis["ranks"]}
    if metrics:
        inputs.memory = memory_from_metrics(metrics)
        inputs.throughput = throughput_from_metrics(metrics)
    inputs.missing_ranks = sorted(missing)
    return inputs
