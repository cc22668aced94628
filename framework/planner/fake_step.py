"""Per-rank memory of one training step, measured instead of modelled: the real Hugging Face model, sharded
by the strategy's own ``shardlight.strategy.fsdp2.apply_fsdp2`` (tensor parallelism, activation
checkpointing, FSDP2, in that one order), runs forward + the LightningModule's own loss
(``shardlight.lm_loss.loss_sum``) + backward + optimizer step under ``FakeTensorMode`` on a fake
process group of the planned world size (``torch.testing._internal.distributed.fake_pg``), while
``torch.distributed._tools.FSDPMemTracker`` counts every tensor by category.

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

Tensor parallelism (``tp`` > 1): the mesh is (dp_replicate, dp_shard, tp), built by training's own
``fsdp2.fsdp2_mesh``, and ``apply_fsdp2`` applies the TP plan before checkpointing and ``fully_shard`` over the
data-parallel dims. FSDP2 joins the TP and DP meshes into one (a coordinate lookup that fake tensors cannot
run), so a TP model is sharded on the meta device outside ``FakeTensorMode`` and only materialized and stepped
inside it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from shardlight.errors import ShardlightError
from shardlight.fake_tensors import fake_friendly_grouped_mm, fake_process_group, layer_patterns, unpacked_sequences
from shardlight.lm_loss import loss_sum, model_router_aux_coef
from shardlight.strategy.fsdp2 import apply_fsdp2, fsdp2_mesh
from shardlight.strategy.options import ResolvedFSDP
from shardlight.strategy.tensor_parallel import ParallelDims

# Categories FSDPMemTracker reports (``_FSDPRefType`` values), grouped the way the plan's table is.
STATE_CATEGORIES = {"params": ("Sharded Param",), "grads": ("Sharded Grad",), "optim": ("OptState",)}
BUFFER_CATEGORIES = ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter", "Buffer")
ACTIVATION_CATEGORIES = ("Activation", "Temp", "Inputs")
Phases = Dict[Tuple[str, Any], Dict[str, int]]  # (part of the step, last block event) → snapshot at its peak


def resolved_fsdp(strategy: str, world_size: int, checkpointing: bool, precision: str,
                  shard_group_size: Optional[int] = None, block_classes: Optional[list] = None,
                  wrap_blocks: bool = True, tp: int = 1, tp_plan: Optional[Dict[str, str]] = None,
                  checkpointing_mode: str = "full", checkpointing_every: int = 1) -> ResolvedFSDP:
    """The ``ResolvedFSDP`` training would apply for this configuration (FSDP2): ``strategy``'s reshard and
    mesh (NO_SHARD: a (world, 1) replicate x shard mesh, DDP's memory with FSDP's mixed-precision casts;
    HYBRID_SHARD: shard groups of ``shard_group_size``), the blocks as units (``wrap_blocks`` False: NO_WRAP),
    bf16-mixed as a bf16 parameter dtype, and with ``tp`` > 1 the (dp_replicate, dp_shard, tp) dims."""
    dp = world_size // tp
    group = 1 if strategy == "NO_SHARD" else (shard_group_size or dp) if strategy == "HYBRID_SHARD" else dp
    if world_size % tp or dp % group:
        raise ShardlightError(f"mesh {dp // max(group, 1)} x {group}" + (f" x tp {tp}" if tp > 1 else "")
                              + f" does not match {world_size} ranks")
    hybrid = strategy in ("NO_SHARD", "HYBRID_SHARD")
    return ResolvedFSDP(
        version=2, sharding_strategy=strategy, reshard_after_forward=strategy in ("FULL_SHARD", "HYBRID_SHARD"),
        hybrid=hybrid, mesh_shape=(dp // group, group) if hybrid and tp == 1 else None,
        mixed_precision="bf16" if precision == "bf16-mixed" else None, sync_module_states=False,
        backward_prefetch=None, forward_prefetch=False, limit_all_gathers=False, use_orig_params=True,
        state_dict_type="FULL_STATE_DICT", activation_checkpointing=checkpointing, cpu_offload=False,
        activation_checkpointing_offload=False, activation_checkpointing_mode=checkpointing_mode,
        activation_checkpointing_every=checkpointing_every,
        cpu_ram_efficient_loading=False, auto_wrap_policy="TRANSFORMER_BASED_WRAP" if wrap_blocks else "NO_WRAP",
        transformer_cls_names_to_wrap=block_classes, min_num_params=None, sync_each_batch=False,
        wrap_report_tiny_unit_params=1_000_000,
        parallel=ParallelDims(dp // group, group, tp, tp_plan) if tp > 1 else None)


def step_mesh(resolved: ResolvedFSDP, world_size: int):
    """The device mesh training builds for ``resolved`` (``fsdp2.fsdp2_mesh``), on the CPU."""
    return fsdp2_mesh(resolved, "cpu", world_size)


def build_sharded_model(hf_config: Any, resolved: ResolvedFSDP, mesh: Any, precision: str, param_dtype: str,
                        trust_remote_code: bool = False, materialize: bool = True) -> torch.nn.Module:
    """The model on the meta device, parallelized by the strategy's own ``fsdp2.apply_fsdp2`` over ``mesh``
    (``step_mesh``): tensor parallelism (``resolved.parallel``), activation checkpointing per block, then
    ``fully_shard`` per unit and at the root; then (``materialize``) materialized on the CPU (fake under
    ``FakeTensorMode``: no bytes)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if param_dtype in ("bfloat16", "bf16") or precision == "bf16-true" else torch.float32
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError, KeyError) as exc:
        raise ShardlightError(f"model config cannot be built: {str(exc).splitlines()[0]}") from None
    model.train()
    model, _ = apply_fsdp2(model, resolved, mesh)
    if materialize:
        model.to_empty(device="cpu")
    return model


def shardlight_loss(model: torch.nn.Module, input_ids: torch.Tensor, loss_chunks: int = 1) -> torch.Tensor:
    """shardlight's training loss (``shardlight.lm_loss.loss_sum``: shifted logits upcast to fp32, summed
    cross-entropy over the supervised tokens, in ``loss_chunks`` pieces, plus a mixture of experts' router loss
    with the model's own weight) divided by their count; every token is supervised, none is padding."""
    total, count = loss_sum(model, {"input_ids": input_ids, "attention_mask": None, "labels": input_ids},
                            loss_chunks, model_router_aux_coef(model.config) or 0.0)
    return total / count.clamp(min=1)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """The optimizer as training on GPUs runs it: torch's foreach implementation (its default for CUDA tensors;
    on CPU tensors, real or fake, torch would pick the per-tensor loop, with other temporaries)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-5, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5, momentum=0.9, foreach=True)
    raise ShardlightError(f"the fake-tensor planner cannot run optimizer '{name}' (bitsandbytes); use --analytic")


def _grouped(snapshot: Dict[str, int]) -> Dict[str, int]:
    out = {key: sum(snapshot.get(c, 0) for c in cats) for key, cats in STATE_CATEGORIES.items()}
    out["buffers"] = sum(snapshot.get(c, 0) for c in BUFFER_CATEGORIES)
    out["activations"] = sum(snapshot.get(c, 0) for c in ACTIVATION_CATEGORIES)
    out["total"] = snapshot.get("Total", sum(snapshot.values()))
    return out


def _phase_tracker(model: torch.nn.Module, optim: torch.optim.Optimizer, ends: Optional[int]):
    """An ``FSDPMemTracker`` that also keeps, per phase of the step, the snapshot at that phase's highest total.
    A phase is the part of the step (forward and loss, backward, optimizer) and the last block event in it (a
    block's forward began, or its backward), the block named by its place among the ``ends`` blocks at the
    bottom of the stack (0, 1, ...) or at its top (-1 is the last): the same phase at every depth. What runs
    after the last block's forward (norm, head, loss) is that block's phase; phases of the blocks between the
    ends are not recorded (``ends`` None: none is). Block events, not ModTracker's ``parents``: in backward
    those keep modules whose backward hook never fired (activation checkpointing's recompute)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    place: Dict[int, Optional[int]] = {}  # id(block) → its place (None: between the ends)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == depth:
            for index, block in enumerate(module):
                if ends is not None:
                    place[id(block)] = index if index < ends else index - depth if depth - index <= ends else None

    class PhaseTracker(FSDPMemTracker):
        part: Optional[str] = None  # set by the step: forward, backward, optimizer (None: not recorded)
        event: Optional[Tuple[str, Optional[int]]] = None
        phases: Phases

        def block_forward(self, module, inputs) -> None:
            if id(module) in place and not self._mod_tracker.is_bw:
                self.event = ("forward", place[id(module)])

        def block_backward(self, module, grads) -> None:
            if id(module) in place:
                self.event = ("backward", place[id(module)])

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            snap = self._curr_mem_snap.get(torch.device("cpu"))
            if self.part is None or ends is None or not snap or (self.event and self.event[1] is None):
                return
            key = (self.part, self.event)
            if snap["Total"] > self.phases.get(key, {}).get("Total", -1):
                self.phases[key] = dict(snap)

    tracker = PhaseTracker(model, optim)
    # FSDPMemTracker hooks FSDP's own pre-forward and pre-backward; its ModTracker's user hooks are free.
    tracker._mod_tracker.register_user_hooks(pre_fw_hook=tracker.block_forward, pre_bw_hook=tracker.block_backward)
    return tracker


def run_tracked_step(model: torch.nn.Module, optimizer_name: str, micro_batch_size: int, seq_len: int,
                     vocab_size: int, ends: Optional[int] = None,
                     loss_chunks: int = 1) -> Tuple[Dict[str, int], Dict[str, int], Phases]:
    """(peak by category, what forward + loss allocated and left alive by category, each phase's snapshot at
    its peak (``_phase_tracker``'s ``ends``)) of a steady-state step."""
    optim = make_optimizer(optimizer_name, model.parameters())
    input_ids = torch.randint(0, vocab_size, (micro_batch_size, seq_len))
    tracker = _phase_tracker(model, optim, ends)
    tracker.phases = {}
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
        tracker.part = "forward"
        loss = shardlight_loss(model, input_ids, loss_chunks)
        after = _grouped(tracker.get_tracker_snapshot("current").get(device, {}))
        tracker.part = "backward"
        loss.backward()
        tracker.part = "optimizer"
        optim.step()
        optim.zero_grad(set_to_none=True)
        tracker.part = None
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    grown = {key: after[key] - before[key] for key in after}
    return _grouped(peak), grown, tracker.phases


def measured_depths(hf_config: Any, checkpointing_every: int = 1) -> Optional[Tuple[int, int]]:
    """The two depths (a, b) whose steps ``step_memory`` measures to scale to the model's full depth, or None
    when the full model is as cheap (or its layers follow no repeating pattern). Blocks of one kind are
    identical, so every byte alive at a given phase of a step (parameters, gradients, optimizer state, the
    activations the blocks below saved) grows by the same amount per repeat of the layer pattern
    (``config.layer_types`` and any other per-layer list, period p; 1 for uniform blocks). A phase is the same
    phase at two depths if its block has the same place from the nearer end of the stack, and is in FSDP's
    steady state if its neighbours are blocks (the unit below a bottom block is the embedding, which the
    first block prefetches in backward): so t blocks at each end, t the first multiple of p from 2 on;
    a = 2t plus the model's depth left over after whole periods (so that the top blocks are of the model's top
    blocks' kinds), b = a + p; None unless a + b blocks are fewer than the model's. Checkpointing every n-th
    block (``checkpointing_every``) is one more pattern, of period n."""
    depth = getattr(hf_config, "num_hidden_layers", None)
    if not isinstance(depth, int):
        return None
    patterns = [list(map(str, v)) for v in layer_patterns(hf_config, depth).values()]
    if checkpointing_every > 1:
        patterns.append([str(i % checkpointing_every == 0) for i in range(depth)])
    period = next(p for p in range(1, depth + 1)
                  if all(values[i] == values[i % p] for values in patterns for i in range(depth)))
    a = 2 * period * -(-2 // period)
    a += (depth - a) % period
    return (a, a + period) if 2 * a + period < depth else None


def _at_depth(hf_config: Any, depth: int) -> Any:
    """A copy of ``hf_config`` cut to its first ``depth`` blocks (per-layer lists cut with them)."""
    full = hf_config.num_hidden_layers
    config = copy.deepcopy(hf_config)
    for key, value in vars(hf_config).items():
        if isinstance(value, list) and len(value) == full:  # a pattern, or the index of every layer
            setattr(config, key, value[:depth])
    config.num_hidden_layers = depth
    return config


def _scaled(low: Dict[str, Any], high: Dict[str, Any], a: int, b: int, depth: int) -> Dict[str, Any]:
    """The step at ``depth`` blocks from the steps at ``a`` and ``b``. Every byte alive at a given phase grows
    linearly with depth, but the phase that holds the peak moves (a shallow model peaks in the head's backward,
    a deep one at the loss): each phase's snapshot is put on its line, and the peak is the highest of them."""
    def line(low_value: int, high_value: int) -> int:
        return round(low_value + (high_value - low_value) * (depth - a) / (b - a))

    phases = [{key: line(low["phases"][phase].get(key, 0), high["phases"][phase].get(key, 0))
               for key in set(low["phases"][phase]) | set(high["phases"][phase])}
              for phase in set(low["phases"]) & set(high["phases"])]
    top = max(phases, key=lambda snapshot: snapshot["Total"])
    return {"peak": top["Total"], "peak_by_category": _grouped(top),
            "activations": line(low["activations"], high["activations"]),
            "forward_alive": line(low["forward_alive"], high["forward_alive"])}


def step_memory(hf_config: Any, world_size: int, strategy: str, checkpointing: bool, precision: str,
                micro_batch_size: int, seq_len: int, optimizer: str = "adamw", param_dtype: str = "float32",
                shard_group_size: Optional[int] = None, block_classes: Optional[list] = None,
                wrap_blocks: bool = True, trust_remote_code: bool = False, tp: int = 1,
                tp_plan: Optional[Dict[str, str]] = None, scale: bool = True, loss_chunks: int = 1,
                checkpointing_mode: str = "full", checkpointing_every: int = 1) -> Dict[str, Any]:
    """Rank 0's memory in one steady-state training step of ``strategy`` on ``world_size`` ranks, bytes:
    ``peak`` (the step's highest total), ``peak_by_category`` (params/grads/optim/buffers/activations at that
    moment), ``activations`` (saved by forward + loss, alive when backward starts), ``forward_alive`` (every
    byte forward + loss allocated and left alive: activations plus parameters gathered and kept), and
    ``depths``: the block counts stepped (a deep model is stepped at two depths and scaled to its own,
    ``measured_depths``: a 70B Llama's 80 blocks cost the time of 9; ``scale`` False steps every block).

    Runs under ``FakeTensorMode`` with a fake process group: allocates nothing."""
    args = (world_size, strategy, checkpointing, precision, micro_batch_size, seq_len, optimizer, param_dtype,
            shard_group_size, block_classes, wrap_blocks, trust_remote_code, tp, tp_plan, loss_chunks,
            checkpointing_mode, checkpointing_every)
    every = checkpointing_every if checkpointing else 1
    depths = measured_depths(hf_config, every) if scale and wrap_blocks else None  # one unit: no steady state
    if depths is None:
        step = _step_memory(hf_config, *args)
        step.pop("phases")
        return {**step, "depths": [getattr(hf_config, "num_hidden_layers", None)]}
    a, b = depths
    low, high = (_step_memory(_at_depth(hf_config, d), *args, ends=a // 2) for d in depths)
    return {**_scaled(low, high, a, b, hf_config.num_hidden_layers), "depths": [a, b]}


def _step_memory(hf_config: Any, world_size: int, strategy: str, checkpointing: bool, precision: str,
                 micro_batch_size: int, seq_len: int, optimizer: str, param_dtype: str,
                 shard_group_size: Optional[int], block_classes: Optional[list], wrap_blocks: bool,
                 trust_remote_code: bool, tp: int, tp_plan: Optional[Dict[str, str]], loss_chunks: int = 1,
                 checkpointing_mode: str = "full", checkpointing_every: int = 1,
                 ends: Optional[int] = None) -> Dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    if precision not in ("32-true", "bf16-mixed", "bf16-true"):
        raise ShardlightError(f"the fake-tensor planner runs 32-true, bf16-mixed and bf16-true, not "
                              f"'{precision}'; use --analytic")
    resolved = resolved_fsdp(strategy, world_size, checkpointing, precision, shard_group_size, block_classes,
                             wrap_blocks, tp, tp_plan, checkpointing_mode, checkpointing_every)
    with fake_process_group(world_size):
        mesh = step_mesh(resolved, world_size)
        # FSDP2 joins the TP and DP meshes into one, a coordinate lookup fake tensors cannot run: a TP model is
        # parallelized on the meta device outside FakeTensorMode and only materialized inside it.
        prebuilt = (build_sharded_model(hf_config, resolved, mesh, precision, param_dtype, trust_remote_code,
                                        materialize=False) if tp > 1 else None)
        with FakeTensorMode(allow_non_fake_inputs=True), fake_friendly_grouped_mm(), unpacked_sequences():
            if prebuilt is not None:
                model = prebuilt
                model.to_empty(device="cpu")
            else:
                model = build_sharded_model(hf_config, resolved, mesh, precision, param_dtype, trust_remote_code)
            try:
                peak, forward, phases = run_tracked_step(model, optimizer, micro_batch_size, seq_len,
                                                         int(hf_config.vocab_size), ends, loss_chunks)
            except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
                raise ShardlightError(f"the model's training step fails ({strategy}{f' tp{tp}' if tp > 1 else ''}): "
                                      f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
                                      ) from None
    return {"peak": peak["total"], "peak_by_category": peak, "activations": forward["activations"],
            "forward_alive": forward["total"], "phases": phases}
