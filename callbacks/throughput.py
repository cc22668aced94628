"""ThroughputCallback: tokens/s and samples/s per device, MFU and scaling efficiency.

``build(config, ctx, shared)`` makes the callback from the recipe's ``callbacks.throughput`` section
(``ThroughputConfig``).

* ``throughput/tokens_per_sec_per_device`` and ``throughput/samples_per_sec_per_device``: the mean over
  ranks of each rank's non-padding tokens (``attention_mask``; all of ``input_ids`` without one) and
  sequences per second of training wall time (validation time excluded), over the last interval; with
  tensor parallelism (``tp_size`` ranks per batch) each device is credited 1/tp_size of its batch;
* ``throughput/flops_per_token``: model FLOPs per token of one training step (forward + backward),
  measured once with ``torch.utils.flop_counter.FlopCounterMode`` on a meta-device copy of the Hugging
  Face model at the training sequence length (no memory, no compute, no activation recomputation: model
  FLOPs, as MFU defines them); when that is impossible, ``6 N + 12 L d S`` (PaLM's approximation; N
  parameters outside the input embedding, L layers, d hidden size, S sequence length);
* ``throughput/tflops_per_device`` and ``throughput/mfu`` = achieved FLOP/s ÷ peak FLOP/s per device. The peak
  is ``peak_tflops`` if set, else the built-in table (dense bf16 or fp32 by ``trainer.precision``) matched
  against the CUDA device name, with ``peak_tflops_table`` entries (device-name substring → TFLOP/s)
  overriding or extending it. No peak (CPU, unknown GPU) → MFU is not logged;
* ``throughput/scaling_efficiency`` = tokens/s/device ÷ the baseline tokens/s/device read from
  ``baseline_file`` (JSON with ``tokens_per_sec_per_device``, as ``shardlight profile`` writes it); no
  file → not logged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from shardlight.callbacks._common import Findings, Shared, define_wandb_group, interval, log_metrics
from shardlight.errors import warn
from shardlight.recipe.instrument_sections import ThroughputConfig
from shardlight.run_context import RunContext
from shardlight.strategy.activation_checkpointing import compile_seconds

# Dense (no sparsity) peak TFLOP/s per device, from NVIDIA's datasheets. Longest matching name wins.
PEAK_TFLOPS: Dict[str, Dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "H100 PCIe": {"bf16": 756.5, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp32": 66.9},
}


def precision_class(precision: Any) -> str:
    text = str(precision)
    return "fp32" if text.startswith(("32", "64")) else "bf16"


def lookup_peak_tflops(device_name: str, precision: Any,
                       overrides: Optional[Dict[str, float]] = None) -> Optional[float]:
    """Peak TFLOP/s of a device by name (``overrides`` first), for the run's precision; None if unknown."""
    name = device_name.lower()
    for table in ((overrides or {}), {k: v[precision_class(precision)] for k, v in PEAK_TFLOPS.items()}):
        matches = [key for key in table if str(key).lower() in name]
        if matches:
            return float(table[max(matches, key=len)])
    return None


def approx_flops_per_token(model: torch.nn.Module, config: Any, seq_len: int) -> float:
    """PaLM's 6N + 12·L·d·S model FLOPs per token (forward + backward)."""
    n = sum(p.numel() for p in model.parameters())
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        n -= embeddings.weight.numel()
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return float(6 * n + 12 * layers * hidden * seq_len)


def meta_model(config: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The architecture on the meta device (no memory); SDPA attention, which runs on meta tensors."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                    trust_remote_code=trust_remote_code)
        except (ValueError, ImportError, TypeError):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def measure_flops_per_token(config: Any, seq_len: int, batch_size: int = 1,
                            trust_remote_code: bool = False) -> Tuple[float, str]:
    """(FLOPs per token, how) for a Hugging Face causal LM config, on a meta-device copy."""
    model = meta_model(config, trust_remote_code)
    try:
        from torch.utils.flop_counter import FlopCounterMode

        input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False) as counter:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
        total = counter.get_total_flops()
        if total > 0:
            return total / (batch_size * seq_len), "flop_counter"
    except Exception as exc:  # noqa: BLE001
        warn(f"FLOP counting failed ({type(exc).__name__}: {exc}); using the 6N + attention approximation")
    return approx_flops_per_token(model, config, seq_len), "6N+attention"


def read_baseline(path: Optional[str]) -> Optional[float]:
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        warn(f"throughput baseline {path} unreadable ({exc}); scaling efficiency not logged")
        return None
    for candidate in (data, data.get("throughput", {}) if isinstance(data, dict) else {}):
        value = candidate.get("tokens_per_sec_per_device") if isinstance(candidate, dict) else None
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    warn(f"throughput baseline {path} has no positive tokens_per_sec_per_device; scaling efficiency not logged")
    return None


class ThroughputCallback(Callback):
    """Tokens/s and samples/s per device, MFU and scaling efficiency (see the module docstring)."""

    def __init__(self, every_n_steps: Optional[int] = None, peak_tflops: Optional[float] = None,
                 peak_tflops_table: Optional[Dict[str, float]] = None, baseline_file: Optional[str] = None,
                 measure_flops: bool = True, trust_remote_code: bool = False,
                 findings: Optional[Findings] = None, tp_size: int = 1) -> None:
        self.trust_remote_code = trust_remote_code
        self.tp_size = tp_size
        self.findings = findings
        self.every_n_steps = every_n_steps
        self.peak_tflops_override = peak_tflops
        self.peak_tflops_table = dict(peak_tflops_table or {})
        self.baseline_file = baseline_file
        self.measure_flops = measure_flops
        self.flops_per_token: Optional[float] = None
        self.flops_method: Optional[str] = None
        self.peak_tflops: Optional[float] = None
        self.baseline: Optional[float] = None
        self._reset()
        self._last_step = -1
        self._clock: Optional[float] = None
        self._excluded = 0.0
        self._compile_mark = 0.0
        self._val_started: Optional[float] = None

    def _reset(self) -> None:
        self._tokens: Any = 0
        self._samples = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        define_wandb_group(trainer, "throughput", {"throughput/mfu": "mean"})
        self.baseline = read_baseline(self.baseline_file)
        device = trainer.strategy.root_device
        self.peak_tflops = self.peak_tflops_override
        if self.peak_tflops is None and device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self.peak_tflops = lookup_peak_tflops(name, trainer.precision, self.peak_tflops_table)
            if self.peak_tflops is None and trainer.is_global_zero:
                warn(f"no peak FLOP/s known for '{name}'; set callbacks.throughput.peak_tflops for MFU")

    def _measure_flops(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self.flops_method = "unavailable"
        input_ids = batch.get("input_ids") if isinstance(batch, dict) else None
        config = getattr(getattr(pl_module, "model", None), "config", None)
        if input_ids is None or config is None:
            return
        seq_len = int(input_ids.shape[-1])
        try:
            if self.measure_flops:
                self.flops_per_token, self.flops_method = measure_flops_per_token(
                    config, seq_len, trust_remote_code=self.trust_remote_code)
            else:
                model = meta_model(config, self.trust_remote_code)
                self.flops_per_token = approx_flops_per_token(model, config, seq_len)
                self.flops_method = "6N+attention"
        except Exception as exc:  # noqa: BLE001
            warn(f"FLOPs per token unavailable ({type(exc).__name__}: {exc}); MFU not logged")
            self.flops_per_token = None
        if self.flops_per_token:
            log_metrics(trainer, {"throughput/flops_per_token": self.flops_per_token})

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        if isinstance(batch, dict) and "input_ids" in batch:
            mask = batch.get("attention_mask")
            self._tokens = self._tokens + (mask.sum() if mask is not None else batch["input_ids"].numel())
            self._samples += int(batch["input_ids"].shape[0])
        step = trainer.global_step
        if step == self._last_step:
            return  # accumulation: no optimizer step yet
        self._last_step = step
        if self._clock is None:
            # The clock starts after the first step (allocation, warm-up), which is not counted. Every
            # rank measures FLOPs here (same cost everywhere), so no rank waits for another in the clock.
            if self.flops_method is None:
                self._measure_flops(trainer, pl_module, batch)
            self._start_interval(trainer)
            return
        if step % interval(trainer, self.every_n_steps) == 0:
            self._log(trainer)

    def _start_interval(self, trainer: pl.Trainer) -> None:
        self._reset()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        self._clock = time.perf_counter()
        self._excluded = 0.0
        self._compile_mark = compile_seconds()  # a recompile inside the interval is not step time

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock is not None and not trainer.sanity_checking:
            self._val_started = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_started is not None:
            self._excluded += time.perf_counter() - self._val_started
            self._val_started = None

    def _log(self, trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compiling = compile_seconds() - self._compile_mark
        elapsed = max(1e-9, time.perf_counter() - self._clock - self._excluded - compiling)
        tokens = float(self._tokens.item() if isinstance(self._tokens, torch.Tensor) else self._tokens)
        # With tensor parallelism tp_size ranks compute one batch together: per device, each sees 1/tp_size of it.
        share = 1.0 / self.tp_size
        local = torch.tensor([share * tokens / elapsed, share * self._samples / elapsed], dtype=torch.float64,
                             device=device)
        try:
            mean = trainer.strategy.reduce(local, reduce_op="mean")
        except Exception:  # noqa: BLE001 - a strategy without float64 reduce: float32 is fine for rates
            mean = trainer.strategy.reduce(local.float(), reduce_op="mean")
        tokens_per_sec, samples_per_sec = (float(v) for v in mean.cpu())
        self._start_interval(trainer)
        metrics = {"throughput/tokens_per_sec_per_device": tokens_per_sec,
                   "throughput/samples_per_sec_per_device": samples_per_sec}
        if self.flops_per_token:
            tflops = tokens_per_sec * self.flops_per_token / 1e12
            metrics["throughput/tflops_per_device"] = tflops
            if self.peak_tflops:
                metrics["throughput/mfu"] = tflops / self.peak_tflops
        if self.baseline:
            metrics["throughput/scaling_efficiency"] = tokens_per_sec / self.baseline
        if self.findings is not None and trainer.is_global_zero:
            self.findings.throughput = {
                "tokens_per_sec_per_device": tokens_per_sec,
                "scaling_efficiency": metrics.get("throughput/scaling_efficiency"),
                "mfu": metrics.get("throughput/mfu"),
                "baseline_tokens_per_sec_per_device": self.baseline,
            }
        log_metrics(trainer, metrics)


def build(config: ThroughputConfig, ctx: RunContext, shared: Shared) -> ThroughputCallback:
    return ThroughputCallback(
        every_n_steps=config.every_n_steps, peak_tflops=config.peak_tflops,
        peak_tflops_table=config.peak_tflops_table, baseline_file=config.baseline_file,
        measure_flops=config.measure_flops, trust_remote_code=shared.trust_remote_code, findings=shared.findings,
        tp_size=shared.tp_size,
    )
