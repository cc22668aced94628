"""The plan's memory from fake-tensor steps (``fake_step.step_memory``) instead of the analytic model.

``measure_rows`` runs one fake training step per (strategy, activation checkpointing, shard group) on the
planned world size and replaces each estimate's peak with the measured one; the analytic numbers stay in
the row (``analytic_peak_bytes``, ``analytic_activation_bytes``) as the explanation of where the bytes go
and to print the difference. CPU offload rows reuse their on-GPU step: the fake step runs on the CPU, where
offloading moves nothing, so the offloaded peak is the measured peak less the sharded parameters,
gradients and optimizer state alive at that moment (what ``CPUOffloadPolicy`` keeps on the host). A configuration
that cannot fit whatever the step measures (``least_peak``: its state and gathered buffers, which the analytic
model counts, less 10%, plus half its modelled activations, above the GPU) is not stepped: a 70B model's
replicated or unsharded rows, and those without checkpointing, keep their analytic memory (``memory_skipped``).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from shardlight.errors import ShardlightError
from shardlight.planner.fake_step import measured_depths, step_memory
from shardlight.planner.inputs import Cluster, Workload
from shardlight.planner.recommend import choose, label
from shardlight.run_context import usable_cores

FAKE_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
FAKE_OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass(frozen=True)
class StepModel:
    """What the fake step builds: the Hugging Face config and how shardlight wraps it."""

    hf_config: Any
    block_classes: Optional[List[str]] = None   # fsdp.transformer_cls_names_to_wrap (None: detected)
    wrap_blocks: bool = True                    # False: fsdp.auto_wrap_policy=NO_WRAP, one unit
    trust_remote_code: bool = False
    tp_plan: Optional[Dict[str, str]] = None    # parallelism.tp_plan (None: the model's base_model_tp_plan)


def why_not_measured(work: Workload) -> Optional[str]:
    """The reason the fake step cannot stand for this workload (the plan then keeps the analytic memory)."""
    if work.peft:
        return f"the fake step does not build {work.peft} adapters"
    if work.precision not in FAKE_PRECISIONS:
        return f"the fake step runs {', '.join(FAKE_PRECISIONS)}, not {work.precision}"
    if work.optimizer not in FAKE_OPTIMIZERS:
        return f"the fake step cannot run {work.optimizer} (bitsandbytes) on fake tensors"
    return None


def measure_rows(rows: List[Dict[str, Any]], model: StepModel, cluster: Cluster, work: Workload) -> Dict[str, Any]:
    """Replace each row's peak (and fits/headroom) with the fake step's; returns what was measured and how
    long it took, for the plan's JSON and text."""
    reason = why_not_measured(work)
    if reason is not None:
        for row in rows:
            row["memory_source"] = "analytic"
        return {"source": "analytic", "reason": reason}
    started = time.perf_counter()
    steps: Dict[Tuple[str, bool, int], Dict[str, Any]] = {}
    keys: Dict[Tuple[str, bool, int], List[Dict[str, Any]]] = {}
    for row in rows:
        keys.setdefault((row["sharding_strategy"], row["activation_checkpointing"], row["shard_group_size"]),
                        []).append(row)
    # A configuration none of whose rows can fit, whatever the step measures, keeps its analytic memory.
    hopeless = {key for key, group in keys.items() if all(least_peak(r) > cluster.usable_bytes for r in group)}
    depths = measured_depths(model.hf_config) if model.wrap_blocks else None
    deep = (f", {depths[0]} and {depths[1]} of {model.hf_config.num_hidden_layers} blocks, scaled"
            if depths else "")
    for key, group in keys.items():
        if key in hopeless:
            for row in group:
                row["memory_source"] = "analytic"
                row["memory_skipped"] = (f"cannot fit: at least {least_peak(row) / 1e9:.1f} GB "
                                         f"of state, gathered buffers and activations")
    todo = [key for key in keys if key not in hopeless]
    calls = [(model.hf_config, {
        "world_size": cluster.world_size, "strategy": key[0], "checkpointing": key[1], "precision": work.precision,
        "micro_batch_size": work.micro_batch_size, "seq_len": work.seq_len, "optimizer": work.optimizer,
        "param_dtype": work.param_dtype, "shard_group_size": key[2] if key[0] == "HYBRID_SHARD" else None,
        "block_classes": model.block_classes, "wrap_blocks": model.wrap_blocks,
        "trust_remote_code": model.trust_remote_code, "loss_chunks": work.loss_chunks,
        "checkpointing_mode": work.checkpointing_mode, "checkpointing_every": work.checkpointing_every})
        for key in todo]
    for key, step in zip(todo, _stepped(calls, deep, started)):
        steps[key] = step
        for row in keys[key]:
            apply_step(row, step, cluster)
    progress(None)
    return {"source": "fake-step", "steps": len(steps), "skipped": len(hopeless),
            "seconds": round(time.perf_counter() - started, 2), "world_size": cluster.world_size,
            "depths": next(iter(steps.values()))["depths"] if steps else None}


def _step(call: Tuple[Any, Dict[str, Any]]) -> Dict[str, Any]:
    hf_config, kwargs = call
    return step_memory(hf_config, **kwargs)


def _forking_is_safe() -> bool:
    """Whether this process may fork workers: a fork copies only the calling thread, so a child that touches a
    lock or pool another thread held (OpenMP's workers after a matmul, a tokenizer's thread pool: what a
    notebook or a test runner has by then) can crash in libc. ``shardlight plan`` forks from a process of at
    most 2 OS threads (Python's and the allocator's), which is safe; anything busier steps in this process."""
    try:
        return len(os.listdir("/proc/self/task")) <= 2
    except OSError:  # no /proc (not Linux): do not guess
        return False


def _stepped(calls: List[Tuple[Any, Dict[str, Any]]], deep: str, started: float) -> List[Dict[str, Any]]:
    """Each call's fake step, in order: one per core at a time in forked processes (the steps are independent
    and CPU-bound: the 70B recipe's plan takes 25-28 s instead of 37-38 s on 2 cores), in this process when
    there is one core or one step, or when forking is not safe here (``_forking_is_safe``). Only ``shardlight
    plan``/``profile`` step (a training rank plans analytically), so no process group or rank is forked."""
    workers = min(len(calls), usable_cores()) if _forking_is_safe() else 1

    def say(done: int) -> None:
        progress(f"plan: fake training steps {done}/{len(calls)} done ({max(workers, 1)} at a time{deep}), "
                 f"{time.perf_counter() - started:.0f} s so far")

    if workers <= 1:
        out = []
        for call in calls:
            say(len(out))
            out.append(_step(call))
        return out
    import concurrent.futures
    import multiprocessing

    say(0)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(_step, call) for call in calls]
        for done, _ in enumerate(concurrent.futures.as_completed(futures), 1):
            say(done)
        return [f.result() for f in futures]


# What the analytic model may overstate, where it models rather than counts: the sharded state and the gathered
# buffers are arithmetic on the parameter counts (the fake step reads them within 1%), the activations a model of
# what a block saves (within 40% of the fake step on every model tried, docs/planner.md).
STATE_FLOOR, ACTIVATION_FLOOR = 0.9, 0.5


def least_peak(row: Dict[str, Any]) -> float:
    """A floor under the peak the fake step could measure for ``row``: its GPU state and gathered buffers less
    10%, and half its analytic activations. A row above the GPU's usable memory by this floor is not stepped."""
    state = row["gpu_state_bytes"] + row["gather_buffer_bytes"] + row["grad_buffer_bytes"]
    return STATE_FLOOR * state + ACTIVATION_FLOOR * (row["activation_bytes"] + row["logits_bytes"])


def progress(line: Optional[str]) -> None:
    """A live progress line on a terminal (rewritten in place; None clears it); nothing when stderr is a file
    or a pipe, whose reader gets the plan itself."""
    if not sys.stderr.isatty():
        return
    sys.stderr.write("\r\033[K" + (line or ""))
    sys.stderr.flush()


def measure_tp_contenders(rows: List[Dict[str, Any]], tp_rows: List[Dict[str, Any]], model: StepModel,
                          cluster: Cluster, work: Workload) -> List[str]:
    """Measure, by a fake step on the TP mesh, the TP row the rule would pick on its analytic peak, until the
    pick is a measured row or not TP; returns the labels measured. The other TP rows keep analytic memory (and
    a row whose fake step fails keeps it too, with ``memory_error``)."""
    measured: List[str] = []
    while True:
        best = choose(rows + tp_rows)
        if best is None or best.get("tp_size", 1) == 1 or best.get("memory_source") == "fake-step":
            return measured
        group = best["shard_group_size"] if best["sharding_strategy"] == "HYBRID_SHARD" else None
        try:
            step = step_memory(model.hf_config, cluster.world_size, best["sharding_strategy"],
                               best["activation_checkpointing"], work.precision, work.micro_batch_size, work.seq_len,
                               work.optimizer, work.param_dtype, shard_group_size=group,
                               block_classes=model.block_classes, wrap_blocks=model.wrap_blocks,
                               trust_remote_code=model.trust_remote_code, tp=best["tp_size"], tp_plan=model.tp_plan,
                               loss_chunks=work.loss_chunks, checkpointing_mode=work.checkpointing_mode,
                               checkpointing_every=work.checkpointing_every)
        except ShardlightError as exc:
            # The row keeps its analytic peak; the plan still stands, and says why it was not measured.
            best["memory_source"] = "analytic"
            best["memory_error"] = str(exc)
            return measured
        apply_step(best, step, cluster)
        measured.append(label(best))


def apply_step(row: Dict[str, Any], step: Dict[str, Any], cluster: Cluster) -> None:
    at_peak = step["peak_by_category"]
    peak = step["peak"]
    if row["cpu_offload"]:
        peak -= at_peak["params"] + at_peak["grads"] + at_peak["optim"]
    row["analytic_peak_bytes"] = row["peak_bytes"]
    row["analytic_activation_bytes"] = row["activation_bytes"] + row["logits_bytes"]
    row["measured_activation_bytes"] = step["activations"]
    row["measured_at_peak"] = dict(at_peak)
    row["memory_source"] = "fake-step"
    row["peak_bytes"] = float(peak)
    row["total_with_overhead_bytes"] = peak + cluster.overhead_bytes
    row["headroom_bytes"] = cluster.usable_bytes - peak
    row["fits"] = peak <= cluster.usable_bytes and row["host_fits"]
