"""A whole plan: model spec + cluster + workload → per-strategy estimates and a recommendation (JSON-able).

What lives here: the typed inputs a caller states (``ClusterOptions``, ``WorkloadOptions``: ``None`` means
"the recipe's, else the default"), how a recipe turns into a ``ModelSpec`` and a ``Workload``, ``plan_for``
(the one entry point ``shardlight plan`` and ``shardlight profile`` share) and ``render`` (the text table).

The planner sits below the builders, so it does not build a recipe's Hugging Face config itself: callers
pass it (``shardlight.build.build_hf_config(cfg.model)``) to ``spec_from_recipe``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from shardlight.errors import ShardlightError
from shardlight.planner.calibration import apply_to_rows, check_matches
from shardlight.planner.estimate import estimate_all, estimate_tp, tp_skipped
from shardlight.planner.inputs import DTYPE_BYTES, Cluster, Workload, make_cluster
from shardlight.planner.measured import StepModel, measure_rows, measure_tp_contenders
from shardlight.planner.memory_estimate import activation_bytes
from shardlight.planner.model_spec import ModelSpec, load_hf_config_file, model_spec
from shardlight.planner.recommend import find_row, format_table, recommend
from shardlight.recipe import RecipeConfig
from shardlight.strategy.sharded_load import load_host_bytes


@dataclass(frozen=True)
class ClusterOptions:
    """The cluster as a caller states it; ``nodes``/``gpus_per_node`` default to the recipe's
    ``trainer.num_nodes``/``trainer.devices`` (1 and 8 without a recipe)."""

    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    gpu_memory: str = "80GB"
    interconnect: Sequence[str] = ()       # names, each may be comma-separated: nvswitch,infiniband
    intra_node_bw: Optional[float] = None  # GB/s per GPU; wins over the interconnect's
    inter_node_bw: Optional[float] = None  # GB/s per node
    peak_tflops: float = 989.0
    mfu: float = 0.4
    overhead_gb: float = 1.0
    host_memory: str = "1TB"


@dataclass(frozen=True)
class WorkloadOptions:
    """Workload fields that replace the recipe's (or ``Workload()``'s defaults) when not ``None``."""

    micro_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    accumulate_grad_batches: Optional[int] = None
    precision: Optional[str] = None
    param_dtype: Optional[str] = None
    optimizer: Optional[str] = None        # one of inputs.OPTIMIZERS
    peft: Optional[str] = None             # "none" (full fine-tuning), "lora" or "qlora"
    lora_r: Optional[int] = None


def make_plan(spec: ModelSpec, cluster: Cluster, work: Workload, model: Optional[StepModel] = None,
              calibration: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every configuration's estimate and the recommendation among all of them; with ``model``, each peak
    is measured by a fake-tensor training step (``measured.measure_rows``), else analytic; with
    ``calibration`` (``shardlight.planner.calibration``, measured by ``shardlight profile``), step times come
    from it instead of the table's bandwidths and peak x MFU."""
    work.validate()
    if calibration is not None:
        check_matches(calibration, cluster.world_size)
    if spec.max_positions and work.seq_len > spec.max_positions:
        raise ShardlightError(f"seq_len {work.seq_len} exceeds the model's maximum positions ({spec.max_positions})")
    # The plan is a JSON document: each configuration's ``Estimate`` becomes its row, which the measured memory
    # (``measured``) and a calibration (``calibration.apply_to_rows``) then annotate.
    rows = [e.to_json() for e in estimate_all(spec, cluster, work)]
    tp_rows = [e.to_json() for e in estimate_tp(spec, cluster, work)]
    tp_info: Dict[str, Any] = {"candidates": sorted({r["tp_size"] for r in tp_rows}),
                               "skipped": tp_skipped(spec, cluster, work)}
    if calibration is not None:
        apply_to_rows(rows, calibration, spec, work)
        if tp_rows:
            tp_info["skipped"] = "the calibration measured no TP all-reduces; plan without --calibration to cost TP"
            tp_rows = []
    for row in tp_rows:
        row["memory_source"] = "analytic"
    if model is not None:
        memory = measure_rows(rows, model, cluster, work)
    else:
        memory = {"source": "analytic", "reason": "asked for (--analytic)"}
    described = spec.to_json()
    described["flops_per_token"] = spec.flops_per_token(work.seq_len)
    described["compute_bytes"] = work.compute_bytes
    described["largest_tensor_params"] = max((n for unit in spec.unit_numels for n in unit), default=0)
    if model is not None and memory["source"] == "fake-step" and tp_rows:
        # TP rows are measured only where they contend (the rule would pick them on their analytic peak).
        tp_info["measured"] = measure_tp_contenders(rows, tp_rows, model, cluster, work)
    recommendation = recommend(rows, cluster, described, tp_rows=tp_rows)
    selective_checkpointing(recommendation, rows + tp_rows, spec, cluster, work)
    plan = {
        "recommendation": recommendation,
        "strategies": rows,
        "tensor_parallel": tp_rows,
        "tp": tp_info,
        "memory": memory,
        "model": described,
        "cluster": cluster.to_json(),
        "workload": dict(vars(work)),
        "time_source": "calibration" if calibration is not None else "table defaults",
        **({"calibration": calibration} if calibration is not None else {}),
    }
    plan["load"] = host_load(plan, cluster)
    return plan


def host_load(plan: Dict[str, Any], cluster: Cluster) -> Dict[str, Any]:
    """Host RAM per node to load the pretrained weights under the recommendation (``load_host_bytes``, what
    preflight checks): sharded (the default) and with every rank reading the whole model."""
    rec, model, work = plan["recommendation"], plan["model"], plan["workload"]
    width = DTYPE_BYTES[work["param_dtype"]]  # the weights as the ranks load them
    total = model["total_params"] * width
    mesh, tp = rec.get("mesh_shape"), rec.get("tp_size", 1)
    if rec["sharding_strategy"] == "NO_SHARD":
        shard_ranks = 1
    else:
        shard_ranks = (mesh[1] if mesh else cluster.world_size // tp) * tp
    # FSDP1 reads a whole unit before it shards it; FSDP2 and TP read slices (the largest tensor at most).
    fsdp1 = work["fsdp_version"] == 1 and tp == 1
    largest = model["largest_unit_params"] if fsdp1 else model["largest_tensor_params"]
    sharded = load_host_bytes(total, largest * width, shard_ranks, sharded=True, on_gpu=True)
    whole = load_host_bytes(total, 0, 1, sharded=False, on_gpu=True)
    per_node = cluster.gpus_per_node
    return {"weights_bytes": total, "sharded_per_node_bytes": sharded * per_node,
            "whole_per_node_bytes": whole * per_node, "host_memory_bytes": cluster.host_memory_bytes}


def plan_for(spec: ModelSpec, cluster: Cluster, work: Workload, restrict_ckpt: Optional[bool] = None,
             restrict_offload: Optional[bool] = None, model: Optional[StepModel] = None,
             calibration: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``make_plan`` (memory measured by fake steps of ``model`` when given, else analytic), then (when
    ``restrict_ckpt``/``restrict_offload`` is not None) only the configurations with that activation
    checkpointing / CPU offload, the recommendation chosen among them."""
    plan = make_plan(spec, cluster, work, model, calibration)
    if restrict_ckpt is None and restrict_offload is None:
        return plan
    def keep(r: Dict[str, Any]) -> bool:
        return ((restrict_ckpt is None or r["activation_checkpointing"] == restrict_ckpt)
                and (restrict_offload is None or r["cpu_offload"] == restrict_offload))

    rows = [r for r in plan["strategies"] if keep(r)]
    tp_rows = [r for r in plan["tensor_parallel"] if keep(r)]
    if not rows:
        raise ShardlightError("no configuration matches --activation-checkpointing/--cpu-offload")
    if model is not None and plan["memory"]["source"] == "fake-step" and tp_rows:
        # Among the rows left, another TP row may contend: measure it as make_plan measures its contenders.
        measured = plan["tp"].setdefault("measured", [])
        measured += [m for m in measure_tp_contenders(rows, tp_rows, model, cluster, work) if m not in measured]
    plan["recommendation"] = recommend(rows, cluster, plan["model"], context=plan["strategies"], tp_rows=tp_rows)
    selective_checkpointing(plan["recommendation"], rows + tp_rows, spec, cluster, work)
    plan["strategies"] = rows
    plan["tensor_parallel"] = tp_rows
    plan["load"] = host_load(plan, cluster)
    return plan


def selective_checkpointing(rec: Dict[str, Any], rows: List[Dict[str, Any]], spec: ModelSpec, cluster: Cluster,
                            work: Workload) -> None:
    """Where the recommendation fits only by checkpointing every block in full, and selective checkpointing
    (each block keeps its matmul and attention outputs and recomputes only the cheap ops) fits too, alone or with
    the chunked loss (``trainer.loss_chunks`` 8: the fp32 logits never exist), recommend that instead: nearly
    all of the recompute goes. Its peak is the row's plus the analytic difference in activations."""
    if not (rec.get("fits") and rec["activation_checkpointing"]) or work.checkpointing_mode != "full" \
            or work.checkpointing_every != 1:
        return
    group = rec["mesh_shape"][1] if rec.get("mesh_shape") else None
    row = find_row(rows, rec["sharding_strategy"], True, rec["cpu_offload"], group, rec.get("tp_size", 1))
    if row is None:
        return
    tp = row.get("tp_size", 1)
    full = activation_bytes(spec, work, True, tp).total
    for chunks in sorted({work.loss_chunks, 8}) if work.loss_chunks == 1 else (work.loss_chunks,):
        extra = activation_bytes(spec, replace(work, checkpointing_mode="selective", loss_chunks=chunks), True,
                                 tp).total - full
        if row["headroom_bytes"] - extra >= 0:
            break
    else:
        return
    rec["checkpointing_mode"] = "selective"
    with_chunks = ""
    if chunks != work.loss_chunks:
        rec["loss_chunks"] = chunks
        with_chunks = f" with trainer.loss_chunks {chunks} (the fp32 logits never exist)"
    rec["reasons"].append(
        f"Selective activation checkpointing fits too{with_chunks} ({extra / 1e9:.1f} GB more activations, "
        f"{(row['headroom_bytes'] - extra) / 1e9:.1f} GB headroom left): blocks keep their matmul and attention "
        f"outputs and recompute only the cheap ops, so almost none of full checkpointing's extra forward.")


def cluster_for(options: ClusterOptions, cfg: Optional[RecipeConfig] = None) -> Cluster:
    """A validated ``Cluster`` from the caller's options, the recipe's node and device counts by default."""
    nodes = options.nodes or (cfg.trainer.num_nodes if cfg is not None else 1)
    gpus = options.gpus_per_node or (cfg.trainer.devices if cfg is not None else 8)
    return make_cluster(
        nodes=nodes, gpus_per_node=gpus, gpu_memory=options.gpu_memory, interconnect=list(options.interconnect),
        intra_node_bw=options.intra_node_bw, inter_node_bw=options.inter_node_bw, peak_tflops=options.peak_tflops,
        mfu=options.mfu, overhead_gb=options.overhead_gb, host_memory=options.host_memory,
    )


def workload_for(options: WorkloadOptions, cfg: Optional[RecipeConfig] = None) -> Workload:
    """The recipe's workload (``Workload()`` without one) with the caller's options that are not None on top."""
    work = workload_from_recipe(cfg) if cfg is not None else Workload()
    for field in fields(options):
        value = getattr(options, field.name)
        if value is not None:
            setattr(work, field.name, None if (field.name, value) == ("peft", "none") else value)
    return work


def spec_from_recipe(cfg: RecipeConfig, hf_config: Any) -> ModelSpec:
    """The recipe's model as FSDP would wrap it; ``hf_config``: its Hugging Face config, built by the caller
    (``shardlight.build.build_hf_config(cfg.model)``)."""
    classes = cfg.fsdp.transformer_cls_names_to_wrap
    tp_plan = cfg.parallelism.tp_plan
    spec = model_spec(hf_config, name=cfg.name, block_classes=list(classes) if classes else None,
                      trust_remote_code=cfg.model.trust_remote_code, lora_targets=cfg.peft.target_modules,
                      tp_plan=dict(tp_plan) if tp_plan is not None else None)
    if cfg.fsdp.auto_wrap_policy == "NO_WRAP":
        # One unit: the whole model is gathered at once (SIZE_BASED_WRAP is approximated by the blocks).
        spec.unit_numels = [[n for unit in spec.unit_numels for n in unit]]
        spec.root_params, spec.block_params = spec.total_params, 0
    return spec


def step_model_from_recipe(cfg: RecipeConfig, hf_config: Any) -> StepModel:
    """What the fake step builds for this recipe: its config, wrapped as ``cfg.fsdp`` wraps it."""
    classes = cfg.fsdp.transformer_cls_names_to_wrap
    tp_plan = cfg.parallelism.tp_plan
    return StepModel(hf_config, block_classes=list(classes) if classes else None,
                     wrap_blocks=cfg.fsdp.auto_wrap_policy != "NO_WRAP", trust_remote_code=cfg.model.trust_remote_code,
                     tp_plan=dict(tp_plan) if tp_plan is not None else None)


def workload_from_recipe(cfg: RecipeConfig) -> Workload:
    """The recipe's micro-batch, seq_len, accumulation, precision, weight dtype, attention and prefetch."""
    t = cfg.trainer
    work = Workload(micro_batch_size=t.micro_batch_size, seq_len=cfg.data.seq_len,
                    accumulate_grad_batches=t.accumulate_grad_batches, precision=t.precision,
                    param_dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation or "sdpa",
                    optimizer=cfg.optim.name, peft=cfg.peft.method, lora_r=cfg.peft.r,
                    fsdp_version=cfg.fsdp.fsdp_version, loss_chunks=t.loss_chunks,
                    checkpointing_mode=cfg.fsdp.activation_checkpointing_mode,
                    checkpointing_every=cfg.fsdp.activation_checkpointing_every)
    if cfg.fsdp.backward_prefetch == "NO_PREFETCH":
        work.prefetch = 0
    return work


def spec_from_hf_config(path: str, block_classes: Optional[List[str]] = None) -> ModelSpec:
    """A standard Hugging Face ``config.json`` (or the folder holding it) → ``ModelSpec``."""
    return model_from_hf_config(path, block_classes)[0]


def model_from_hf_config(path: str, block_classes: Optional[List[str]] = None) -> Tuple[ModelSpec, StepModel]:
    """A standard Hugging Face ``config.json`` (or the folder holding it) → (``ModelSpec``, ``StepModel``)."""
    config = load_hf_config_file(path)
    spec = model_spec(config, name=getattr(config, "_name_or_path", None) or path, block_classes=block_classes)
    return spec, StepModel(config, block_classes=block_classes)


def memory_line(memory: Dict[str, Any]) -> str:
    if memory.get("source") == "fake-step":
        depths = memory.get("depths") or []
        scaled = (f", each stepped {depths[0]} and {depths[1]} blocks deep and scaled to the model's depth"
                  if len(depths) == 2 else "")
        skipped = (f"; {memory['skipped']} configurations that cannot fit by their analytic floor (state, gathered "
                   f"buffers, half the activations) not stepped" if memory.get("skipped") else "")
        return (f"memory: measured, one fake-tensor training step per configuration ({memory['steps']} steps on a "
                f"fake {memory['world_size']}-rank process group{scaled}, {memory['seconds']:.1f} s{skipped}); "
                f"'analytic' is the closed-form model, 'diff' the measured peak against it")
    return f"memory: analytic model ({memory.get('reason', 'no model config to run')})"


def tp_line(plan: Dict[str, Any]) -> str:
    info = plan.get("tp") or {}
    if not info.get("candidates") or not plan.get("tensor_parallel"):
        return f"tensor parallelism: not costed ({info.get('skipped') or 'no candidate'})"
    measured = info.get("measured") or []
    how = (f"memory analytic except {', '.join(measured)} (fake step with a TP mesh, measured where they contend)"
           if measured else "memory analytic (the fake step measures a TP row only when the rule would pick it)"
           if plan.get("memory", {}).get("source") == "fake-step" else "memory analytic")
    return (f"tensor parallelism: tp {', '.join(map(str, info['candidates']))} costed (divide the heads, key/value "
            f"heads, intermediate size and a node's GPUs; FSDP2 over world / tp ranks); {how}")


def time_line(plan: Dict[str, Any]) -> str:
    cal = plan.get("calibration")
    if not cal:
        return "time: table defaults (the cluster's bandwidths, peak x MFU); --calibration profile.json measures them"
    return (f"time: calibrated by shardlight profile on {cal['world_size']} {cal['device_kind']} ranks "
            f"({cal['backend']}): {cal['achieved_tflops'] * 1e3:.3g} GFLOP/s per rank, "
            f"{cal['host_overhead_s'] * 1e3:.3g} ms host time per step, measured collective latency and bandwidth")


def load_line(plan: Dict[str, Any]) -> str:
    load = plan["load"]
    host = load["host_memory_bytes"]

    def gb(n: float) -> str:
        return f"{n / 1e9:.0f} GB" + (" (MORE THAN THE NODE HAS)" if n > host else "")

    return (f"load: {load['weights_bytes'] / 1e9:.0f} GB of weights; host RAM per node "
            f"{gb(load['sharded_per_node_bytes'])} reading each rank's shards (the default), "
            f"{gb(load['whole_per_node_bytes'])} with "
            f"fsdp.cpu_ram_efficient_loading=false (every rank the whole model); {host / 1e9:.0f} GB per node")


def render(plan: Dict[str, Any]) -> str:
    """What ``shardlight plan`` prints: model, cluster, workload, the table, the recommendation and why."""
    rec, model, cluster = plan["recommendation"], plan["model"], plan["cluster"]
    work = plan["workload"]
    lines = [
        f"model: {model['name']} ({model['model_type']}), {model['total_params'] / 1e9:.2f}B params, "
        f"{model['num_blocks']} x {model['block_class']} ({model['block_params'] / 1e6:.0f}M each), "
        f"root unit {model['root_params'] / 1e6:.0f}M",
        f"cluster: {cluster['nodes']} node(s) x {cluster['gpus_per_node']} GPU(s), "
        f"{cluster['gpu_memory_gb']:.0f} GB each, intra {cluster['intra_node']} {cluster['intra_node_bw']:g} GB/s, "
        f"inter {cluster['inter_node']} {cluster['inter_node_bw']:g} GB/s/node, "
        f"{cluster['peak_tflops']:g} TFLOP/s peak at {cluster['mfu']:.0%} MFU",
        f"workload: micro-batch {work['micro_batch_size']} x seq {work['seq_len']} x accumulate "
        f"{work['accumulate_grad_batches']}, {work['precision']}, weights {work['param_dtype']}, {work['optimizer']}"
        + (f", {work['peft']} r={work['lora_r']} ({plan['strategies'][0]['trainable_params']:,} trainable params, "
           f"base frozen; FSDP{work['fsdp_version']})" if work.get("peft") else ""),
        memory_line(plan.get("memory", {})),
        tp_line(plan),
        time_line(plan),
        load_line(plan),
        "",
        format_table(plan["strategies"] + plan.get("tensor_parallel", [])),
        "",
        f"recommendation: {rec['label']}" + ("" if rec["fits"] else "  (DOES NOT FIT)"),
    ]
    lines += [f"  - {reason}" for reason in rec["reasons"]]
    mesh = (f" fsdp.mesh_shape=[{rec['mesh_shape'][0]},{rec['mesh_shape'][1]}]" if rec["mesh_shape"] else "")
    if rec.get("tp_size", 1) > 1:
        mesh = f" fsdp.fsdp_version=2 parallelism.tp_size={rec['tp_size']}"
        if rec["mesh_shape"]:
            mesh += (f" parallelism.dp_replicate_size={rec['mesh_shape'][0]} "
                     f"parallelism.dp_shard_size={rec['mesh_shape'][1]}")
    lines.append(f"  recipe: fsdp.sharding_strategy={rec['sharding_strategy']}{mesh} "
                 f"fsdp.activation_checkpointing={str(rec['activation_checkpointing']).lower()} "
                 + (f"fsdp.activation_checkpointing_mode={rec['checkpointing_mode']} "
                    if rec.get("checkpointing_mode") else "")
                 + (f"trainer.loss_chunks={rec['loss_chunks']} " if rec.get("loss_chunks") else "")
                 + f"fsdp.cpu_offload={str(rec['cpu_offload']).lower()}")
    return "\n".join(lines)
