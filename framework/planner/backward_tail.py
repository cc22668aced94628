"""The part of backward's gradient communication nothing can hide: the collective of the unit reduced
last. Its own module so that ``estimate`` (which takes ``ModelSpec``/``Cluster``/``Workload``, passed in
here untyped to keep the import one-way) treats DDP and FSDP with one rule."""

from __future__ import annotations

from typing import Any


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
