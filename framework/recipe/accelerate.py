"""An ``accelerate config`` YAML (``--accelerate-config``) → recipe values for ``fsdp:`` and ``trainer:``.

Accelerate's ``fsdp_config`` keys are the recipe's ``fsdp:`` fields with an ``fsdp_`` prefix, so the file is
imported unchanged; anything shardlight cannot honour is one clear error.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict

import yaml

from shardlight.errors import ShardlightError
from shardlight.recipe.schema import FSDPConfig

_ACCELERATE_TOP_LEVEL_IGNORED = {
    "compute_environment", "debug", "downcast_bf16", "machine_rank", "main_training_function", "rdzv_backend",
    "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "enable_cpu_affinity", "main_process_ip",
    "main_process_port", "gpu_ids", "dynamo_config", "deepspeed_config", "megatron_lm_config",
}
_ACCELERATE_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "fp8": None}


def accelerate_config_overrides(path: str) -> Dict[str, Any]:
    """An ``accelerate config`` YAML → a nested dict of recipe values (``fsdp:`` and ``trainer:``)."""
    file = Path(path)
    if not file.is_file():
        raise ShardlightError(f"accelerate config not found: {path}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ShardlightError(f"accelerate config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ShardlightError(f"accelerate config {path} must be a mapping")
    kind = data.get("distributed_type", "FSDP")
    if str(kind).upper() != "FSDP":
        raise ShardlightError(f"accelerate config {path}: distributed_type is {kind}; shardlight runs FSDP")
    fsdp_fields = {f.name for f in fields(FSDPConfig)}
    fsdp: Dict[str, Any] = {}
    for key, value in (data.get("fsdp_config") or {}).items():
        name = key[len("fsdp_"):] if key.startswith("fsdp_") and key != "fsdp_version" else key
        if name not in fsdp_fields:
            close = difflib.get_close_matches(name, sorted(fsdp_fields), n=1)
            hint = f"; did you mean 'fsdp_{close[0]}'?" if close else ""
            raise ShardlightError(f"accelerate config {path}: unknown fsdp_config key '{key}'{hint}")
        if name in ("transformer_layer_cls_to_wrap", "transformer_cls_names_to_wrap") and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        fsdp[name] = value
    if fsdp.get("fsdp_version", 1) == 2 and isinstance(fsdp.get("reshard_after_forward"), str):
        fsdp["reshard_after_forward"] = fsdp["reshard_after_forward"].lower() == "true"
    if fsdp.get("fsdp_version", 1) == 1 and "reshard_after_forward" in fsdp and "sharding_strategy" not in fsdp:
        fsdp["sharding_strategy"] = fsdp.pop("reshard_after_forward")
    trainer: Dict[str, Any] = {}
    machines = int(data.get("num_machines", 1) or 1)
    if "num_processes" in data:
        processes = int(data["num_processes"])
        if processes <= 0 or processes % machines:
            raise ShardlightError(
                f"accelerate config {path}: num_processes {processes} is not a multiple of num_machines {machines}"
            )
        trainer["devices"] = processes // machines
    trainer["num_nodes"] = machines
    if "mixed_precision" in data:
        precision = _ACCELERATE_PRECISION.get(str(data["mixed_precision"]).lower(), "unknown")
        if precision in (None, "unknown"):
            raise ShardlightError(
                f"accelerate config {path}: mixed_precision '{data['mixed_precision']}' is not supported; "
                "allowed: no, bf16, fp16"
            )
        trainer["precision"] = precision
    if data.get("use_cpu"):
        trainer["accelerator"] = "cpu"
    unknown = set(data) - _ACCELERATE_TOP_LEVEL_IGNORED - {
        "distributed_type", "fsdp_config", "num_machines", "num_processes", "mixed_precision", "use_cpu"}
    if unknown:
        raise ShardlightError(f"accelerate config {path}: unknown keys {sorted(unknown)}")
    return {"fsdp": fsdp, "trainer": trainer}
