"""Per-rank memory of one sharding configuration (``estimate`` composes it with the step's time), in bytes,
following what FSDP1 (``use_orig_params``, the shardlight default) allocates:

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
  transient at the start of backward (gradients of the log-softmax output and of its fp32 input); with
  ``trainer.loss_chunks`` N, no logits kept and one N-th of that transient (each piece recomputed in backward).
  With activation checkpointing: each checkpointed block's input only (every n-th block with
  ``activation_checkpointing_every`` n, the others keep all; selective: also its matmul and attention outputs);
  the transient is the larger of the logits gradients and one block recomputed with its gradients. Gradients
  are freed after each optimizer step, so the peak is parameters + optimizer state + buffers
  + max(activations, gradients + one layer's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from shardlight.errors import ShardlightError
from shardlight.planner.inputs import Cluster, Workload
from shardlight.planner.model_spec import ModelSpec
from shardlight.recipe.schema import OPTIMIZERS

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


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's activations on one (TP) rank."""

    per_layer: float    # one block's saved tensors (its working set when recomputed)
    saved: float        # what forward keeps for backward: the blocks' (or their inputs') and the embeddings'
    logits: float       # the fp32 log-softmax output, kept for backward
    logits_grad: float  # the transient at the start of backward (or one block recomputed with its gradients)

    @property
    def total(self) -> float:
        return self.saved + self.logits + self.logits_grad


def activation_bytes(spec: ModelSpec, work: Workload, checkpointing: bool, tp: int = 1) -> Activations:
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
    if work.loss_chunks > 1:
        # trainer.loss_chunks: nothing kept for backward; one piece at a time, recomputed in backward: its logits
        # (fp32, and the 16-bit output they are upcast from), their log-softmax and the two gradients (the fake
        # step reads 14 and 17 bytes per logit under bf16-mixed and 32-true).
        logits, logits_grad = 0.0, tokens / work.loss_chunks * spec.vocab_size * (16 if c >= 4 else 12 + c)
    if checkpointing:
        kept = -(-spec.num_layers // work.checkpointing_every)      # blocks 0, n, 2n, ... are checkpointed
        per_kept = h * c * tokens                                    # a checkpointed block's input
        if work.checkpointing_mode == "selective":
            # and its matmuls' and attention's outputs: q/k/v, attention (+ fp32 logsumexp per head), o_proj,
            # the MLP's up (and gate) and down projections
            up = 2 * i if spec.gated_mlp else i
            per_kept += tokens * (c * (2 * q + 2 * kv) / attn_tp + 4 * spec.num_heads / attn_tp + c * up / mlp_tp
                                  + 2 * c * h)
        saved = kept * per_kept + (spec.num_layers - kept) * block
        transient = max(logits_grad, 2 * block)                      # or one block recomputed + its grads
    else:
        saved = spec.num_layers * block
        transient = logits_grad
    return Activations(per_layer=block, saved=saved + embeddings, logits=logits, logits_grad=transient)


@dataclass(frozen=True)
class Layout:
    """One configuration and how it places the ranks: ``strategy`` over the ``dp_size`` = world / ``tp``
    data-parallel ranks, in groups of ``group`` (NO_SHARD: all of them, unsharded) repeated ``replicas`` times."""

    strategy: str
    checkpointing: bool
    cpu_offload: bool
    world: int
    tp: int
    dp_size: int
    group: int
    sharded: bool
    replicas: int

    @property
    def shards(self) -> bool:
        """Whether parameters are split: a sharded strategy over more than one rank."""
        return self.sharded and self.group > 1

    @property
    def mesh_shape(self) -> Optional[Tuple[int, int]]:
        return (self.replicas, self.group) if self.strategy == "HYBRID_SHARD" else None


def layout(cluster: Cluster, strategy: str, checkpointing: bool = False, cpu_offload: bool = False,
           shard_group_size: Optional[int] = None, tp: int = 1) -> Layout:
    """``strategy`` on ``cluster`` with ``tp``-way tensor parallelism (``shard_group_size`` counts
    data-parallel ranks; HYBRID_SHARD's default: a node's)."""
    world = cluster.world_size
    if world % tp or cluster.gpus_per_node % tp:
        raise ShardlightError(f"tp {tp} does not divide the {cluster.gpus_per_node} GPUs of a node")
    dp_world = world // tp
    if strategy == "NO_SHARD":
        group, sharded = dp_world, False
    elif strategy == "HYBRID_SHARD":
        group, sharded = shard_group_size or cluster.gpus_per_node // tp, True
    else:
        group, sharded = dp_world, True
    return Layout(strategy=strategy, checkpointing=checkpointing, cpu_offload=cpu_offload, world=world, tp=tp,
                  dp_size=dp_world, group=group, sharded=sharded, replicas=max(1, dp_world // group))


@dataclass(frozen=True)
class Memory:
    """Bytes per rank (see the module docstring)."""

    params_bytes: float
    grads_bytes: float
    optim_bytes: float
    gpu_state_bytes: float             # parameters + gradients + optimizer state on the GPU (0 offloaded)
    host_state_bytes: float            # the same on the host (CPU offload)
    gather_buffer_bytes: float         # unsharded parameters
    grad_buffer_bytes: float           # one unit's unsharded gradient
    activations: Activations
    peak_bytes: float
    overhead_bytes: float              # the cluster's runtime overhead per GPU
    usable_bytes: float
    host_fits: bool
    shard_numel: int                   # elements of this rank's flat-parameter shards (frozen base included)
    trainable_params: int

    @property
    def total_with_overhead_bytes(self) -> float:
        return self.peak_bytes + self.overhead_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.usable_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes and self.host_fits


def memory(spec: ModelSpec, cluster: Cluster, work: Workload, at: Layout) -> Memory:
    """Per-rank memory of the configuration ``at``."""
    c, s = work.compute_bytes, work.storage_bytes
    n_local = shard_numels(spec, at.group, c, at.shards, at.tp)
    params, grads = n_local * s, n_local * s
    optim = n_local * s * OPTIMIZER_STATES[work.optimizer]
    trainable = spec.total_params
    if work.peft:
        trainable = spec.lora_params(work.lora_r)
        adapters = math.ceil(trainable / at.group) if at.shards else trainable
        params += adapters * s
        # FSDP1 keeps a gradient for the whole flat parameter, frozen elements included (zeros).
        grads = (n_local + adapters) * s if work.fsdp_version == 1 else adapters * s
        optim = adapters * s * OPTIMIZER_STATES[work.optimizer]
    block, root, total_p = spec.tp_local_params(at.tp)
    in_flight = 1 + work.prefetch
    if not at.shards:
        gathered = 0 if c >= s else min(total_p, max(block, root) * in_flight) * c
        grad_buffer = 0
    elif at.strategy == "SHARD_GRAD_OP":
        gathered, grad_buffer = total_p * c, max(block, root) * c
    else:
        gathered, grad_buffer = (root + block * in_flight) * c, max(block, root) * c
    acts = activation_bytes(spec, work, at.checkpointing, at.tp)
    state = 0.0 if at.cpu_offload else params + grads + optim
    # Gradients are freed after each optimizer step (set_to_none) and appear as backward frees activations:
    # the peak is at the start of backward (all activations, no gradients yet) or at its end (all gradients).
    resident = 0.0 if at.cpu_offload else params + optim
    grads_gpu = 0.0 if at.cpu_offload else grads
    peak = resident + gathered + grad_buffer + max(acts.total, grads_gpu + acts.per_layer)
    host = params + grads + optim if at.cpu_offload else 0.0
    return Memory(params_bytes=params, grads_bytes=grads, optim_bytes=optim, gpu_state_bytes=state,
                  host_state_bytes=host, gather_buffer_bytes=gathered, grad_buffer_bytes=grad_buffer,
                  activations=acts, peak_bytes=peak, overhead_bytes=cluster.overhead_bytes,
                  usable_bytes=cluster.usable_bytes,
                  host_fits=host * cluster.gpus_per_node <= cluster.host_memory_bytes * 0.8,
                  shard_numel=n_local, trainable_params=trainable)
