"""A whole plan: model spec + cluster + workload → per-strategy estimates and a recommendation (JSON-able)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from shardlight.errors import ShardlightError
from shardlight.planner.estimate import Cluster, Workload, estimate_all
from shardlight.planner.model_spec import ModelSpec, load_hf_config_file, model_spec
from shardlight.planner.recommend import format_table, recommend


def make_plan(spec: ModelSpec, cluster: Cluster, work: Workload) -> Dict[str, Any]:
    work.validate()
    if spec.max_positions and work.seq_len > spec.max_positions:
        raise ShardlightError(f"seq_len {work.seq_len} exceeds the model's maximum positions ({spec.max_positions})")
    rows = estimate_all(spec, cluster, work)
    model = spec.to_json()
    model["flops_per_token"] = spec.flops_per_token(work.seq_len)
    return {
        "recommendation": recommend(rows, cluster, model),
        "strategies": rows,
        "model": model,
        "cluster": cluster.to_json(),
        "workload": dict(vars(work)),
    }


def spec_from_recipe(cfg: Any) -> ModelSpec:
    from shardlight.model import build_hf_config

    config = build_hf_config(cfg.model)
    classes = cfg.fsdp.transformer_cls_names_to_wrap
    spec = model_spec(config, name=cfg.name, block_classes=list(classes) if classes else None,
                      trust_remote_code=cfg.model.trust_remote_code)
    if cfg.fsdp.auto_wrap_policy == "NO_WRAP":
        # One unit: the whole model is gathered at once (SIZE_BASED_WRAP is approximated by the blocks).
        spec.unit_numels = [[n for unit in spec.unit_numels for n in unit]]
        spec.root_params, spec.block_params = spec.total_params, 0
    return spec


def workload_from_recipe(cfg: Any, **overrides: Any) -> Workload:
    t = cfg.trainer
    work = Workload(micro_batch_size=t.micro_batch_size, seq_len=cfg.data.seq_len,
                    accumulate_grad_batches=t.accumulate_grad_batches, precision=t.precision,
                    param_dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation or "sdpa")
    prefetch = cfg.fsdp.backward_prefetch
    if prefetch == "NO_PREFETCH":
        work.prefetch = 0
    for key, value in overrides.items():
        if value is not None:
            setattr(work, key, value)
    return work


def spec_from_hf_config(path: str, block_classes: Optional[List[str]] = None) -> ModelSpec:
    config = load_hf_config_file(path)
    return model_spec(config, name=getattr(config, "_name_or_path", None) or path, block_classes=block_classes)


def render(plan: Dict[str, Any]) -> str:
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
        f"{work['accumulate_grad_batches']}, {work['precision']}, weights {work['param_dtype']}, {work['optimizer']}",
        "",
        format_table(plan["strategies"]),
        "",
        f"recommendation: {rec['label']}" + ("" if rec["fits"] else "  (DOES NOT FIT)"),
    ]
    lines += [f"  - {reason}" for reason in rec["reasons"]]
    mesh = (f" fsdp.mesh_shape=[{rec['mesh_shape'][0]},{rec['mesh_shape'][1]}]" if rec["mesh_shape"] else "")
    lines.append(f"  recipe: fsdp.sharding_strategy={rec['sharding_strategy']}{mesh} "
                 f"fsdp.activation_checkpointing={str(rec['activation_checkpointing']).lower()} "
                 f"fsdp.cpu_offload={str(rec['cpu_offload']).lower()}")
    return "\n".join(lines)
