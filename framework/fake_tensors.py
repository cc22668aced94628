"""The model's training step on fake tensors (``FakeTensorMode``: shapes, dtypes and strides, no storage):
what preflight runs once before any rank starts, so that a shape error in the model (an invalid grouped-query
split, a head size that does not divide, an adapter on the wrong layer) is one line instead of a traceback on
every rank; and the pieces the planner's memory step (``shardlight.planner.fake_step``) shares with it: a fake
process group and mixture-of-experts layers that run on fake tensors.

Depth does not change a shape: blocks of one kind are identical, so the step runs on a copy of the model cut
to the shortest prefix of its blocks that holds one of each kind (module structure and ``config.layer_types``).
A 70B Llama is checked one block deep.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from shardlight.errors import ShardlightError
from shardlight.lm_loss import loss_sum


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in this process (this is rank 0); collectives are no-ops."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        # Only ever run before training, never inside a distributed job: refuse instead of replacing it.
        raise ShardlightError("a fake process group cannot be made inside an initialized process group")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_friendly_grouped_mm() -> Iterator[None]:
    """Mixture-of-experts layers call ``torch._grouped_mm``, whose fake (meta) kernel accepts only bf16 while
    the CPU/GPU kernels also take fp32. For fp32 experts, route transformers to its own grouped-mm custom op
    (registered with a fake kernel): same output shapes, so the same bytes."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = moe._can_use_grouped_mm

    def bf16_only(input, weight, offs):
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    moe._can_use_grouped_mm = bf16_only
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """transformers checks a batch given no attention mask and no KV cache for packed sequences by reading its
    position ids; on fake tensors the check cannot read them and answers with a mask the real step never makes
    (``[batch, 1, seq, seq]``). For a step that is known not to be packed, answer as the real check does."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def layer_patterns(config: Any, depth: int) -> Dict[str, list]:
    """The config's per-layer lists, one entry per block of ``depth`` (``layer_types``, ``no_rope_layers``),
    not a list of every layer's index (Llama 4's ``moe_layers``, LFM2's ``full_attn_idxs``), which would read
    as a pattern that never repeats."""
    return {key: value for key, value in vars(config).items()
            if isinstance(value, list) and len(value) == depth and value != list(range(depth))}


def _block_lists(model: nn.Module, blocks: List[nn.Module]) -> List[nn.ModuleList]:
    ids = {id(b) for b in blocks}
    return [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(id(c) in ids for c in m)]


def _kind(block: nn.Module) -> tuple:
    return tuple(type(m).__name__ for m in block.modules())


def shallow_copy(model: nn.Module, blocks: List[nn.Module]) -> nn.Module:
    """A copy of ``model`` (on the meta device: costs nothing) whose block lists keep only their shortest
    prefix holding one block of each kind: each module structure, and each of ``config.layer_types`` (a
    sliding-window layer and a full-attention one share their classes)."""
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    saved = [(blocks_list, dict(blocks_list._modules)) for blocks_list in _block_lists(model, blocks)]
    for blocks_list, children in saved:
        seen, keep = set(), 1
        for i, block in enumerate(children.values()):
            kind = (_kind(block), layer_types[i] if isinstance(layer_types, list) and i < len(layer_types) else None)
            if kind not in seen:
                seen.add(kind)
                keep = i + 1
        blocks_list._modules = dict(list(children.items())[:keep])
    try:
        return copy.deepcopy(model)
    finally:
        for blocks_list, children in saved:
            blocks_list._modules = children


def uncheckable(exc: BaseException) -> bool:
    """Whether ``exc`` says only that fake tensors cannot run this model (a step whose control flow reads a
    tensor's value, an output whose shape depends on values, an operator without a fake kernel), not that the
    model is wrong."""
    from torch._subclasses import fake_tensor

    return isinstance(exc, (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                            fake_tensor.UnsupportedOperatorException))


def fake_training_step(model: nn.Module, *, micro_batch_size: int, seq_len: int, vocab_size: int,
                       packing: bool, autocast: Optional[torch.dtype] = None,
                       before: Optional[Callable[[nn.Module], None]] = None, loss_chunks: int = 1,
                       router_aux_coef: float = 0.0) -> None:
    """One forward, loss (``loss_sum``, as training computes it, the router's load-balancing loss with
    ``router_aux_coef`` > 0) and backward of ``model`` (on the meta device)
    on fake tensors, with a batch shaped as the data module's: packed blocks carry ``position_ids`` that
    restart mid-block, others an attention mask. ``before(model)`` runs on the meta model first (tensor
    parallelism, which fake tensors cannot apply). Raises whatever the model raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if before is not None:
        before(model)
    ids = torch.randint(0, vocab_size, (micro_batch_size, seq_len))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    if packing:
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)])
        batch["position_ids"] = positions.expand(micro_batch_size, seq_len)
    # FakeTensorMode logs each failing kernel with its traceback before raising; the caller reports the error.
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    cast = (torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext())
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), fake_friendly_grouped_mm():
            model.to_empty(device="cpu")
            model.train()
            with cast:
                total, count = loss_sum(model, batch, loss_chunks, router_aux_coef)
            (total / count.clamp(min=1)).backward()
    finally:
        quiet.setLevel(level)
