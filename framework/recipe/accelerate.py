"""An ``accelerate config`` YAML (``--accelerate-config``) → recipe values for ``fsdp:``, ``trainer:`` and
``parallelism:``. ``KEYS`` holds every key Accelerate can write (``ClusterConfig``'s fields, the
``fsdp_config`` keys of ``accelerate config``/``launch`` and ``FullyShardedDataParallelPlugin``, the
``parallelism_config`` keys): mapped to a recipe key, ignored on purpose (launch details with no effect on a
shardlight run), or refused in one line. Null is "not set". tests/test_accelerate_config.py checks the table
against the installed Accelerate's source."""

from __future__ import annotations

import difflib
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, NamedTuple, Tuple, Union

import yaml

from shardlight.errors import ShardlightError
from shardlight.recipe.schema import FSDPConfig, ParallelismConfig, TrainerConfig


class Refused(NamedTuple):
    """A key shardlight cannot honour: refused unless null or one of ``harmless`` (values asking for nothing)."""

    why: str
    harmless: Tuple[Any, ...] = ()


_TPU = "ignored: TPU pods only (distributed_type XLA is refused)"
_LAUNCH = "ignored: the launcher's rendezvous and node rank (srun, torchrun: MASTER_ADDR, MASTER_PORT, NODE_RANK)"
_OTHER = "ignored: read only with distributed_type DEEPSPEED, MEGATRON_LM or MULTI_CPU (refused)"
_OBJECT = "a Python object; a file cannot give one"
_CP_ONLY = "ignored: read only with parallelism_config_cp_size > 1 (refused)"
_COMPILE = "set the recipe's compile: true instead (inductor on each transformer block, as regional compilation)"
_SP_ONLY = "ignored: read only with parallelism_config_sp_size > 1 (refused)"

# accelerate key → "section.field" (its recipe key) | "ignored: why" | Refused(why, harmless values).
KEYS: Dict[str, Union[str, Refused]] = {
    # The file's top level: ClusterConfig / BaseConfig.
    "compute_environment": Refused("only local-machine configs are read", ("LOCAL_MACHINE",)),
    "distributed_type": Refused("shardlight runs FSDP", ("FSDP",)),
    "mixed_precision": "trainer.precision",  # no → 32-true, bf16 → bf16-mixed, fp16 → 16-mixed
    "use_cpu": "trainer.accelerator",  # true → cpu
    "debug": Refused("Accelerate's collective-shape checks do not exist in shardlight", (False,)),
    "num_processes": "trainer.devices",  # all machines' ranks: devices = num_processes / num_machines
    "num_machines": "trainer.num_nodes",
    "gpu_ids": Refused("GPUs are not picked by id here; set CUDA_VISIBLE_DEVICES", ("all",)),
    "machine_rank": _LAUNCH, "main_process_ip": _LAUNCH, "main_process_port": _LAUNCH, "rdzv_backend": _LAUNCH,
    "same_network": _LAUNCH,
    "main_training_function": "ignored: names a notebook function; shardlight runs its own training",
    "enable_cpu_affinity": Refused("shardlight does not pin ranks to NUMA nodes", (False,)),
    "fp8_config": Refused("FP8 training is not supported"),
    "fsdp_config": "fsdp",  # the section: its keys are the fsdp_* entries below
    "parallelism_config": "parallelism",  # the section: its keys are the parallelism_config_* entries below
    "deepspeed_config": _OTHER, "megatron_lm_config": _OTHER, "mpirun_config": _OTHER,
    "downcast_bf16": _TPU, "tpu_name": _TPU, "tpu_zone": _TPU, "tpu_use_cluster": _TPU, "tpu_use_sudo": _TPU,
    "command_file": _TPU, "commands": _TPU, "tpu_vm": _TPU, "tpu_env": _TPU,
    "dynamo_config": Refused(_COMPILE, ({"dynamo_backend": "NO"},)),
    "dynamo_backend": Refused(_COMPILE, ("NO",)),  # older spelling
    "fp16": Refused("an old spelling; write mixed_precision: fp16", (False,)),
    # fsdp_config (a key without the fsdp_ prefix gets it, as accelerate launch does). With fsdp_version 2
    # Accelerate drops backward_prefetch, use_orig_params, sync_module_states and sharding_strategy; so do we.
    "fsdp_version": "fsdp.fsdp_version",
    "fsdp_sharding_strategy": "fsdp.sharding_strategy",
    "fsdp_reshard_after_forward": "fsdp.reshard_after_forward",  # FSDP1: a sharding strategy name
    "fsdp_backward_prefetch": "fsdp.backward_prefetch",
    "fsdp_forward_prefetch": "fsdp.forward_prefetch",
    "fsdp_mixed_precision_policy": "fsdp.mixed_precision_policy",
    "fsdp_auto_wrap_policy": "fsdp.auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap": "fsdp.transformer_layer_cls_to_wrap",
    "fsdp_transformer_cls_names_to_wrap": "fsdp.transformer_cls_names_to_wrap",
    "fsdp_min_num_params": "fsdp.min_num_params",
    "fsdp_offload_params": "fsdp.offload_params",
    "fsdp_cpu_offload": "fsdp.cpu_offload",
    "fsdp_state_dict_type": "fsdp.state_dict_type",
    "fsdp_limit_all_gathers": "fsdp.limit_all_gathers",
    "fsdp_use_orig_params": "fsdp.use_orig_params",
    "fsdp_sync_module_states": "fsdp.sync_module_states",
    "fsdp_cpu_ram_efficient_loading": "fsdp.cpu_ram_efficient_loading",
    "fsdp_activation_checkpointing": "fsdp.activation_checkpointing",
    "fsdp_activation_checkpointing_offload": "fsdp.activation_checkpointing_offload",
    "fsdp_ignored_modules": Refused("every module is sharded; none can be left out of FSDP"),
    "fsdp_state_dict_config": Refused(_OBJECT), "fsdp_optim_state_dict_config": Refused(_OBJECT),
    "fsdp_param_init_fn": Refused(_OBJECT),
    # shardlight's own fsdp: fields, under Accelerate's spelling.
    "fsdp_mixed_precision": "fsdp.mixed_precision",
    "fsdp_sync_each_batch": "fsdp.sync_each_batch",
    "fsdp_mesh_shape": "fsdp.mesh_shape",
    "fsdp_wrap_report_tiny_unit_params": "fsdp.wrap_report_tiny_unit_params",
    # parallelism_config (needs fsdp_version 2). With tp_size 1 a replicated mesh becomes fsdp: HYBRID_SHARD.
    "parallelism_config_dp_replicate_size": "parallelism.dp_replicate_size",
    "parallelism_config_dp_shard_size": "parallelism.dp_shard_size",
    "parallelism_config_tp_size": "parallelism.tp_size",
    "parallelism_config_cp_size": Refused("context parallelism is not supported yet", (1,)),
    "parallelism_config_cp_backend": _CP_ONLY, "parallelism_config_cp_comm_strategy": _CP_ONLY,
    "parallelism_config_sp_size": Refused("sequence parallelism (DeepSpeed Ulysses) is not supported", (1,)),
    "parallelism_config_sp_backend": _SP_ONLY, "parallelism_config_sp_seq_length": _SP_ONLY,
    "parallelism_config_sp_seq_length_is_variable": _SP_ONLY, "parallelism_config_sp_attn_implementation": _SP_ONLY,
    "parallelism_config_tp_handler": Refused(_OBJECT), "parallelism_config_cp_handler": Refused(_OBJECT),
    "parallelism_config_sp_handler": Refused(_OBJECT),
}
SECTIONS = {"fsdp_config": "fsdp_", "parallelism_config": "parallelism_config_"}
_SCHEMAS = {"fsdp": FSDPConfig, "trainer": TrainerConfig, "parallelism": ParallelismConfig}
_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_FSDP2_DROPS = ("backward_prefetch", "use_orig_params", "sync_module_states")
_BOOLS = {**dict.fromkeys(("y", "yes", "t", "true", "on", "1"), True),  # as Accelerate's str_to_bool reads them
          **dict.fromkeys(("n", "no", "f", "false", "off", "0"), False)}


def section_of(key: str) -> str:
    """The section a ``KEYS`` entry is written in: ``fsdp_config``, ``parallelism_config`` or '' (top)."""
    return next((s for s, prefix in SECTIONS.items() if key.startswith(prefix) and key != s), "")


def _unset(value: Any) -> bool:
    return value is None or value == {} or value == []  # accelerate config drops empty sections as null


def _shown(value: Any) -> Any:
    return str(value).lower() if isinstance(value, bool) else value  # as YAML spells it


def _same(value: Any) -> str:
    return str(value).upper()  # compared case-blind, as Accelerate reads its names


def _entries(data: dict, fail) -> Dict[str, Any]:
    """The file's set keys, its two sections' keys flattened into the same namespace."""
    entries = {str(k): v for k, v in data.items() if k not in SECTIONS and not _unset(v)}
    for section, prefix in SECTIONS.items():
        body = data.get(section)
        if not isinstance(body, (dict, type(None))):
            fail(section, body, "must be a mapping", "write its keys under it")
        for key, value in (body or {}).items():
            key = str(key)
            full = key if section != "fsdp_config" or key.startswith("fsdp") else f"fsdp_{key}"
            if section_of(full) != section or full not in KEYS:
                close = difflib.get_close_matches(full, [k for k in KEYS if section_of(k) == section], n=1)
                fail(f"{section}.{key}", value, "not a key Accelerate writes there",
                     f"did you mean '{close[0]}'?" if close else f"allowed: the {prefix}* keys")
            if not _unset(value):
                entries[full] = value
    return entries


def accelerate_config_overrides(path: str) -> Dict[str, Any]:
    """An ``accelerate config`` YAML → a nested dict of recipe values (``fsdp:``, ``trainer:``,
    ``parallelism:``); anything shardlight cannot honour is one ``ShardlightError`` line."""
    file = Path(path)
    if not file.is_file():
        raise ShardlightError(f"accelerate config not found: {path}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ShardlightError(f"accelerate config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ShardlightError(f"accelerate config {path} must be a mapping")

    def fail(key: str, value: Any, why: str, allowed: str):
        raise ShardlightError(f"accelerate config {path}: {key} is {_shown(value)}: {why}; {allowed}")

    entries = _entries(data, fail)
    out: Dict[str, Dict[str, Any]] = {"fsdp": {}, "trainer": {}, "parallelism": {}}
    origin: Dict[str, str] = {}  # recipe key → the accelerate key it came from
    for key in sorted(entries, key=lambda k: k not in ("compute_environment", "distributed_type")):
        value, rule = entries[key], KEYS.get(key)
        if rule is None:
            close = difflib.get_close_matches(key, [k for k in KEYS if not section_of(k)], n=1)
            fail(key, value, "not a key Accelerate writes", f"did you mean '{close[0]}'?" if close else
                 "allowed: ClusterConfig's keys")
        if isinstance(rule, Refused):
            if _same(value) not in [_same(h) for h in rule.harmless]:
                fail(key, value, rule.why, f"allowed: {', '.join(map(str, map(_shown, rule.harmless)))}, null")
        elif "." in rule:
            section, name = rule.split(".")
            out[section][name], origin[rule] = value, key
    if "fsdp.reshard_after_forward" in origin:  # FSDP1 reads a sharding strategy there
        origin.setdefault("fsdp.sharding_strategy", origin["fsdp.reshard_after_forward"])
    _fsdp(out["fsdp"], fail)
    _trainer(out["trainer"], fail)
    _parallelism(out, fail)
    for recipe_key, key in origin.items():  # the schema's allowed values, refused naming the accelerate key
        section, name = recipe_key.split(".")
        allowed = next(f for f in fields(_SCHEMAS[section]) if f.name == name).metadata.get("allowed")
        value = out[section].get(name)
        if allowed and value is not None and _same(value) not in [_same(a) for a in allowed]:
            fail(key, entries[key], "shardlight does not support this value",
                 f"allowed: {', '.join(str(a) for a in allowed if a is not None)}")
    return {section: values for section, values in out.items() if values}


def _int(key: str, value: Any, fail) -> int:
    if isinstance(value, bool) or not str(value).lstrip("-").isdigit():
        fail(key, value, "not an integer", "give a whole number")
    return int(value)


def _fsdp(fsdp: Dict[str, Any], fail) -> None:
    """Accelerate's per-version spellings → the recipe's: strategy numbers and HYBRID_SHARD_ZERO2, FSDP1's
    strategy name in reshard_after_forward, FSDP2's 'true'/'false', and the keys FSDP2 drops."""
    if str(fsdp.get("fsdp_version", "")).isdigit():
        fsdp["fsdp_version"] = int(fsdp["fsdp_version"])
    v2 = fsdp.get("fsdp_version", 1) == 2
    for key in ("sharding_strategy",) if v2 else ("sharding_strategy", "reshard_after_forward"):
        value = str(fsdp.get(key, "")).upper()
        if value.isdigit() and 1 <= int(value) <= len(_STRATEGIES):
            fsdp[key] = _STRATEGIES[int(value) - 1]
        elif value == "HYBRID_SHARD_ZERO2":
            fsdp[key] = "_HYBRID_SHARD_ZERO2"
    reshard = fsdp.get("reshard_after_forward")
    if not v2:  # (a bool is then refused as no strategy name, below)
        if reshard is not None:  # Accelerate prefers fsdp_sharding_strategy when both are given
            fsdp.setdefault("sharding_strategy", fsdp.pop("reshard_after_forward"))
            fsdp.pop("reshard_after_forward", None)
        return
    if str(reshard).lower() in _BOOLS:  # Accelerate's str_to_bool
        fsdp["reshard_after_forward"] = _BOOLS[str(reshard).lower()]
    for name in _FSDP2_DROPS:
        fsdp.pop(name, None)
    strategy = fsdp.pop("sharding_strategy", "FULL_SHARD")
    if str(strategy).upper() != "FULL_SHARD":
        fail("fsdp_sharding_strategy", strategy, "Accelerate ignores it with fsdp_version 2",
             "use fsdp_reshard_after_forward (false: ZeRO-2) and parallelism_config_dp_replicate_size (HSDP)")
    if _BOOLS.get(str(fsdp.get("forward_prefetch")).lower()):
        fail("fsdp_forward_prefetch", True, "not implemented in FSDP2", "allowed: false, null, or fsdp_version 1")
    fsdp.pop("forward_prefetch", None)


def _trainer(trainer: Dict[str, Any], fail) -> None:
    """num_processes counts every machine's ranks; trainer.devices counts one node's."""
    machines = _int("num_machines", trainer.get("num_nodes", 1), fail)
    processes = _int("num_processes", trainer.pop("devices", -1), fail)
    if processes != -1:  # -1: ClusterConfig's "not set" (the launcher gives it)
        if machines <= 0 or processes <= 0 or processes % machines:
            fail("num_processes", processes, f"not a positive multiple of num_machines {machines}",
                 "allowed: num_machines x ranks per machine")
        trainer["devices"], trainer["num_nodes"] = processes // machines, machines
    if "precision" in trainer:
        precision = "no" if trainer["precision"] is False else str(trainer["precision"]).lower()  # YAML's no
        if precision not in _PRECISION:
            fail("mixed_precision", trainer["precision"], "not supported", f"allowed: {', '.join(_PRECISION)}")
        trainer["precision"] = _PRECISION[precision]
    if str(trainer.pop("accelerator", False)).lower() == "true":
        trainer["accelerator"] = "cpu"


def _parallelism(out: Dict[str, Dict[str, Any]], fail) -> None:
    """Accelerate's mesh → ``parallelism:`` with tensor parallelism; without it, a replicated mesh is
    fsdp HYBRID_SHARD over (replicate, shard), and a plain one needs nothing."""
    p, fsdp, trainer = out["parallelism"], out["fsdp"], out["trainer"]
    if not p:
        return
    if fsdp.get("fsdp_version", 1) != 2:
        fail("parallelism_config", "set", "Accelerate reads it only with fsdp_version 2", "set fsdp_version: 2")
    if _int("parallelism_config_tp_size", p.get("tp_size", 1), fail) > 1:
        return
    replicate = _int("parallelism_config_dp_replicate_size", p.get("dp_replicate_size") or 1, fail)
    shard = _int("parallelism_config_dp_shard_size", p["dp_shard_size"], fail) if "dp_shard_size" in p else None
    p.clear()  # without TP shardlight's mesh is the fsdp: section's
    world = trainer["devices"] * trainer["num_nodes"] if "devices" in trainer else None
    # All sizes 1 (the questionnaire's defaults) asks for no mesh: plain FSDP over every rank.
    if world is not None and shard is not None and replicate * shard not in (1, world):
        fail("parallelism_config_dp_shard_size", shard, f"dp_replicate_size {replicate} x it is not "
             f"num_processes {world}", "allowed: sizes whose product is num_processes")
    if replicate > 1:
        if shard is None and world is None:
            fail("parallelism_config_dp_replicate_size", replicate, "the shard size is unknown",
                 "give parallelism_config_dp_shard_size or num_processes")
        fsdp["sharding_strategy"] = "HYBRID_SHARD"
        fsdp["mesh_shape"] = [replicate, shard if shard is not None else world // replicate]
