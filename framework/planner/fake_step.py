"""Per-rank memory of one training step, measured instead of modelled: the real Hugging Face model, sharded
with FSDP2 the way ``shardlight.strategy.fsdp2`` shards it, runs forward + loss + backward + optimizer step
under ``FakeTensorMode`` on a fake process group of the planned world size (``torch.testing._internal.
distributed.fake_pg``), while ``torch.distributed._tools.FSDPMemTracker`` counts every tensor by category.

Fake tensors carry shapes, dtypes and strides but no storage, so any architecture transformers can build is
planned without weights, without a GPU and in seconds; the collectives return without moving data. This is
how torchtitan's ``scripts/estimate/estimation.py`` estimates memory. ``benchmarks/plan_accuracy.py`` runs
the same model (``build_sharded_model``), loss and optimizer on real CPU tensors and compares the allocator.

An optimizer step on zero gradients first creates the optimizer state; the training step after it is the
steady state whose peak is reported (gradients are freed by ``zero_grad(set_to_none=True)`` after each step,
as in training).

Several ranks: the fake collectives move no data and complete at once, but every buffer FSDP2 keeps alive
around a collective is held by FSDP2's own Python state, which runs unchanged on the fake group: the
all-gather output kept for the next unit's copy-in in forward (``comm_ctx.all_gather_state``), the prefetched
unit gathered in backward, the reduce-scatter input kept until the next unit's post-backward
(``reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` = 1), the reduce-scatter output that becomes
the sharded gradient. So these lifetimes are modelled by construction, byte for byte (the 2-rank gloo
measurement of ``benchmarks/plan_accuracy.py`` matches the step peak to the byte, SHARD_GRAD_OP and
FULL_SHARD, three architectures). Not counted: memory a backend allocates inside a collective for its
duration (gloo: a clone of the reduce-scatter input, an all-gather staging copy; NCCL: its own buffers, outside
PyTorch's allocator), which raises the peak only when the peak falls inside a collective (in these shapes it
falls in the loss's backward), and the CUDA caching allocator's rounding and fragmentation.

Tensor parallelism (``tp`` > 1): the mesh is (dp_replicate, dp_shard, tp) as training builds it, the model
is parallelized with ``shardlight.strategy.tensor_parallel.apply_tensor_parallel`` then checkpointed and
``fully_shard``-ed over the data-parallel dims. FSDP2 joins the TP and DP meshes into one (a coordinate
lookup that fake tensors cannot run), so a TP model is sharded on the meta device outside ``FakeTensorMode``
and only materialized and stepped inside it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from shardlight.errors import ShardlightError
from shardlight.strategy.tensor_parallel import MESH_DIM_NAMES, ParallelDims, apply_tensor_parallel
from shardlight.strategy.wrapping import block_modules

# Categories FSDPMemTracker reports (``_FSDPRefType`` values), grouped the way the plan's table is.
STATE_CATEGORIES = {"params": ("Sharded Param",), "grads": ("Sharded Grad",), "optim": ("OptState",)}
BUFFER_CATEGORIES = ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter", "Buffer")
ACTIVATION_CATEGORIES = ("Activation", "Temp", "Inputs")


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` ranks in this process (this is rank 0); collectives are no-ops."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        # The planner runs before training, never inside a distributed job: refuse instead of replacing it.
        raise ShardlightError("the fake-tensor planner cannot run inside an initialized process group; "
                              "use --analytic")
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


def strategy_mesh(strategy: str, world_size: int, shard_group_size: Optional[int]):
    """The FSDP2 device mesh that gives ``strategy``'s per-rank layout: NO_SHARD is a 2-D mesh that
    replicates over all ranks with shard groups of one (DDP's memory, FSDP's mixed-precision casts)."""
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "NO_SHARD":
        return init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    if strategy == "HYBRID_SHARD":
        group = shard_group_size or world_size
        if world_size % group:
            raise ShardlightError(f"shard group {group} does not divide the world size {world_size}")
        return init_device_mesh("cpu", (world_size // group, group), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,))


def tp_meshes(strategy: str, world_size: int, shard_group_size: Optional[int], tp: int) -> Tuple[Any, Any]:
    """(data-parallel mesh, tp mesh) of a (dp_replicate, dp_shard, tp) mesh, as training builds it:
    NO_SHARD replicates over all data-parallel ranks, HYBRID_SHARD shards over ``shard_group_size`` of them."""
    from torch.distributed.device_mesh import init_device_mesh


    dp = world_size // tp
    group = 1 if strategy == "NO_SHARD" else (shard_group_size or dp) if strategy == "HYBRID_SHARD" else dp
    if world_size % tp or dp % group:
        raise ShardlightError(f"mesh {dp // max(group, 1)} x {group} x tp {tp} does not match {world_size} ranks")
    mesh = init_device_mesh("cpu", (dp // group, group, tp), mesh_dim_names=MESH_DIM_NAMES)
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp // group > 1 else mesh["dp_shard"]
    return dp_mesh, mesh["tp"]


def build_sharded_model(hf_config: Any, mesh: Any, strategy: str, checkpointing: bool, precision: str,
                        param_dtype: str, block_classes: Optional[list] = None, wrap_blocks: bool = True,
                        trust_remote_code: bool = False, tp_mesh: Any = None,
                        tp_plan: Optional[Dict[str, str]] = None, materialize: bool = True) -> torch.nn.Module:
    """The model on the meta device, tensor-parallel over ``tp_mesh`` when given (``tp_plan``: the recipe's,
    None: the model's), checkpointed per block and ``fully_shard``-ed per block then at the root
    (``shardlight.strategy.fsdp2.apply_fsdp2``'s order), then (``materialize``) materialized on the CPU
    (fake under ``FakeTensorMode``: no bytes)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if param_dtype in ("bfloat16", "bf16") or precision == "bf16-true" else torch.float32
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError, KeyError) as exc:
        raise ShardlightError(f"model config cannot be built: {str(exc).splitlines()[0]}") from None
    model.train()
    if tp_mesh is not None:
        apply_tensor_parallel(model, ParallelDims(1, 1, tp_mesh.size(), tp_plan), tp_mesh)
    blocks = block_modules(model, block_classes)
    units = list(blocks) if wrap_blocks else []
    if checkpointing:
        ids = {id(b) for b in blocks}
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: id(m) in ids)
        units = [m for m in model.modules() if isinstance(m, CheckpointWrapper)] if wrap_blocks else []
    kwargs: Dict[str, Any] = {"mesh": mesh, "reshard_after_forward": strategy in ("FULL_SHARD", "HYBRID_SHARD")}
    if precision == "bf16-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in reversed(units):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if materialize:
        model.to_empty(device="cpu")
    return model


def shardlight_loss(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """shardlight's training loss: shifted logits upcast to fp32, summed cross-entropy over the tokens."""
    logits = model(input_ids=input_ids).logits
    logits = logits[:, :-1].float()
    labels = input_ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum") / labels.numel()


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-5)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9)
    raise ShardlightError(f"the fake-tensor planner cannot run optimizer '{name}' (bitsandbytes); use --analytic")


def _grouped(snapshot: Dict[str, int]) -> Dict[str, int]:
    out = {key: sum(snapshot.get(c, 0) for c in cats) for key, cats in STATE_CATEGORIES.items()}
    out["buffers"] = sum(snapshot.get(c, 0) for c in BUFFER_CATEGORIES)
    out["activations"] = sum(snapshot.get(c, 0) for c in ACTIVATION_CATEGORIES)
    out["total"] = snapshot.get("Total", sum(snapshot.values()))
    return out


def run_tracked_step(model: torch.nn.Module, optimizer_name: str, micro_batch_size: int, seq_len: int,
                     vocab_size: int) -> Tuple[Dict[str, int], Dict[str, int]]:
    """(peak by category, what forward + loss allocated and left alive by category) of a steady-state step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    optim = make_optimizer(optimizer_name, model.parameters())
    input_ids = torch.randint(0, vocab_size, (micro_batch_size, seq_len))
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs((input_ids,))
    device = torch.device("cpu")
    with tracker, warnings.catch_warnings():
        # transformers >= 5.25 runs module-level functions as modules (``kernels``' ``Func``, e.g. the rotary
        # embedding), one inside another; ModTracker names both "Func" and warns that its module hierarchy may be
        # wrong ("file a bug to PyTorch"). The plan reads totals by category, which no hierarchy enters.
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        # Warm-up: one optimizer step on zero gradients creates the optimizer state a real first step would
        # (same shapes and dtypes) without paying for a forward and backward.
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optim.step()
        optim.zero_grad(set_to_none=True)
        tracker.reset_mod_stats()
        # Report the steady-state step: restart the peak from what is alive now.
        tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
        tracker._peak_mem = {d: snap.get("Total", 0) for d, snap in tracker._peak_mem_snap.items()}
        before = _grouped(tracker.get_tracker_snapshot("current").get(device, {}))
        loss = shardlight_loss(model, input_ids)
        after = _grouped(tracker.get_tracker_snapshot("current").get(device, {}))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    grown = {key: after[key] - before[key] for key in after}
    return _grouped(peak), grown


def step_memory(hf_config: Any, world_size: int, strategy: str, checkpointing: bool, precision: str,
                micro_batch_size: int, seq_len: int, optimizer: str = "adamw", param_dtype: str = "float32",
                shard_group_size: Optional[int] = None, block_classes: Optional[list] = None,
                wrap_blocks: bool = True, trust_remote_code: bool = False, tp: int = 1,
                tp_plan: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Rank 0's memory in one steady-state training step of ``strategy`` on ``world_size`` ranks, bytes:
    ``peak`` (the step's highest total), ``peak_by_category`` (params/grads/optim/buffers/activations at that
    moment), ``activations`` (saved by forward + loss, alive when backward starts), ``forward_alive`` (every
    byte forward + loss allocated and left alive: activations plus parameters gathered and kept).

    Runs under ``FakeTensorMode`` with a fake process group: allocates nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if precision not in ("32-true", "bf16-mixed", "bf16-true"):
        raise ShardlightError(f"the fake-tensor planner runs 32-true, bf16-mixed and bf16-true, not "
                              f"'{precision}'; use --analytic")
    with fake_process_group(world_size):
        prebuilt = None
        if tp > 1:
            mesh, tp_mesh = tp_meshes(strategy, world_size, shard_group_size, tp)
            prebuilt = build_sharded_model(hf_config, mesh, strategy, checkpointing, precision, param_dtype,
                                           block_classes, wrap_blocks, trust_remote_code, tp_mesh, tp_plan,
                                           materialize=False)
        else:
            mesh = strategy_mesh(strategy, world_size, shard_group_size)
        with FakeTensorMode(allow_non_fake_inputs=True), fake_friendly_grouped_mm():
            if prebuilt is not None:
                model = prebuilt
                model.to_empty(device="cpu")
            else:
                model = build_sharded_model(hf_config, mesh, strategy, checkpointing, precision, param_dtype,
                                            block_classes, wrap_blocks, trust_remote_code)
            try:
                peak, forward = run_tracked_step(model, optimizer, micro_batch_size, seq_len,
                                                 int(hf_config.vocab_size))
            except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
                raise ShardlightError(f"the model's training step fails ({strategy}{f' tp{tp}' if tp > 1 else ''}): "
                                      f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
                                      ) from None
    return {"peak": peak["total"], "peak_by_category": peak, "activations": forward["activations"],
            "forward_alive": forward["total"]}
