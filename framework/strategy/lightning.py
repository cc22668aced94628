"""The Lightning adapter: ``ShardlightFSDPStrategy`` hands a ``ResolvedFSDP`` to ``fsdp1.apply_fsdp1`` or
``fsdp2.apply_fsdp2`` from Lightning's hooks, and keeps what Lightning asks of a strategy afterwards (the
wrapped root, gradient-sync control, state dicts, gradient clipping).

It fixes what Lightning 2.6's stock ``FSDPStrategy`` gets wrong:
- CPU (gloo): the accelerator connector refuses the exact stock class on CPU (a subclass passes);
  ``device_id=root_device.index`` is None on CPU and torch then refuses to wrap; tuple device meshes
  are hard-coded to CUDA; full state dicts with ``offload_to_cpu=True`` crash on CPU; bf16-mixed uses
  ``autocast("cuda")`` even on CPU.
- Gradient accumulation: the Trainer only skips gradient sync for models with ``no_sync()``, so FSDP2
  reduce-scattered on every micro-batch; here both versions skip it (unless ``sync_each_batch``).
- ``trainer.validate()`` after ``fit()`` lost the FSDP1 root wrapper.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Generator, Optional

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from shardlight.strategy.fsdp1 import (
    apply_fsdp1,
    fsdp1_full_state_dict,
    fsdp1_kwargs,
    fsdp1_mesh,
    fsdp1_mixed_precision,
)
from shardlight.strategy.fsdp2 import apply_fsdp2, fsdp2_clip_grad_norm, fsdp2_full_state_dict, fsdp2_mesh
from shardlight.strategy.options import ResolvedFSDP
from shardlight.strategy.sharded_load import has_meta_parameters, load_safetensors, materialize
from shardlight.strategy.wrapping import format_wrap_report


class DeviceAutocastFSDPPrecision(FSDPPrecision):
    """Lightning's FSDP precision, autocasting on the device we run on (it hard-codes CUDA), and without a
    MixedPrecision policy for plain fp32."""

    device_type = "cuda"

    @property
    @override
    def mixed_precision_config(self):
        # Lightning hands FSDP an all-fp32 MixedPrecision for 32-true, which makes FSDP1 keep and refresh a
        # second ("low precision") copy of every shard each step for nothing: no policy is the fp32 path.
        if self.precision in ("32-true", "32"):
            return None
        return super().mixed_precision_config

    @override
    def forward_context(self):
        if "mixed" in self.precision:
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            return torch.autocast(self.device_type, dtype=dtype)
        return super().forward_context()


class ShardlightFSDPStrategy(FSDPStrategy):
    """FSDP1 (``FullyShardedDataParallel``) or FSDP2 (``fully_shard``) as a recipe's ``fsdp:`` section
    resolves (``options.resolve_recipe_fsdp``).

    Arguments:
        resolved: every FSDP setting to apply; the strategy reads no other.
        precision: ``trainer.precision``, for the strategy's precision plugin (the Trainer adopts it):
            autocast on the device in use, and FSDP1's ``MixedPrecision`` where ``resolved`` has no dtype.
        num_nodes: ``trainer.num_nodes``.
        devices: ``trainer.devices``, the ranks on each node; on CPU they share the node's cores.
        num_threads: torch intra-op threads per rank on CPU (None: the node's cores / ``devices``).
        timeout: how long a collective may wait before failing (every process group of the run's).
        startup_timeout: how long the ranks may take to meet when the process group starts (the rendezvous:
            the slowest rank's imports and data preparation); None: ``timeout``.

    After setup, ``wrap_report`` holds the wrap report (units, parameters per unit, warnings).
    """

    strategy_name = "shardlight_fsdp"

    def __init__(
        self,
        resolved: ResolvedFSDP,
        *,
        precision: str = "32-true",
        num_nodes: int = 1,
        devices: int = 1,
        num_threads: Optional[int] = None,
        timeout: timedelta = timedelta(minutes=30),
        startup_timeout: Optional[timedelta] = None,
    ) -> None:
        super().__init__(
            # The Trainer adopts a strategy's plugin; "32" and the like unified as the Trainer does.
            precision_plugin=DeviceAutocastFSDPPrecision(_convert_precision_to_unified_args(precision)),
            timeout=startup_timeout or timeout,  # what init_process_group waits: the rendezvous
            mixed_precision=fsdp1_mixed_precision(resolved) if resolved.version == 1 else None,
            state_dict_type="sharded" if resolved.state_dict_type == "SHARDED_STATE_DICT" else "full",
            # The parent's setup_optimizers reads it: without original parameters it checks the optimizer
            # holds FSDP's flat ones.
            use_orig_params=resolved.use_orig_params,
        )
        self.num_nodes = num_nodes
        self.resolved = resolved
        self._local_ranks = devices
        self.num_threads = num_threads
        self.collective_timeout = timeout
        self.wrap_report: Optional[Dict[str, Any]] = None
        self._fsdp1_root: Optional[nn.Module] = None
        self._fsdp2_root: Optional[nn.Module] = None
        self._mesh: Any = None

    # ------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        device_type = self.root_device.type
        if device_type == "cpu":
            torch.set_num_threads(self.num_threads or max(1, (os.cpu_count() or 1) // self._local_ranks))
        self.precision_plugin.device_type = device_type
        super().setup_environment()
        # Built here, on the device in use, once the process group exists (Lightning's would be CUDA's).
        if self.resolved.version == 2:
            self._mesh = fsdp2_mesh(self.resolved, device_type, self.world_size)
        else:
            self._mesh = fsdp1_mesh(self.resolved, device_type)
        self._set_collective_timeouts()

    def _set_collective_timeouts(self) -> None:
        """The collective timeout on every process group this rank has made so far (the default one waited the
        start-up timeout to meet; DeviceMesh makes its groups with torch's default, 30 minutes)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        for group in list(dist.distributed_c10d._world.pg_names):  # noqa: SLF001 - c10d's registry of groups
            dist.distributed_c10d._set_pg_timeout(self.collective_timeout, group)  # noqa: SLF001

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        # With tensor parallelism the ranks of one TP group must see the same batch: shard by the DP rank.
        dims = self.resolved.parallel
        if dims is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": dims.dp_size, "rank": dims.dp_rank(self.global_rank)}

    # ------------------------------------------------------------------ wrapping
    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.resolved.version == 2:
            return self._setup_fsdp2(model)
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self._fsdp1_root is not None and self._fsdp1_root.module is model:
            # trainer.validate() after fit() hands back the bare module; reuse the root wrapper, whose
            # parameters (embeddings, final norm, head) are only unsharded by the root's forward.
            return self._fsdp1_root
        if any(isinstance(mod, FullyShardedDataParallel) for mod in model.modules()):
            return model
        folder = getattr(model, "sharded_weights", None)
        wrapped, report = apply_fsdp1(model, self.resolved, self.root_device, mesh=self._mesh,
                                      mixed_precision=self.mixed_precision_config, weights=folder,
                                      weights_prefix="model.")
        self._publish(report)
        self._fsdp1_root = wrapped
        if folder is not None:
            rank_zero_info(f"Read {folder} into each rank's shards, one FSDP unit at a time")
        return wrapped

    def _setup_fsdp2(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        # The FSDP2 root is the HF model inside the LightningModule (else the module itself), so the
        # LightningModule's hooks and attributes stay where Lightning looks for them.
        inner = getattr(model, "model", None)
        root = inner if isinstance(inner, nn.Module) else model
        if isinstance(root, FSDPModule):
            return model
        self._fsdp2_root, report = apply_fsdp2(root, self.resolved, self._mesh)
        self._set_collective_timeouts()  # the groups of the data-parallel sub-mesh, made while sharding
        self._publish(report)
        if has_meta_parameters(root):
            materialize(root, self.root_device)
        # A skeleton (the LightningModule's ``sharded_weights``): read the pretrained weights into the shards.
        folder = getattr(model, "sharded_weights", None)
        if folder is not None:
            count = load_safetensors(root, folder)
            rank_zero_info(f"Loaded {count} tensors from {folder} into each rank's shards")
        return model

    def _publish(self, report: Dict[str, Any]) -> None:
        """Keep the wrap report (``train`` writes it to the run dir) and log it on rank 0."""
        resolved = self.resolved
        report.update(fsdp_version=resolved.version, sharding_strategy=resolved.sharding_strategy,
                      world_size=self.world_size, mesh_shape=resolved.mesh_shape)
        self.wrap_report = report
        rank_zero_info(format_wrap_report(report, resolved.sharding_strategy, self.world_size))
        for warning in report["warnings"]:
            rank_zero_warn(f"FSDP wrap: {warning}")

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.resolved.version == 2:
            yield
            return
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        kwargs = fsdp1_kwargs(self.resolved, self.root_device, self.mixed_precision_config)
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs):
            yield

    # ------------------------------------------------------------------ accumulation
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduce-scatter on non-final micro-batches, for FSDP1 and FSDP2 alike."""
        if self.resolved.sync_each_batch:
            yield
        elif self._fsdp2_root is not None:
            self._fsdp2_root.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self._fsdp2_root.set_requires_gradient_sync(True)
        elif self._fsdp1_root is not None:
            with self._fsdp1_root.no_sync():
                yield
        else:
            yield

    # ------------------------------------------------------------------ state and gradients
    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        if self._state_dict_type == "full":
            return self.full_state_dict()
        if self.resolved.version == 2:
            return self.lightning_module.state_dict()
        return super().lightning_module_state_dict()

    def full_state_dict(self) -> Dict[str, Any]:
        """Unsharded weights of the LightningModule on rank 0 (empty elsewhere); every rank must call it."""
        if self.resolved.version == 2:
            return fsdp2_full_state_dict(self.lightning_module)
        assert self.model is not None
        return fsdp1_full_state_dict(self.model, self.root_device)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm across shards (``torch.nn.utils`` on FSDP1 would clip per shard)."""
        if self.resolved.version == 2:
            return fsdp2_clip_grad_norm(self.lightning_module, max_norm)
        assert self._fsdp1_root is not None
        return self._fsdp1_root.clip_grad_norm_(max_norm)
