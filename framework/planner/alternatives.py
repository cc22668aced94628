"""The planner's view of what else this recipe could run, as plain data for ``shardlight.diagnosis``.

``alternatives_from_plan(plan, strategy=..., activation_checkpointing=..., cpu_offload=...)`` → one dict per
configuration next to the current one: ``label``, ``strategy``, ``activation_checkpointing``, ``fits``,
``headroom_bytes``, ``comm_time_s``, ``comm_change_fraction`` (its estimated communication time relative to
the current configuration's: −0.33 is a third less), ``what`` (what changes, in words), ``override`` (the
recipe keys to set) and ``current`` (True for the current configuration's own row). The diagnosis scales its
measured communication by ``comm_change_fraction``; it does not import the planner (the layering).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from shardlight.errors import first_line
from shardlight.planner.inputs import parse_memory
from shardlight.planner.plan import (
    ClusterOptions,
    WorkloadOptions,
    cluster_for,
    plan_for,
    spec_from_recipe,
    workload_for,
)
from shardlight.planner.recommend import find_row, label
from shardlight.recipe import RecipeConfig

# What moving from the current strategy (or from any, "*") to another one changes, in words.
WHAT = {
    ("FULL_SHARD", "SHARD_GRAD_OP"): "removes backward all-gathers (parameters stay gathered until backward)",
    ("NO_SHARD", "SHARD_GRAD_OP"): "shards gradients and optimizer state, gathering parameters once per micro-batch",
    ("*", "NO_SHARD"): "replaces the per-unit all-gathers and reduce-scatters with one gradient all-reduce",
    ("*", "HYBRID_SHARD"): "keeps all-gathers inside the node (shards within a node, replicates across nodes)",
    ("*", "FULL_SHARD"): "shards parameters, gradients and optimizer state: the most headroom, more all-gathers",
    ("*", "SHARD_GRAD_OP"): "keeps parameters gathered from forward to backward: fewer all-gathers",
}
CHECKPOINTING_WHAT = "recomputes each block in backward: saved activations shrink to one input per block"


def describe(current: str, other: str) -> str:
    return WHAT.get((current, other)) or WHAT[("*", other)]


def _entry(row: Dict[str, Any], current_row: Optional[Dict[str, Any]], what: str) -> Dict[str, Any]:
    base = (current_row or {}).get("comm_time_s")
    change = (row["comm_time_s"] - base) / base if base else None
    override = f"fsdp.sharding_strategy={row['sharding_strategy']}"
    if row["mesh_shape"]:
        override += f" fsdp.mesh_shape=[{row['mesh_shape'][0]},{row['mesh_shape'][1]}]"
    override += f" fsdp.activation_checkpointing={str(row['activation_checkpointing']).lower()}"
    return {"label": label(row), "strategy": row["sharding_strategy"],
            "activation_checkpointing": row["activation_checkpointing"], "cpu_offload": row["cpu_offload"],
            "fits": bool(row["fits"]), "headroom_bytes": row["headroom_bytes"], "comm_time_s": row["comm_time_s"],
            "step_time_s": row["step_time_s"], "comm_change_fraction": change, "what": what, "override": override,
            "current": row is current_row}


def alternatives_from_plan(plan: Dict[str, Any], *, strategy: str, activation_checkpointing: bool = False,
                           cpu_offload: bool = False) -> List[Dict[str, Any]]:
    """The current configuration's row (``current: True``), every other strategy with the same checkpointing
    and offload, and the current strategy with activation checkpointing when it is off."""
    rows = plan["strategies"]
    current = find_row(rows, strategy, activation_checkpointing, cpu_offload)
    result = [] if current is None else [_entry(current, current, "the configuration this run used")]
    for row in rows:
        if row is current or row["activation_checkpointing"] != activation_checkpointing \
                or row["cpu_offload"] != cpu_offload or row["sharding_strategy"] == strategy:
            continue
        result.append(_entry(row, current, describe(strategy, row["sharding_strategy"])))
    if not activation_checkpointing:
        recompute = find_row(rows, strategy, True, cpu_offload)
        if recompute is not None:
            result.append(_entry(recompute, current, CHECKPOINTING_WHAT))
    return result


def current_strategy(cfg: RecipeConfig) -> str:
    """The strategy a recipe runs: ``fsdp.sharding_strategy``, FSDP2's ``reshard_after_forward: false`` as
    SHARD_GRAD_OP, else FULL_SHARD (the default)."""
    if cfg.fsdp.sharding_strategy:
        return cfg.fsdp.sharding_strategy.lstrip("_").replace("HYBRID_SHARD_ZERO2", "HYBRID_SHARD")
    return "SHARD_GRAD_OP" if cfg.fsdp.reshard_after_forward is False else "FULL_SHARD"


def alternatives_for_recipe(cfg: RecipeConfig, hf_config: Any, *,
                            device_memory_bytes: Optional[float] = None) -> List[Dict[str, Any]]:
    """``alternatives_from_plan`` of the recipe's own plan; ``device_memory_bytes`` (measured capacity) replaces
    the planner's default GPU memory so headroom is about the device the run had."""
    options = ClusterOptions()
    if device_memory_bytes:
        options = ClusterOptions(gpu_memory=f"{int(device_memory_bytes)}B")
        parse_memory(options.gpu_memory)  # a clear error now rather than inside the plan
    plan = plan_for(spec_from_recipe(cfg, hf_config), cluster_for(options, cfg), workload_for(WorkloadOptions(), cfg))
    return alternatives_from_plan(plan, strategy=current_strategy(cfg),
                                  activation_checkpointing=bool(cfg.fsdp.activation_checkpointing),
                                  cpu_offload=bool(cfg.fsdp.cpu_offload or cfg.fsdp.offload_params))


def alternatives_on_device(cfg: RecipeConfig, hf_config: Any,
                           memory: Dict[int, Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """``(alternatives, note)`` for the device a run had (``memory``: rank -> its ``capacity_bytes``, the
    smallest is planned for): the rows, or none and why. Never raises: a verdict stands without the costing."""
    capacities = [m["capacity_bytes"] for m in memory.values() if m.get("capacity_bytes")]
    try:
        return alternatives_for_recipe(cfg, hf_config, device_memory_bytes=min(capacities, default=None)), None
    except Exception as exc:  # noqa: BLE001
        return [], f"planner alternatives unavailable ({first_line(exc)})"
