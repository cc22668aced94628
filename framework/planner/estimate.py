"""Per-rank memory and per-step time of each sharding strategy, from a ModelSpec, a cluster and a workload
(``planner.inputs``).

Memory (bytes per rank): ``planner.memory_estimate``.

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
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from shardlight.planner.inputs import GB, Cluster, Workload
from shardlight.planner.memory_estimate import Layout, Memory, layout, memory
from shardlight.planner.model_spec import ModelSpec

# The optimizers the planner costs: the recipe's optim.name values, what training builds.

STRATEGIES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")

PCIE_HOST_BW = 20.0      # GB/s host<->device per GPU (CPU offload)
HOST_OPTIM_BW = 10.0     # GB/s of optimizer-state traffic a host core set sustains per rank (offloaded AdamW)
COLLECTIVE_LATENCY_S = {"intra": 15e-6, "inter": 40e-6}

@dataclass(frozen=True)
class TPAllReduces:
    """The TP all-reduces of one optimizer step on a rank."""

    count: int          # all of them
    bytes: int          # what they reduce in all
    forward: int        # per block and micro-batch, in forward (and a checkpointed block's recompute)
    backward: int       # per block and micro-batch, in backward
    each_bytes: int     # one of them: micro_batch x seq x hidden in the compute dtype


def tp_allreduces(spec: ModelSpec, work: Workload, checkpointing: bool) -> TPAllReduces:
    """The TP all-reduces of one optimizer step on each rank. Forward: one per row-sharded module's output
    (again in a checkpointed block's recompute); backward: one per column-sharded module's input gradient."""
    forward = spec.tp_rowwise_per_block * (2 if checkpointing else 1)
    backward = spec.tp_colwise_per_block
    count = (forward + backward) * spec.num_layers * work.accumulate_grad_batches
    each = work.micro_batch_size * work.seq_len * spec.hidden_size * work.compute_bytes
    return TPAllReduces(count=count, bytes=count * each, forward=forward, backward=backward, each_bytes=each)


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


@dataclass(frozen=True)
class Communication:
    """Collectives per optimizer step on a rank: bytes sent and seconds (see the module docstring)."""

    bytes_intra: float        # FSDP/DDP collectives inside the data-parallel group
    bytes_inter: float        # HYBRID_SHARD's all-reduce across replicas
    fsdp_time_s: float        # their time, latency included
    forward_s: float          # of which forward's all-gathers (overlap forward compute)
    first_unit_s: float       # the first unit's all-gather, before any compute
    tail_s: float             # the gradient collective after the last backward compute
    tp: TPAllReduces
    tp_time_s: float          # the TP all-reduces, never overlapped

    @property
    def backward_s(self) -> float:
        """Backward's gradient collectives (and gathers), which overlap backward compute but for the tail."""
        return self.fsdp_time_s - self.forward_s

    @property
    def time_s(self) -> float:
        return self.fsdp_time_s + self.tp_time_s


def communication(spec: ModelSpec, cluster: Cluster, work: Workload, at: Layout, mem: Memory) -> Communication:
    """Per-step communication of the configuration ``at`` (``mem``: its memory, for what the shards hold)."""
    c, group, dp_world, strategy = work.compute_bytes, at.group, at.dp_size, at.strategy
    A = work.accumulate_grad_batches
    block, _, P = spec.tp_local_params(at.tp)
    # What the gradient collectives carry: FSDP2 reduces only the trainable gradients under LoRA.
    G = mem.trainable_params if work.peft and work.fsdp_version == 2 else P
    nodes_spanned = math.ceil(group * at.tp / cluster.gpus_per_node)  # TP innermost: a DP group spans group x tp
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
        if strategy == "HYBRID_SHARD" and at.replicas > 1:
            reduced = math.ceil(G / group) if G != P else mem.shard_numel
            inter_bytes = 2 * (at.replicas - 1) / at.replicas * reduced * c
            collectives += units
        intra_time = (fwd_bytes + bwd_bytes) / group_bw
        inter_time = inter_bytes / inter_bw
    if dp_world == 1:
        collectives = 0
    latency = collectives * (COLLECTIVE_LATENCY_S["inter"] if cluster.nodes > 1 else COLLECTIVE_LATENCY_S["intra"])
    # TP all-reduces: ring over the tp ranks of a node, on the compute's critical path (never hidden).
    tp = at.tp
    tp_ar = tp_allreduces(spec, work, at.checkpointing) if tp > 1 else TPAllReduces(0, 0, 0, 0, 0)
    tp_time = (2 * (tp - 1) / tp * tp_ar.bytes / intra_bw + tp_ar.count * COLLECTIVE_LATENCY_S["intra"]
               if tp > 1 else 0.0)
    return Communication(
        bytes_intra=fwd_bytes + bwd_bytes if strategy != "NO_SHARD" else bwd_bytes, bytes_inter=inter_bytes,
        fsdp_time_s=intra_time + inter_time + latency,
        forward_s=fwd_bytes / group_bw if strategy != "NO_SHARD" else 0.0,
        first_unit_s=(block * c * ring / group_bw) if at.shards else 0.0,
        tail_s=backward_tail_s(spec, cluster, work, strategy, group, group_bw, intra_bw, inter_bw, world=dp_world),
        tp=tp_ar, tp_time_s=tp_time)


@dataclass(frozen=True)
class Compute:
    """Model FLOPs and compute time of one optimizer step on a rank (table peak x MFU)."""

    flops_per_token: float         # the whole model's, forward + backward (``ModelSpec.flops_per_token``)
    tokens_per_step: int           # this rank's micro-batches' tokens
    flops: float                   # what this rank computes (TP: its share of the blocks, the whole head)
    time_s: float
    forward_s: float

    @property
    def backward_s(self) -> float:
        return self.time_s - self.forward_s


def compute(spec: ModelSpec, cluster: Cluster, work: Workload, at: Layout) -> Compute:
    """Per-step compute of the configuration ``at``: ×4/3 with activation checkpointing (forward recomputed),
    ×4/6 under LoRA (no weight gradients for the frozen base)."""
    tokens = work.tokens_per_micro_batch * work.accumulate_grad_batches
    per_token = spec.flops_per_token(work.seq_len)
    if at.tp > 1:
        head = 6.0 * spec.vocab_size * spec.hidden_size  # the replicated head runs whole on every TP rank
        per_token = (per_token - head) / at.tp + head
    flops = per_token * tokens
    if work.peft:
        flops *= 4 / 6  # no weight gradients for the frozen base (the adapters' are negligible)
    seconds = flops / (cluster.peak_tflops * 1e12 * cluster.mfu) * (4 / 3 if at.checkpointing else 1)
    return Compute(flops_per_token=spec.flops_per_token(work.seq_len), tokens_per_step=tokens, flops=flops,
                   time_s=seconds, forward_s=seconds * (0.25 if at.checkpointing else 1 / 3))


@dataclass(frozen=True)
class Estimate:
    """One configuration's memory, communication and compute, and the step they make: ``exposed_comm_s``
    (communication no compute hides), ``offload_time_s`` (CPU offload's host transfers and host optimizer)."""

    layout: Layout
    memory: Memory
    communication: Communication
    compute: Compute
    exposed_comm_s: float
    offload_time_s: float

    @property
    def step_time_s(self) -> float:
        return self.compute.time_s + self.exposed_comm_s + self.offload_time_s

    @property
    def global_tokens_per_step(self) -> int:
        return self.compute.tokens_per_step * self.layout.dp_size

    def to_json(self) -> Dict[str, Any]:
        """The plan's row: one flat dict, the keys ``shardlight plan --json`` writes."""
        at, mem, comm, comp = self.layout, self.memory, self.communication, self.compute
        step, tokens = self.step_time_s, comp.tokens_per_step
        return {
            "sharding_strategy": at.strategy,
            "activation_checkpointing": at.checkpointing,
            "cpu_offload": at.cpu_offload,
            "shard_group_size": at.group if at.sharded else 1,
            "replicas": at.replicas if at.sharded else at.world,
            "mesh_shape": list(at.mesh_shape) if at.mesh_shape else None,
            "tp_size": at.tp,
            "dp_size": at.dp_size,
            "tp_allreduce_count": comm.tp.count,
            "tp_allreduce_bytes": comm.tp.bytes,
            "tp_comm_time_s": comm.tp_time_s,
            "params_bytes": mem.params_bytes,
            "grads_bytes": mem.grads_bytes,
            "optim_bytes": mem.optim_bytes,
            "gpu_state_bytes": mem.gpu_state_bytes,
            "host_state_bytes": mem.host_state_bytes,
            "gather_buffer_bytes": mem.gather_buffer_bytes,
            "grad_buffer_bytes": mem.grad_buffer_bytes,
            "activation_bytes": mem.activations.saved,
            "logits_bytes": mem.activations.logits + mem.activations.logits_grad,
            "activation_per_layer_bytes": mem.activations.per_layer,
            "peak_bytes": mem.peak_bytes,
            "total_with_overhead_bytes": mem.total_with_overhead_bytes,
            "usable_bytes": mem.usable_bytes,
            "headroom_bytes": mem.headroom_bytes,
            "fits": mem.fits,
            "host_fits": mem.host_fits,
            "comm_bytes_intra": comm.bytes_intra,
            "comm_bytes_inter": comm.bytes_inter,
            "comm_time_s": comm.time_s,
            "compute_time_s": comp.time_s,
            "exposed_comm_s": self.exposed_comm_s,
            "offload_time_s": self.offload_time_s,
            "step_time_s": step,
            "bound": "comm-bound" if comm.time_s > comp.time_s else "compute-bound",
            "tokens_per_step_per_rank": tokens,
            # TP ranks share their micro-batches: a device trains tokens / tp of them.
            "tokens_per_sec_per_device": tokens / at.tp / step if step > 0 else None,
            "global_tokens_per_step": self.global_tokens_per_step,
            "seconds_per_token": step / self.global_tokens_per_step,
            "flops_per_token": comp.flops_per_token,
            "trainable_params": mem.trainable_params,
        }


def estimate(spec: ModelSpec, cluster: Cluster, work: Workload, strategy: str, checkpointing: bool = False,
             cpu_offload: bool = False, shard_group_size: Optional[int] = None, tp: int = 1) -> Estimate:
    """Per-rank memory and per-step time of one configuration (see the module docstring); ``tp``: the
    tensor-parallel degree, ``strategy`` then shards over the world / tp data-parallel ranks
    (``shard_group_size`` counts data-parallel ranks)."""
    at = layout(cluster, strategy, checkpointing, cpu_offload, shard_group_size, tp)
    mem = memory(spec, cluster, work, at)
    comm = communication(spec, cluster, work, at, mem)
    comp = compute(spec, cluster, work, at)
    backward, tail = comm.backward_s, comm.tail_s
    # The tail runs after the last backward compute, for DDP and FSDP alike: only the rest can overlap.
    exposed = (max(0.0, comm.forward_s - comp.forward_s) + max(0.0, backward - min(tail, backward) - comp.backward_s)
               + min(tail, backward) + comm.first_unit_s + comm.tp_time_s)
    offload_time = 0.0
    if cpu_offload:
        gathers = work.accumulate_grad_batches * (2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1)
        offload_time = (gathers * mem.params_bytes + mem.grads_bytes) / (PCIE_HOST_BW * GB) + 2 * (
            mem.params_bytes + mem.grads_bytes + mem.optim_bytes) / (HOST_OPTIM_BW * GB)
    return Estimate(layout=at, memory=mem, communication=comm, compute=comp, exposed_comm_s=exposed,
                    offload_time_s=offload_time)


def hybrid_group_sizes(cluster: Cluster) -> List[int]:
    """Shard-group sizes HYBRID_SHARD can use: whole nodes, fewer than all of them, dividing the world."""
    if cluster.nodes < 2:
        return []
    return [k * cluster.gpus_per_node for k in range(1, cluster.nodes) if cluster.nodes % k == 0]


def estimate_tp(spec: ModelSpec, cluster: Cluster, work: Workload,
                sizes: Optional[List[int]] = None) -> List[Estimate]:
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


def estimate_all(spec: ModelSpec, cluster: Cluster, work: Workload) -> List[Estimate]:
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


def backward_tail_s(spec: Any, cluster: Any, work: Any, strategy: str, group: int, group_bw: float,
                    intra_bw: float, inter_bw: float, world: Any = None) -> float:
    """Seconds of the gradient collective that starts after the last backward compute and so cannot
    overlap: the root unit's (embeddings, head; reduced last) all-reduce under NO_SHARD (FSDP1 NO_SHARD and
    DDP's last bucket alike), its reduce-scatter under the sharded strategies (plus HYBRID's all-reduce of
    that shard across replicas). ``world``: the data-parallel ranks (default all; world / tp with TP)."""
    world, c = world or cluster.world_size, work.compute_bytes
    root = spec.root_params if not work.peft else 0  # LoRA: the frozen root has no gradient to reduce
    if world == 1 or root == 0:
        return 0.0
    if strategy == "NO_SHARD":
        bw = intra_bw if cluster.nodes == 1 else min(intra_bw, inter_bw)
        return 2 * (world - 1) / world * root * c / bw
    if group == 1:
        return 0.0
    tail = (group - 1) / group * root * c / group_bw
    replicas = world // group
    if strategy == "HYBRID_SHARD" and replicas > 1:
        tail += 2 * (replicas - 1) / replicas * root / group * c / inter_bw
    return tail
