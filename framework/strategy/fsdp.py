"""shardlight's FSDP strategy: Lightning's ``FSDPStrategy`` configured in Accelerate's vocabulary,
for FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``).

It fixes what Lightning 2.6's stock strategy gets wrong:
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
from typing import Any, Dict, Generator, List, Optional

import torch
from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs, _setup_activation_checkpointing
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from shardlight.recipe import FSDPConfig
from shardlight.strategy.options import ResolvedFSDP, resolve_fsdp
from shardlight.strategy.wrapping import find_block_classes, format_wrap_report, unit_modules, wrap_report

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    """FSDP from a recipe's ``fsdp:`` section (Accelerate's ``FullyShardedDataParallelPlugin`` field names).

    Args:
        fsdp: the recipe's FSDP section; parsed and validated with Accelerate's plugin (see ``options``).
        precision: ``trainer.precision``; mixed precisions become FSDP's (MixedPrecision|MixedPrecisionPolicy).
        num_nodes, devices: the allocation, for hybrid meshes.
        num_threads: torch intra-op threads per rank on CPU (None: cores shared between local ranks).
        timeout: collective timeout.
    """

    strategy_name = "shardlight_fsdp"

    def __init__(
        self,
        fsdp: FSDPConfig,
        precision: str = "32-true",
        num_nodes: int = 1,
        devices: int = 1,
        num_threads: Optional[int] = None,
        timeout: timedelta = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision

        resolved = resolve_fsdp(fsdp, precision, num_nodes, devices)
        fsdp1_kwargs: Dict[str, Any] = {}
        mixed = None
        if resolved.version == 1:
            fsdp1_kwargs = {
                "forward_prefetch": resolved.forward_prefetch,
                "limit_all_gathers": resolved.limit_all_gathers,
                "use_orig_params": resolved.use_orig_params,
                "sync_module_states": resolved.sync_module_states,
                "backward_prefetch": BackwardPrefetch[resolved.backward_prefetch] if resolved.backward_prefetch else None,
            }
            if fsdp.mixed_precision not in (None, "no"):
                dtype = _DTYPES[fsdp.mixed_precision]
                mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
            if resolved.hybrid:
                fsdp1_kwargs["device_mesh"] = resolved.mesh_shape  # built on the right device type later
        super().__init__(
            sharding_strategy=resolved.sharding_strategy if resolved.version == 1 else "FULL_SHARD",
            cpu_offload=resolved.cpu_offload if resolved.version == 1 else None,
            mixed_precision=mixed,
            state_dict_type="sharded" if resolved.state_dict_type == "SHARDED_STATE_DICT" else "full",
            timeout=timeout,
            **fsdp1_kwargs,
            **kwargs,
        )
        self.fsdp_config = fsdp
        self.resolved: ResolvedFSDP = resolved
        self.num_threads = num_threads
        self.wrap_report: Optional[Dict[str, Any]] = None
        self._fsdp1_root: Optional[nn.Module] = None
        self._fsdp2_root: Optional[nn.Module] = None
        self._mesh: Any = None

    # ------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            local_ranks = max(1, self.num_processes)
            torch.set_num_threads(self.num_threads or max(1, (os.cpu_count() or 1) // local_ranks))
        if isinstance(self.precision_plugin, FSDPPrecision) and not isinstance(
            self.precision_plugin, DeviceAutocastFSDPPrecision
        ):
            plugin = DeviceAutocastFSDPPrecision(self.precision_plugin.precision, self.precision_plugin.scaler)
            plugin.device_type = self.root_device.type
            self.precision_plugin = plugin
        mesh_shape = self.kwargs.pop("device_mesh", None)
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        device_type = self.root_device.type
        if self.resolved.version == 1 and mesh_shape is not None:
            # The parent hard-codes a CUDA mesh; build it for the device we actually run on.
            self.kwargs["device_mesh"] = init_device_mesh(device_type, tuple(mesh_shape))
        elif self.resolved.version == 2:
            if self.resolved.mesh_shape is not None:
                self._mesh = init_device_mesh(device_type, self.resolved.mesh_shape,
                                              mesh_dim_names=("replicate", "shard"))
            else:
                self._mesh = init_device_mesh(device_type, (self.world_size,))

    def _device_id(self) -> Any:
        # FSDP1 refuses device_id=None on a CPU-only host; the device itself is accepted on both.
        return self.root_device if self.root_device.type == "cpu" else self.root_device.index

    # ------------------------------------------------------------------ wrapping
    def _sharded_module(self, model: nn.Module) -> nn.Module:
        """The HF model inside the LightningModule (the FSDP2 root), else the module itself."""
        inner = getattr(model, "model", None)
        return inner if isinstance(inner, nn.Module) else model

    def _report(self, model: nn.Module, units: List[nn.Module]) -> None:
        report = wrap_report(model, units, self.fsdp_config.wrap_report_tiny_unit_params)
        report.update(fsdp_version=self.resolved.version, sharding_strategy=self.resolved.sharding_strategy,
                      world_size=self.world_size, mesh_shape=self.resolved.mesh_shape)
        self.wrap_report = report
        rank_zero_info(format_wrap_report(report, self.resolved.sharding_strategy, self.world_size))
        for warning in report["warnings"]:
            rank_zero_warn(f"FSDP wrap: {warning}")

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
        cfg = self.fsdp_config
        units = unit_modules(model, cfg.auto_wrap_policy, cfg.transformer_cls_names_to_wrap, cfg.min_num_params)
        self._report(model, units)
        if units:
            unit_ids = {id(u) for u in units}
            self.kwargs["auto_wrap_policy"] = lambda module, recurse, nonwrapped_numel: (
                True if recurse else id(module) in unit_ids
            )
        if self.resolved.activation_checkpointing:
            blocks = tuple(find_block_classes(model, cfg.transformer_cls_names_to_wrap))
            self._activation_checkpointing_kwargs = _activation_checkpointing_kwargs(None, set(blocks))
        param_init_fn = None
        if self.resolved.cpu_ram_efficient_loading and self.global_rank != 0:
            # Weights exist on rank 0 only; the others materialize empty storage and receive a broadcast.
            param_init_fn = lambda module: module.to_empty(device=self.root_device, recurse=False)  # noqa: E731
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._device_id(),
            param_init_fn=param_init_fn,
            **self.kwargs,
        )
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        self._fsdp1_root = wrapped
        return wrapped

    def _setup_fsdp2(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

        root = self._sharded_module(model)
        if isinstance(root, FSDPModule):
            return model
        cfg, resolved = self.fsdp_config, self.resolved
        units = unit_modules(root, cfg.auto_wrap_policy, cfg.transformer_cls_names_to_wrap, cfg.min_num_params)
        self._report(root, units)
        if resolved.activation_checkpointing:
            # Non-reentrant checkpointing around each block, applied before sharding (FSDP2's order).
            block_ids = {id(b) for b in find_block_classes_instances(root, cfg.transformer_cls_names_to_wrap)}
            apply_activation_checkpointing(root, checkpoint_wrapper_fn=checkpoint_wrapper,
                                           check_fn=lambda m: id(m) in block_ids)
            wrapped_ids = {id(u) for u in units}
            units = [m for m in root.modules() if isinstance(m, CheckpointWrapper)
                     and id(m._checkpoint_wrapped_module) in wrapped_ids][::-1] or units
        kwargs: Dict[str, Any] = {"mesh": self._mesh, "reshard_after_forward": resolved.reshard_after_forward}
        if resolved.mixed_precision:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=_DTYPES[resolved.mixed_precision],
                                                       reduce_dtype=torch.float32)
        if resolved.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(root, **kwargs)
        self._fsdp2_root = root
        return model

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.resolved.version == 2:
            yield
            return
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        kwargs = {k: v for k, v in self.kwargs.items() if k not in ("auto_wrap_policy", "device_mesh")}
        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._device_id(),
            **kwargs,
        ):
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
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(self.lightning_module, options=options)
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert self.model is not None
        # offload_to_cpu on a CPU rank frees the storage it "copied" from: a segfault, not a copy.
        config = FullStateDictConfig(offload_to_cpu=self.root_device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, config):
            return self.model.state_dict()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm across shards (``torch.nn.utils`` on FSDP1 would clip per shard)."""
        if self.resolved.version == 2:
            params = [p for p in self.lightning_module.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        assert self._fsdp1_root is not None
        return self._fsdp1_root.clip_grad_norm_(max_norm)


def find_block_classes_instances(model: nn.Module, names: Optional[List[str]]) -> List[nn.Module]:
    classes = tuple(find_block_classes(model, names))
    return [m for m in model.modules() if isinstance(m, classes)]
