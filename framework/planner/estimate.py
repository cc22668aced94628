"""Per-rank memory and per-step time of each sharding strategy, from a ModelSpec, a cluster and a workload
(``planner.inputs``).

Memory (bytes per rank), following what FSDP1 (``use_orig_params``, the shardlight default) allocates:

* parameters, gradients, optimizer state: each FSDP unit (one per transformer block, plus the root with
  embeddings/norm/head) is one flat parameter, each original parameter's start aligned to 16 bytes of the
  compute dtype, padded to a multiple of the process-group size and split into equal shards. The shard is
  in the storage dtype (``model.dtype``; the fp32 shard *is* the master copy under mixed precision, FSDP
  keeps no other), gradients are sharded in the same dtype, AdamW keeps 2 moments in it. NO_SHARD keeps all
  of it on every rank; HYBRID_SHARD shards over its shard group only. CPU offload moves all three to host;
* unsharded buffers (compute dtype): FULL_SHARD/HYBRID gather the root unit for the whole step plus one block
  and ``prefetch`` more; SHARD_GRAD_OP keeps every unit gathered from forward until its backward; plus
  one unit's unsharded gradient before its reduce-scatter;
* activations per micro-batch: per layer and token the tensors a Llama-style block saves for backward
  (norm inputs/outputs, q/k/v, attention output, 4 MLP intermediates; eager attention adds the S×S scores
  and probabilities per head), the fp32 log-softmax of the logits (shardlight's loss upcasts them), and the
  transient at the start of backward (gradients of the log-softmax output and of its fp32 input).
  With activation checkpointing: each block's input only; the transient is the larger of the logits
  gradients and one block recomputed with its gradients. Gradients are freed after each optimizer step,
  so the peak is parameters + optimizer state + buffers + max(activations, gradients + one layer's).

Communication per optimizer step (ring algorithms, bytes each rank sends): FULL_SHARD all-gathers the
parameters in forward and again in backward on every micro-batch and reduce-scatters the gradients once;
SHARD_GRAD_OP all-gathers once per micro-batch; NO_SHARD all-reduces the gradients; HYBRID_SHARD does
FULL_SHARD's collectives inside its shard group and all-reduces its gradient shard across replicas.
Time = bytes ÷ the slowest link the collective crosses (``inter_node_bw`` is per node, shared by its GPUs).
Compute time = model FLOPs ÷ (peak × MFU), ×4/3 with activation checkpointing (forward recomputed).
Exposed communication: what exceeds the compute it overlaps (forward gathers behind forward, gradient
collectives behind backward), plus the first unit's gather and the backward tail: the root unit's gradient
collective (all-reduce for NO_SHARD, reduce-scatter for the sharded strategies) starts after the last
backward compute, for DDP and FSDP alike (``backward_tail_s``).

Tensor parallelism (``tp`` > 1, ``parallelism.tp_size``; FSDP2 over the data-parallel ranks, world / tp):
the parameters the TP plan splits (``ModelSpec.unit_tp_split``: q/k/v/o and the MLP projections) are divided
by tp before FSDP shards them over the data-parallel group, the rest (norms, embeddings, the replicated head)
is not; of a block's activations the head- and width-split ones (q/k/v, attention output, the MLP
intermediates) are divided by tp, the block input, norms and residual stream are not (no sequence
parallelism), and the logits are whole on every TP rank. Each row-sharded module's output is all-reduced in
forward (and again in a checkpointed block's recompute), each column-sharded module's input gradient in
backward (``tp_allreduces``: Megatron's fused layout is 2 + 2 per block, i.e. 4 x layers x batch x seq x
hidden x dtype bytes per micro-batch; Llama's separate q/k/v and gate/up projections make it 2 + 5), each of
batch x seq x hidden in the compute dtype, on the intra-node link, blocking (not overlapped with compute).
Block FLOPs are divided by tp, the head's are not. TP ranks share one batch, so a step trains world / tp
micro-batches: rows are compared per token (``seconds_per_token``), not per step.

LoRA (``peft``): the frozen base keeps its sharded parameters and is all-gathered as before, but has no
optimizer state; the rank-r adapters (``ModelSpec.lora_params``) add parameters, gradients and state. FSDP2
keeps gradients for the trainable parameters only and reduce-scatters just those; FSDP1 (``use_orig_params``,
frozen and trainable weights in one flat parameter) allocates and reduce-scatters the gradient of the whole
flat parameter. Backward skips the frozen weights' gradients: 4 N FLOPs per token instead of 6 N.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from shardlight.errors import ShardlightError
from shardlight.planner.backward_tail import backward_tail_s
from shardlight.planner.inputs import GB, Cluster, Workload
from shardlight.planner.model_spec import ModelSpec

# The optimizers the planner costs: the recipe's optim.name values, what training builds.
from shardlight.recipe.schema import OPTIMIZERS

STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")

PCIE_HOST_BW = 20.0      # GB/s host<->device per GPU (CPU offload)
HOST_OPTIM_BW = 10.0     # GB/s of optimizer-state traffic a host core set sustains per rank (offloaded AdamW)
COLLECTIVE_LATENCY_S = {"intra": 15e-6, "inter": 40e-6}

# State per parameter element, in multiples of the storage dtype's bytes (8-bit AdamW: 2 x 1 byte).
OPTIMIZER_STATES = dict(zip(OPTIMIZERS, (2.0, 2.0, 1.0, 0.5)))


def shard_numels(spec: ModelSpec, group_size: int, compute_bytes: int, sharded: bool, tp: int = 1) -> int:
    """Elements of this rank's flat-parameter shards, summed over units, with FSDP1's padding (each TP-split
    parameter first divided by ``tp``)."""
    align = 16 // compute_bytes
    total = 0
    splits = spec.unit_tp_split if tp > 1 and spec.unit_tp_split else [[False] * len(u) for u in spec.unit_numels]
    for numels, flags in zip(spec.unit_numels, splits):
        flat = 0
        for n in (n // tp if split else n for n, split in zip(numels, flags)):
            if flat % align:
                flat += align - flat % align
            flat += n
        if flat % group_size:
            flat += group_size - flat % group_size
        total += flat // group_size if sharded else flat
    return total


def activation_bytes(spec: ModelSpec, work: Workload, checkpointing: bool, tp: int = 1) -> Dict[str, float]:
    """Saved activations of one micro-batch, the working set of one block, and the logits (per TP rank)."""
    c, tokens = work.compute_bytes, work.tokens_per_micro_batch
    h, i, kv = spec.hidden_size, spec.intermediate_size, spec.num_kv_heads * spec.head_dim
    q = spec.num_heads * spec.head_dim
    attn_tp = tp if tp > 1 and spec.tp_splits_attention else 1
    mlp_tp = tp if tp > 1 and spec.tp_splits_mlp else 1
    mlp = 4 * i if spec.gated_mlp else 2 * i                        # gate, up, act(gate), product | fc1, act
    # norms in/out (whole on every TP rank), q/k/v + attention out (heads split), MLP (width split)
    per_token = c * (2 * h + 2 * h) + c * (q + 2 * kv + 2 * q) / attn_tp + c * mlp / mlp_tp
    if c < 4:
        per_token += 2 * 4 * h                                       # RMSNorm's fp32 upcast, twice per block
    if work.attn_implementation == "eager":
        per_token += 2 * c * spec.num_heads * work.seq_len / attn_tp  # scores + softmax probabilities
    block = per_token * tokens
    embeddings = 2 * h * c * tokens                                  # embedding output, final norm input
    logits = tokens * spec.vocab_size * 4                            # fp32 log-softmax output, kept for backward
    # Start of backward: the gradient of the log-softmax output and of its input (fp32), both alive at once.
    logits_grad = tokens * spec.vocab_size * 8
    if checkpointing:
        saved = spec.num_layers * h * c * tokens                     # each block's input only
        transient = max(logits_grad, 2 * block)                      # or one block recomputed + its grads
    else:
        saved = spec.num_layers * block
        transient = logits_grad
    return {"per_layer": block, "saved": saved + embeddings, "logits": logits, "logits_grad": transient,
            "total": saved + embeddings + logits + transient}


def tp_allreduces(spec: ModelSpec, work: Workload, checkpointing: bool) -> Dict[str, int]:
    """The TP all-reduces of one optimizer step on each rank: ``count`` and ``bytes`` (what they reduce, each
    micro_batch x seq x hidden in the compute dtype), ``forward``/``backward`` counts per block per
    micro-batch. Forward: one per row-sharded module's output (again in a checkpointed block's recompute);
    backward: one per column-sharded module's input gradient."""
    forward = spec.tp_rowwise_per_block * (2 if checkpointing else 1)
    backward = spec.tp_colwise_per_block
    count = (forward + backward) * spec.num_layers * work.accumulate_grad_batches
    each = work.micro_batch_size * work.seq_len * spec.hidden_size * work.compute_bytes
    return {"count": count, "bytes": count * each, "forward": forward, "backward": backward, "each_bytes": each}


def tp_candidates(spec: ModelSpec, cluster: Cluster, work: Workload) -> List[int]:
    """tp sizes > 1 that shardlight would run: dividing the devices of a node (TP stays inside it), the
    attention heads, key/value heads and intermediate size, on a model with a TP plan; none under LoRA."""
    if spec.tp_unplanned or work.peft:
        return []
    sizes = (spec.num_heads, spec.num_kv_heads, spec.intermediate_size)
    return [t for t in range(2, cluster.gpus_per_node + 1)
            if cluster.gpus_per_node % t == 0 and all(n % t == 0 for n in sizes)]


def tp_skipped(spec: ModelSpec, cluster: Cluster, work: Workload) -> Optional[str]:
    """Why no tp size is a candidate, or None when some is."""
    if tp_candidates(spec, cluster, work):
        return None
    if spec.tp_unplanned:
        return spec.tp_unplanned
    if work.peft:
        return f"shardlight does not combine {work.peft} with tensor parallelism"
    if cluster.gpus_per_node < 2:
        return "one GPU per node"
    return (f"no tp size in 2..{cluster.gpus_per_node} divides the node's {cluster.gpus_per_node} GPUs, the "
            f"{spec.num_heads} heads, {spec.num_kv_heads} key/value heads and intermediate size "
            f"{spec.intermediate_size}")


def estimate(spec: ModelSpec, cluster: Cluster, work: Workload, strategy: str, checkpointing: bool = False,
             cpu_offload: bool = False, shard_group_size: Optional[int] = None, tp: int = 1) -> Dict[str, Any]:
    """Per-rank memory and per-step time of one configuration (see the module docstring); ``tp``: the
    tensor-parallel degree, ``strategy`` then shards over the world / tp data-parallel ranks
    (``shard_group_size`` counts data-parallel ranks)."""
    world, c, s = cluster.world_size, work.compute_bytes, work.storage_bytes
    if world % tp or cluster.gpus_per_node % tp:
        raise ShardlightError(f"tp {tp} does not divide the {cluster.gpus_per_node} GPUs of a node")
    dp_world = world // tp
    if strategy == "NO_SHARD":
        group, sharded = dp_world, False
    elif strategy == "HYBRID_SHARD":
        group, sharded = shard_group_size or cluster.gpus_per_node // tp, True
    else:
        group, sharded = dp_world, True
    replicas = max(1, dp_world // group)
    n_local = shard_numels(spec, group, c, sharded and group > 1, tp)
    params, grads = n_local * s, n_local * s
    optim = n_local * s * OPTIMIZER_STATES[work.optimizer]
    trainable = spec.total_params
    if work.peft:
        trainable = spec.lora_params(work.lora_r)
        adapters = math.ceil(trainable / group) if sharded and group > 1 else trainable
        params += adapters * s
        # FSDP1 keeps a gradient for the whole flat parameter, frozen elements included (zeros).
        grads = (n_local + adapters) * s if work.fsdp_version == 1 else adapters * s
        optim = adapters * s * OPTIMIZER_STATES[work.optimizer]
    block, root, total_p = spec.tp_local_params(tp)
    in_flight = 1 + work.prefetch
    if not sharded or group == 1:
        gathered = 0 if c >= s else min(total_p, max(block, root) * in_flight) * c
        grad_buffer = 0
    elif strategy == "SHARD_GRAD_OP":
        gathered, grad_buffer = total_p * c, max(block, root) * c
    else:
        gathered, grad_buffer = (root + block * in_flight) * c, max(block, root) * c
    acts = activation_bytes(spec, work, checkpointing, tp)
    state = 0.0 if cpu_offload else params + grads + optim
    # Gradients are freed after each optimizer step (set_to_none) and appear as backward frees activations:
    # the peak is at the start of backward (all activations, no gradients yet) or at its end (all gradients).
    resident = 0.0 if cpu_offload else params + optim
    grads_gpu = 0.0 if cpu_offload else grads
    peak = resident + gathered + grad_buffer + max(acts["total"], grads_gpu + acts["per_layer"])
    host = params + grads + optim if cpu_offload else 0.0

    # Communication per optimizer step.
    A, P = work.accumulate_grad_batches, total_p
    # What the gradient collectives carry: FSDP2 reduces only the trainable gradients under LoRA.
    G = trainable if work.peft and work.fsdp_version == 2 else total_p
    nodes_spanned = math.ceil(group * tp / cluster.gpus_per_node)  # TP innermost: a DP group spans group x tp
    intra_bw = cluster.intra_node_bw * GB
    inter_bw = cluster.inter_node_bw / cluster.gpus_per_node * GB
    group_bw = intra_bw if nodes_spanned <= 1 else min(intra_bw, inter_bw)
    units = len(spec.unit_numels)
    ring = (group - 1) / group if group > 1 else 0.0
    ag = ring * P * c
    fwd_bytes = bwd_bytes = inter_bytes = 0.0
    collectives = 0
    if strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        fwd_bytes, bwd_bytes = A * ag, A * ag + ring * G * c
        collectives = units * (2 * A + 1)
    elif strategy == "SHARD_GRAD_OP":
        fwd_bytes, bwd_bytes = A * ag, ring * G * c
        collectives = units * (A + 1)
    if strategy == "NO_SHARD":
        r = (dp_world - 1) / dp_world if dp_world > 1 else 0.0
        ar_bytes = 2 * r * G * c
        ar_bw = intra_bw if cluster.nodes == 1 else min(intra_bw, inter_bw)
        bwd_bytes, collectives = ar_bytes, units if dp_world > 1 else 0
        intra_time = ar_bytes / ar_bw
        inter_time = 0.0
    else:
        if strategy == "HYBRID_SHARD" and replicas > 1:
            reduced = math.ceil(G / group) if G != total_p else n_local
            inter_bytes = 2 * (replicas - 1) / replicas * reduced * c
            collectives += units
        intra_time = (fwd_bytes + bwd_bytes) / group_bw
        inter_time = inter_bytes / inter_bw
    if dp_world == 1:
        collectives = 0
    latency = collectives * (COLLECTIVE_LATENCY_S["inter"] if cluster.nodes > 1 else COLLECTIVE_LATENCY_S["intra"])
    comm_fwd = fwd_bytes / group_bw if strategy != "NO_SHARD" else 0.0
    comm_time = intra_time + inter_time + latency
    comm_bwd = comm_time - comm_fwd
    # TP all-reduces: ring over the tp ranks of a node, on the compute's critical path (never hidden).
    tp_ar = tp_allreduces(spec, work, checkpointing) if tp > 1 else {"count": 0, "bytes": 0}
    tp_time = (2 * (tp - 1) / tp * tp_ar["bytes"] / intra_bw + tp_ar["count"] * COLLECTIVE_LATENCY_S["intra"]
               if tp > 1 else 0.0)

    tokens = work.tokens_per_micro_batch * A
    per_token = spec.flops_per_token(work.seq_len)
    if tp > 1:
        head = 6.0 * spec.vocab_size * spec.hidden_size  # the replicated head runs whole on every TP rank
        per_token = (per_token - head) / tp + head
    flops = per_token * tokens
    if work.peft:
        flops *= 4 / 6  # no weight gradients for the frozen base (the adapters' are negligible)
    compute = flops / (cluster.peak_tflops * 1e12 * cluster.mfu) * (4 / 3 if checkpointing else 1)
    compute_fwd = compute * (0.25 if checkpointing else 1 / 3)
    compute_bwd = compute - compute_fwd
    first_unit = (block * c * ring / group_bw) if sharded and group > 1 else 0.0
    tail = backward_tail_s(spec, cluster, work, strategy, group, group_bw, intra_bw, inter_bw, world=dp_world)
    # The tail runs after the last backward compute, for DDP and FSDP alike: only the rest can overlap.
    exposed = (max(0.0, comm_fwd - compute_fwd) + max(0.0, comm_bwd - min(tail, comm_bwd) - compute_bwd)
               + min(tail, comm_bwd) + first_unit + tp_time)
    comm_time += tp_time
    offload_time = 0.0
    if cpu_offload:
        gathers = A * (2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1)
        offload_time = (gathers * params + grads) / (PCIE_HOST_BW * GB) + 2 * (params + grads + optim) / (
            HOST_OPTIM_BW * GB)
    step = compute + exposed + offload_time
    global_tokens = tokens * dp_world
    host_fits = host * cluster.gpus_per_node <= cluster.host_memory_bytes * 0.8
    fits = peak <= cluster.usable_bytes and host_fits
    return {
        "sharding_strategy": strategy,
        "activation_checkpointing": checkpointing,
        "cpu_offload": cpu_offload,
        "shard_group_size": group if sharded else 1,
        "replicas": replicas if sharded else world,
        "mesh_shape": [replicas, group] if strategy == "HYBRID_SHARD" else None,
        "tp_size": tp,
        "dp_size": dp_world,
        "tp_allreduce_count": tp_ar["count"],
        "tp_allreduce_bytes": tp_ar["bytes"],
        "tp_comm_time_s": tp_time,
        "params_bytes": params,
        "grads_bytes": grads,
        "optim_bytes": optim,
        "gpu_state_bytes": state,
        "host_state_bytes": host,
        "gather_buffer_bytes": gathered,
        "grad_buffer_bytes": grad_buffer,
        "activation_bytes": acts["saved"],
        "logits_bytes": acts["logits"] + acts["logits_grad"],
        "activation_per_layer_bytes": acts["per_layer"],
        "peak_bytes": peak,
        "total_with_overhead_bytes": peak + cluster.overhead_bytes,
        "usable_bytes": cluster.usable_bytes,
        "headroom_bytes": cluster.usable_bytes - peak,
        "fits": fits,
        "host_fits": host_fits,
        "comm_bytes_intra": fwd_bytes + bwd_bytes if strategy != "NO_SHARD" else bwd_bytes,
        "comm_bytes_inter": inter_bytes,
        "comm_time_s": comm_time,
        "compute_time_s": compute,
        "exposed_comm_s": exposed,
        "offload_time_s": offload_time,
        "step_time_s": step,
        "bound": "comm-bound" if comm_time > compute else "compute-bound",
        "tokens_per_step_per_rank": tokens,
        # TP ranks share their micro-batches: a device trains tokens / tp of them.
        "tokens_per_sec_per_device": tokens / tp / step if step > 0 else None,
        "global_tokens_per_step": global_tokens,
        "seconds_per_token": step / global_tokens,
        "flops_per_token": spec.flops_per_token(work.seq_len),
        "trainable_params": trainable,
    }


def hybrid_group_sizes(cluster: Cluster) -> List[int]:
    """Shard-group sizes HYBRID_SHARD can use: whole nodes, fewer than all of them, dividing the world."""
    if cluster.nodes < 2:
        return []
    return [k * cluster.gpus_per_node for k in range(1, cluster.nodes) if cluster.nodes % k == 0]


def estimate_tp(spec: ModelSpec, cluster: Cluster, work: Workload,
                sizes: Optional[List[int]] = None) -> List[Dict[str, Any]]:
    """The tensor-parallel candidates: each tp size (default ``tp_candidates``) × SHARD_GRAD_OP, FULL_SHARD
    and HYBRID_SHARD (whole-node groups) over the data-parallel ranks × activation checkpointing, on the GPU
    (CPU offload with TP is not costed)."""
    work.validate()
    rows = []
    for tp in (tp_candidates(spec, cluster, work) if sizes is None else sizes):
        configs = [("SHARD_GRAD_OP", None), ("FULL_SHARD", None)]
        configs += [("HYBRID_SHARD", g // tp) for g in hybrid_group_sizes(cluster)]
        for strategy, group in configs:
            for ckpt in (False, True):
                rows.append(estimate(spec, cluster, work, strategy, ckpt, False, group, tp))
    return rows


def estimate_all(spec: ModelSpec, cluster: Cluster, work: Workload) -> List[Dict[str, Any]]:
    """Every applicable strategy × activation checkpointing × CPU offload (data parallelism alone)."""
    work.validate()
    rows = []
    configs = [(s, None) for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")]
    configs += [("HYBRID_SHARD", g) for g in hybrid_group_sizes(cluster)]
    for strategy, group in configs:
        for ckpt in (False, True):
            for offload in (False, True):
                if offload and strategy == "NO_SHARD":
                    continue  # FSDP offloads shards; NO_SHARD has none (use DeepSpeed-style offload elsewhere)
                rows.append(estimate(spec, cluster, work, strategy, ckpt, offload, group))
    return rows
