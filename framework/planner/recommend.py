"""The decision: the seed's table (DDP if model + optimizer fit, SHARD_GRAD_OP if only the model fits,
FULL_SHARD if the model does not fit, HYBRID_SHARD across nodes) made physical. Among the configurations
whose estimated peak fits in usable GPU memory, the fastest wins — per token trained, which for data
parallelism alone is per step, since tensor-parallel ranks share a batch and a step then trains tp times
fewer tokens; near-ties (within ``TIE``) go to data parallelism alone, then to the simpler strategy, then to
no checkpointing, then to no offload. Reasons are plain words."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from shardlight.planner.inputs import GB, Cluster

TIE = 0.03
# Parameters per FSDP unit that keep all-gathers big enough to reach bus bandwidth yet small enough to
# overlap with one unit's compute and to bound the unsharded buffers (for models of LARGE_MODEL and up).
UNIT_RANGE = (50e6, 200e6)
LARGE_MODEL = 1e9
SIMPLICITY = {"NO_SHARD": 0, "SHARD_GRAD_OP": 1, "HYBRID_SHARD": 2, "FULL_SHARD": 3}


def gb(value: float) -> str:
    if abs(value) >= 0.1 * GB:
        return f"{value / GB:.1f} GB"
    return f"{value / 1e6:.2f} MB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.3f} ms"


def params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def find_row(rows: List[Dict[str, Any]], strategy: str, ckpt: bool = False, offload: bool = False,
             group: Optional[int] = None, tp: int = 1) -> Optional[Dict[str, Any]]:
    """The estimate of one configuration (any shard group size unless ``group``; no TP unless ``tp``), or None."""
    for row in rows:
        if (row["sharding_strategy"] == strategy and row["activation_checkpointing"] == ckpt
                and row["cpu_offload"] == offload and (group is None or row["shard_group_size"] == group)
                and row.get("tp_size", 1) == tp):
            return row
    return None


def label(row: Dict[str, Any]) -> str:
    name = row["sharding_strategy"]
    if name == "HYBRID_SHARD":
        name += f"[{row['replicas']}x{row['shard_group_size']}]"
    if row.get("tp_size", 1) > 1:
        name += f" tp{row['tp_size']}"
    extras = [x for x, on in (("ckpt", row["activation_checkpointing"]), ("offload", row["cpu_offload"])) if on]
    return name + (f" +{'+'.join(extras)}" if extras else "")


def _rank_key(row: Dict[str, Any]):
    return (row.get("tp_size", 1) > 1, SIMPLICITY[row["sharding_strategy"]], row["activation_checkpointing"],
            row["cpu_offload"], row.get("tp_size", 1))


def per_token(row: Dict[str, Any]) -> float:
    """Seconds per token trained by the whole cluster: the step time for rows of one global batch, and what
    makes a TP row (world / tp micro-batches per step) comparable with them."""
    return row["step_time_s"] / row.get("global_tokens_per_step", 1)


def choose(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None
    fastest = min(per_token(r) for r in fitting)
    near = [r for r in fitting if per_token(r) <= fastest * (1 + TIE)]
    return min(near, key=_rank_key)


def why_not_ddp(rows: List[Dict[str, Any]], best: Dict[str, Any]) -> str:
    """Why ``choose`` did not take DDP, in the terms of its rule (fits, then fastest, near-ties to the simpler)."""
    ddp = [r for r in rows if r["sharding_strategy"] == "NO_SHARD"]
    fitting = [r for r in ddp if r["fits"]]
    if not ddp:
        return "DDP (NO_SHARD) is not among the configurations planned"
    if not fitting:
        least = min(ddp, key=lambda r: r["peak_bytes"])
        return (f"DDP does not fit: replicated weights, gradients and optimizer state with the activations need "
                f"{gb(least['peak_bytes'])} per GPU ({label(least)})")
    fastest = min(fitting, key=lambda r: r["step_time_s"])
    margin = fastest["step_time_s"] / best["step_time_s"] - 1
    return (f"it is estimated {margin:.0%} faster than DDP ({ms(best['step_time_s'])} vs "
            f"{ms(fastest['step_time_s'])} per step), more than the {TIE:.0%} within which the simpler strategy wins")


def wrap_advice(model: Dict[str, Any], strategy: str) -> Optional[str]:
    """A unit size to wrap at when a large sharded model's blocks are far from ``UNIT_RANGE``, with the
    per-unit all-gather each implies; None when the blocks are fine (or nothing is gathered)."""
    block, c = model.get("block_params") or 0, model.get("compute_bytes", 2)
    low, high = UNIT_RANGE
    # "Far from" the range: more than a factor of two outside it; near misses are not worth a re-wrap.
    if strategy == "NO_SHARD" or model["total_params"] < LARGE_MODEL or not block or low / 2 <= block <= 2 * high:
        return None
    now = (f"each unit is one {model['block_class']} of {params(block)} parameters, a {gb(block * c)} all-gather "
           f"per unit")
    if block < low:
        per_unit = -(-int(low) // int(block))  # blocks per unit to reach the range's lower end
        return (f"Wrap granularity: {now}, below the {params(low)}-{params(high)} that keeps gathers efficient. "
                f"Group about {per_unit} blocks per unit (fsdp.auto_wrap_policy=SIZE_BASED_WRAP "
                f"fsdp.min_num_params={per_unit * block}): {gb(per_unit * block * c)} per all-gather, "
                f"{-(-model['num_blocks'] // per_unit)} units.")
    target = int((low + high) / 2)
    return (f"Wrap granularity: {now}, above the {params(low)}-{params(high)} that overlaps with one unit's "
            f"compute and bounds the unsharded buffers. Wrap the block's submodules instead "
            f"(fsdp.auto_wrap_policy=SIZE_BASED_WRAP fsdp.min_num_params={target}): about {gb(target * c)} per "
            f"all-gather, {-(-block // target)} units per block.")


def one_node_hybrid_reasons(every: List[Dict[str, Any]], cluster: Cluster) -> List[str]:
    """On several nodes, when a one-node HYBRID_SHARD group cannot hold the model on its GPUs: that, in words."""
    if cluster.nodes < 2:
        return []
    usable = cluster.usable_bytes
    one_node = [r for r in every if r["sharding_strategy"] == "HYBRID_SHARD"
                and r["shard_group_size"] == cluster.gpus_per_node]
    on_gpu = [r for r in one_node if not r["cpu_offload"]]
    if on_gpu and not any(r["fits"] for r in on_gpu):
        least = min(on_gpu, key=lambda r: r["peak_bytes"])
        offloaded = [r for r in one_node if r["cpu_offload"] and r["fits"]]
        return [
            f"HYBRID_SHARD with a one-node shard group ({cluster.gpus_per_node} GPUs, "
            f"{gb(cluster.gpus_per_node * cluster.gpu_memory_bytes)} aggregate) cannot hold this model on its "
            f"GPUs: each GPU would need {gb(least['peak_bytes'])} even with activation checkpointing "
            f"({gb(least['gpu_state_bytes'])} of sharded state) > {gb(usable)} usable. "
            + ("Only with CPU offload does it fit. " if offloaded else
               "With CPU offload the node's host RAM cannot hold it either. " if any(
                   r["cpu_offload"] for r in one_node) else "")
            + f"A larger shard group (fsdp.mesh_shape) or FULL_SHARD over all {cluster.world_size} GPUs can."]
    return []


def bound_reason(best: Dict[str, Any], cluster: Cluster) -> str:
    comm, compute = best["comm_time_s"], best["compute_time_s"]
    link = f"{cluster.inter_node} {cluster.inter_node_bw:g} GB/s/node" if cluster.nodes > 1 else \
        f"{cluster.intra_node} {cluster.intra_node_bw:g} GB/s"
    if best["bound"] == "comm-bound":
        return (f"Comm-bound: {ms(comm)} of collectives vs {ms(compute)} of compute per step over "
                f"{link}; about {ms(best['exposed_comm_s'])} cannot hide behind compute. Raise the micro-batch "
                f"or accumulation (more compute per gather), or use a faster interconnect.")
    return (f"Compute-bound: {ms(comm)} of collectives can hide behind {ms(compute)} "
            f"of compute per step over {link}.")


def tp_reasons(best: Dict[str, Any], dp_rows: List[Dict[str, Any]], tp_rows: List[Dict[str, Any]],
               cluster: Cluster) -> List[str]:
    """Why the rule took tensor parallelism (``best`` has tp > 1), or why it did not."""
    dp_best = choose(dp_rows)
    if best.get("tp_size", 1) == 1:
        fitting = [r for r in tp_rows if r["fits"]]
        if not tp_rows:
            return []
        if not fitting:
            least = min(tp_rows, key=lambda r: r["peak_bytes"])
            return [f"Tensor parallelism: no TP candidate fits either (smallest {label(least)} at "
                    f"{gb(least['peak_bytes'])} per GPU)."]
        tp_best = min(fitting, key=per_token)
        margin = per_token(tp_best) / per_token(best) - 1
        return [f"Tensor parallelism not chosen: the fastest TP candidate, {label(tp_best)}, is estimated "
                + (f"{margin:.0%} slower per token" if margin > 0 else f"within {TIE:.0%} per token (data "
                   f"parallelism alone wins near-ties)")
                + f" ({ms(tp_best['step_time_s'])} per step for {tp_best['global_tokens_per_step']:,} tokens vs "
                  f"{ms(best['step_time_s'])} for {best['global_tokens_per_step']:,}); its "
                  f"{tp_best['tp_allreduce_count']} all-reduces per step cost {ms(tp_best['tp_comm_time_s'])}, "
                  f"not overlapped."]
    tp = best["tp_size"]
    reasons = []
    if dp_best is None:
        least = min(dp_rows, key=lambda r: (not r["host_fits"], r["peak_bytes"])) if dp_rows else None
        what = (f": the smallest is {label(least)} at {gb(least['peak_bytes'])} per GPU (activations "
                f"{gb(least['activation_bytes'] + least['logits_bytes'])})" if least else "")
        reasons.append(
            f"Tensor parallelism (tp {tp}): no data-parallel configuration fits{what}. TP over {tp} GPUs of a node "
            f"splits each block's weights and its attention/MLP activations {tp} ways: {label(best)} needs "
            f"{gb(best['peak_bytes'])} per GPU (activations {gb(best['activation_bytes'] + best['logits_bytes'])}).")
    else:
        margin = per_token(dp_best) / per_token(best) - 1
        reasons.append(
            f"Tensor parallelism (tp {tp}): estimated {margin:.0%} faster per token than the fastest data-parallel "
            f"configuration, {label(dp_best)}, more than the {TIE:.0%} within which data parallelism alone wins: "
            f"over its {dp_best['dp_size']} data-parallel ranks {ms(dp_best['exposed_comm_s'])} of "
            f"{ms(dp_best['comm_time_s'])} collectives per step are not hidden by {ms(dp_best['compute_time_s'])} of "
            f"compute; TP shrinks the data-parallel group to {best['dp_size']} ranks."
            + (f" Data parallelism alone fits only with activation checkpointing (~1/3 more compute); tp {tp} fits "
               f"without it." if not best["activation_checkpointing"] and not any(
                   r["fits"] and not r["activation_checkpointing"] for r in dp_rows) else ""))
    reasons.append(
        f"TP communication: {best['tp_allreduce_count']} activation all-reduces per step (per block and "
        f"micro-batch one per row-sharded output in forward, one per column-sharded input gradient in backward), "
        f"{gb(best['tp_allreduce_bytes'])} in all, {ms(best['tp_comm_time_s'])} on {cluster.intra_node} "
        f"{cluster.intra_node_bw:g} GB/s inside the node, not overlapped with compute.")
    reasons.append(
        f"The {tp} ranks of a TP group read the same micro-batches: a step trains those of {best['dp_size']} "
        f"data-parallel rank(s), {best['global_tokens_per_step']:,} tokens; raise accumulate_grad_batches {tp}x to "
        f"keep the tokens per step. TP needs fsdp.fsdp_version: 2.")
    return reasons


def recommend(rows: List[Dict[str, Any]], cluster: Cluster, model: Dict[str, Any],
              context: Optional[List[Dict[str, Any]]] = None,
              tp_rows: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """``{"sharding_strategy", "activation_checkpointing", "cpu_offload", "mesh_shape", "tp_size", "fits",
    "reasons"}``, chosen among ``rows`` and ``tp_rows`` (the tensor-parallel candidates); ``context`` (default
    ``rows``): every data-parallel estimate, for the reasons' comparisons."""
    tp_rows = tp_rows or []
    best = choose(rows + tp_rows)
    if best is not None and best.get("tp_size", 1) > 1:
        return _tp_result(best, rows, tp_rows, cluster, model, context)
    result = _recommend_dp(rows, cluster, model, context)
    if best is not None:
        result["reasons"] += tp_reasons(best, rows, tp_rows, cluster)
    elif tp_rows:
        least = min(tp_rows, key=lambda r: r["peak_bytes"])
        result["reasons"].append(f"Tensor parallelism does not fit either: the smallest TP candidate is "
                                 f"{label(least)} at {gb(least['peak_bytes'])} per GPU.")
    return result


def _tp_result(best: Dict[str, Any], rows: List[Dict[str, Any]], tp_rows: List[Dict[str, Any]], cluster: Cluster,
               model: Dict[str, Any], context: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    every = context or rows
    reasons: List[str] = []
    ddp = find_row(every, "NO_SHARD")
    if ddp is not None:
        reasons.append(f"{params(model['total_params'])} parameters: replicated weights take "
                       f"{gb(ddp['params_bytes'])} per GPU; usable memory is {gb(cluster.usable_bytes)} per GPU.")
    reasons += tp_reasons(best, rows, tp_rows, cluster)
    plain = find_row(tp_rows, best["sharding_strategy"], False, False, best["shard_group_size"], best["tp_size"])
    if best["activation_checkpointing"] and plain is not None and not plain["fits"]:
        reasons.append(f"Activation checkpointing: without it activations need "
                       f"{gb(plain['activation_bytes'] + plain['logits_bytes'])} per GPU even with tp "
                       f"{best['tp_size']} and the peak {gb(plain['peak_bytes'])} does not fit; it costs ~1/3 more "
                       f"compute and repeats the forward all-reduces.")
    reasons += one_node_hybrid_reasons(every, cluster)
    fsdp_comm = best["comm_time_s"] - best["tp_comm_time_s"]
    link = f"{cluster.inter_node} {cluster.inter_node_bw:g} GB/s/node" if cluster.nodes > 1 else \
        f"{cluster.intra_node} {cluster.intra_node_bw:g} GB/s"
    reasons.append(f"{'Comm-bound' if best['bound'] == 'comm-bound' else 'Compute-bound'}: {ms(fsdp_comm)} of FSDP "
                   f"collectives over {link} and {ms(best['tp_comm_time_s'])} of TP all-reduces vs "
                   f"{ms(best['compute_time_s'])} of compute per step; the TP all-reduces block the compute, so about "
                   f"{ms(best['exposed_comm_s'])} in all is not hidden.")
    return _result(best, True, reasons)


def _recommend_dp(rows: List[Dict[str, Any]], cluster: Cluster, model: Dict[str, Any],
                  context: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    every = context or rows
    usable = cluster.usable_bytes
    reasons: List[str] = []
    best = choose(rows)
    ddp = find_row(every, "NO_SHARD") or next((r for r in every if r["sharding_strategy"] == "NO_SHARD"), None)
    if ddp is not None:
        state_ddp = ddp["params_bytes"] + ddp["grads_bytes"] + ddp["optim_bytes"]
        reasons.append(
            f"{params(model['total_params'])} parameters: replicated weights take {gb(ddp['params_bytes'])} per GPU, "
            f"weights + gradients + optimizer state {gb(state_ddp)}; usable memory is {gb(usable)} per GPU "
            f"({gb(cluster.gpu_memory_bytes)} x {cluster.usable_fraction:.0%} minus {gb(cluster.overhead_bytes)} "
            f"runtime).")
    if best is None:
        smallest = min(rows, key=lambda r: (not r["host_fits"], r["peak_bytes"]))
        reasons.append(
            f"Nothing fits: the smallest estimate is {label(smallest)} at {gb(smallest['peak_bytes'])} per GPU "
            f"(activations {gb(smallest['activation_bytes'] + smallest['logits_bytes'])}). Lower the micro-batch "
            f"size or seq_len, or add GPUs."
        )
        return _result(smallest, False, reasons)

    name = best["sharding_strategy"]
    if name == "NO_SHARD":
        reasons.append("Model + gradients + optimizer state fit on one GPU with the activations: plain data "
                       "parallelism (NO_SHARD, i.e. DDP) — one gradient all-reduce per step, no parameter gathers.")
    elif name == "SHARD_GRAD_OP":
        reasons.append(f"SHARD_GRAD_OP (ZeRO-2): {why_not_ddp(rows, best)}; the weights do fit, so parameters are "
                       f"gathered once per micro-batch and kept through backward "
                       f"({gb(best['gather_buffer_bytes'])} unsharded).")
    elif name == "FULL_SHARD":
        sgo = find_row(every, "SHARD_GRAD_OP", best["activation_checkpointing"], best["cpu_offload"])
        if sgo is not None and not sgo["fits"]:
            reasons.append(f"FULL_SHARD: the model does not fit unsharded alongside its shards "
                           f"(SHARD_GRAD_OP would need {gb(sgo['peak_bytes'])} per GPU); FULL_SHARD gathers one "
                           f"block at a time and frees it after use.")
        else:
            reasons.append(f"FULL_SHARD: fastest configuration that fits by the estimate; {why_not_ddp(rows, best)}.")
    else:
        reasons.append(
            f"HYBRID_SHARD with mesh {best['replicas']} replicas x {best['shard_group_size']} GPUs: parameter "
            f"all-gathers stay inside the shard group; only the gradient shard is all-reduced across replicas "
            f"({gb(best['comm_bytes_inter'])} per GPU per step between nodes).")
    reasons += one_node_hybrid_reasons(every, cluster)
    if best["activation_checkpointing"]:
        plain = find_row(every, name, False, best["cpu_offload"],
                         best["shard_group_size"] if name == "HYBRID_SHARD" else None)
        if plain is not None and not plain["fits"]:
            reasons.append(f"Activation checkpointing: without it activations need "
                           f"{gb(plain['activation_bytes'] + plain['logits_bytes'])} and the peak "
                           f"{gb(plain['peak_bytes'])} does not fit; it costs ~1/3 more compute.")
    if best["cpu_offload"]:
        reasons.append(f"Offloaded state takes {gb(best['host_state_bytes'] * cluster.gpus_per_node)} of host RAM "
                       f"per node ({gb(cluster.host_memory_bytes)} available, 80% usable).")
    if best["cpu_offload"]:
        on_gpu = find_row(every, name, best["activation_checkpointing"], False,
                       best["shard_group_size"] if name == "HYBRID_SHARD" else None)
        why = ("the sharded state does not fit on the GPU otherwise" if on_gpu is None or not on_gpu["fits"]
               else "as requested (it would fit without)")
        reasons.append(f"CPU offload: {why}; it adds {ms(best['offload_time_s'])} per step of host transfers and "
                       f"host optimizer.")
    reasons.append(bound_reason(best, cluster))
    advice = wrap_advice(model, name)
    if advice:
        reasons.append(advice)
    if cluster.nodes > 1 and name != "HYBRID_SHARD":
        hybrids = [r for r in rows if r["sharding_strategy"] == "HYBRID_SHARD" and r["fits"]]
        if hybrids:
            h = min(hybrids, key=lambda r: r["step_time_s"])
            reasons.append(f"{label(h)} also fits but is estimated slower ({ms(h['step_time_s'])} vs "
                           f"{ms(best['step_time_s'])} per step).")
    return _result(best, True, reasons)


def _result(row: Dict[str, Any], fits: bool, reasons: List[str]) -> Dict[str, Any]:
    return {
        "sharding_strategy": row["sharding_strategy"],
        "activation_checkpointing": row["activation_checkpointing"],
        "cpu_offload": row["cpu_offload"],
        "mesh_shape": row["mesh_shape"],
        "tp_size": row.get("tp_size", 1),
        "dp_size": row.get("dp_size"),
        "fits": fits,
        "label": label(row),
        "peak_gb": row["peak_bytes"] / GB,
        "step_time_s": row["step_time_s"],
        "reasons": reasons,
    }


def format_table(rows: List[Dict[str, Any]]) -> str:
    measured = any(r.get("memory_source") == "fake-step" for r in rows)
    header = ("configuration", "tp", "params", "grads", "optim", "gather", "activ", "peak", *(
        ("analytic", "diff") if measured else ()), "headroom", "fits", "comm ms", "compute ms", "step ms", "bound")
    lines = [header]
    for r in rows:
        fake = r.get("memory_source") == "fake-step"
        activ = r["measured_activation_bytes"] if fake else r["activation_bytes"] + r["logits_bytes"]
        versus = ()
        if measured:
            analytic = r.get("analytic_peak_bytes", r["peak_bytes"])
            versus = (f"{analytic / GB:.2f}", f"{(analytic - r['peak_bytes']) / r['peak_bytes']:+.1%}" if fake
                      else "analytic")
        lines.append((
            label(r), str(r.get("tp_size", 1)), f"{r['params_bytes'] / GB:.2f}", f"{r['grads_bytes'] / GB:.2f}",
            f"{r['optim_bytes'] / GB:.2f}",
            f"{(r['gather_buffer_bytes'] + r['grad_buffer_bytes']) / GB:.2f}",
            f"{activ / GB:.2f}", f"{r['peak_bytes'] / GB:.2f}", *versus,
            f"{r['headroom_bytes'] / GB:.2f}", "yes" if r["fits"] else "no",
            f"{r['comm_time_s'] * 1e3:.1f}", f"{r['compute_time_s'] * 1e3:.1f}", f"{r['step_time_s'] * 1e3:.1f}",
            r["bound"]))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
           for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    note = ("; activ and peak measured by the fake step, params/grads/optim/gather analytic (where the bytes go), "
            "diff = analytic vs measured peak ('analytic': not measured)" if measured else "")
    if any(r.get("tp_size", 1) > 1 for r in rows):
        note += "; tp: tensor-parallel degree, its step trains world / tp micro-batches, compared per token"
    return "\n".join(out) + f"\n(GB per rank; gather = unsharded parameter + gradient buffers{note})"
