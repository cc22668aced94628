"""Which transformer blocks recompute their activations in backward and how (``fsdp.activation_checkpointing``
with its ``_mode``, ``_every`` and ``_offload``), and the recipe's ``compile:`` per block. Both FSDP versions
and the planner's fake step call these, so a knob means the same in training and in the plan. Order: compile
each block, then wrap the ones to checkpoint (see ``compile_blocks``), then FSDP.

- full: the block keeps only its input; backward runs its forward again (non-reentrant checkpointing).
- selective: the block also keeps the outputs of its matmuls and attention and recomputes only the cheap ops
  between them (norms, activations, rotary, residual adds), torch's selective checkpointing
  (``create_selective_checkpoint_contexts``) with torchtitan's op-level policy minus its every-other-matmul
  rule: less memory saved than no checkpointing, far less recompute than full.
- every n: blocks 0, n, 2n, ... are checkpointed, the rest keep everything (torchtitan's ``ac_freq``).
- offload: what a checkpointed block keeps moves to host memory until backward (torch's ``offload_wrapper``,
  Accelerate's ``activation_checkpointing_offload``).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import torch
from torch import nn

# Ops whose outputs selective checkpointing keeps: the expensive ones (matmuls, attention) and, with tensor
# parallelism, the collectives (recomputing them would communicate again).
_SAVED_OP_NAMES = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._grouped_mm.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_gather_into_tensor.default",
)


def _op(name: str) -> Any:
    namespace, op, overload = name.split(".")
    packet = getattr(getattr(torch.ops, namespace), op, None)
    return getattr(packet, overload, None) if packet is not None else None


@functools.lru_cache(maxsize=None)
def saved_ops() -> frozenset:
    """The ``_SAVED_OP_NAMES`` this torch build has."""
    return frozenset(op for op in map(_op, _SAVED_OP_NAMES) if op is not None)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def checkpointed_blocks(blocks: List[nn.Module], every: int) -> List[nn.Module]:
    """The blocks (in model order) that ``every`` checkpoints: 0, n, 2n, ..."""
    return blocks[::every]


def checkpoint_blocks(root: nn.Module, blocks: List[nn.Module], *, mode: str = "full", every: int = 1,
                      offload: bool = False) -> Dict[int, nn.Module]:
    """Wrap the blocks ``every`` picks (``blocks`` in model order, all inside ``root``) in place: their parents
    call the wrapper from now on. Returns ``{id(block): its outermost wrapper}``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    chosen = {id(b) for b in checkpointed_blocks(blocks, every)}
    names = [(name, module) for name, module in root.named_modules() if id(module) in chosen]
    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
    wrappers: Dict[int, nn.Module] = {}
    for name, module in names:
        wrapper = checkpoint_wrapper(module, **kwargs)  # non-reentrant by default
        if offload:
            wrapper = offload_wrapper(wrapper)
        root.set_submodule(name, wrapper)
        wrappers[id(module)] = wrapper
    return wrappers


def compile_blocks(modules: List[nn.Module]) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: its state-dict keys stay as they were).
    Blocks of one class share their compiled code (dynamo treats parameters as inputs), so a 32-block model
    compiles about once, as Accelerate's regional compilation does; FSDP's hooks stay outside the graph.

    The block is compiled inside its checkpoint wrapper, not around it (torchtitan compiles the wrapper):
    transformers' blocks set a context variable in forward, a side effect dynamo refuses to trace inside
    ``checkpoint``, so a compiled wrapper falls back to eager whole. Checkpointing a compiled block recomputes
    the compiled code, and selective checkpointing keys the compiled region's saved outputs (torch's
    ``inductor_compiled_code``)."""
    for module in modules:
        module.compile()


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's own count: tracing, AOT autograd, inductor),
    so the first steps' compile time is reported apart from the step time."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return float(spent.get("total_wall_time", spent.get("entire_frame_compile", 0.0)))


__all__ = ["checkpoint_blocks", "checkpointed_blocks", "compile_blocks", "compile_seconds", "saved_ops"]
