"""shardlight's FSDP strategy: Lightning's ``FSDPStrategy`` configured in Accelerate's vocabulary.

It also fixes what keeps the stock strategy off CPU (gloo) so the same code path is tested here and
run on GPU clusters (NCCL): the accelerator connector refuses the exact stock class on CPU (a subclass
passes), ``device_id=root_device.index`` is None on CPU and torch then refuses to wrap, tuple device
meshes are hard-coded to CUDA, and full state dicts with ``offload_to_cpu=True`` crash on CPU.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Generator, List, Optional

import torch
from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs, _setup_activation_checkpointing
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from framework.config import FSDPConfig
from framework.errors import ShardlightError

_MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def find_block_classes(model: nn.Module, names: Optional[List[str]]) -> List[type]:
    """Module classes to wrap, by name; no names → the HF model's ``_no_split_modules`` (as Accelerate does)."""
    if not names:
        names = []
        for module in model.modules():
            names.extend(getattr(module, "_no_split_modules", None) or [])
        if not names:
            raise ShardlightError(
                "fsdp.auto_wrap_policy TRANSFORMER_BASED_WRAP: the model declares no _no_split_modules; "
                "set fsdp.transformer_cls_names_to_wrap"
            )
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in dict.fromkeys(names) if n not in present]
    wanted = [n for n in dict.fromkeys(names) if n in present]
    if missing and not wanted:
        raise ShardlightError(
            f"fsdp.transformer_cls_names_to_wrap: {', '.join(missing)} not found in the model; "
            f"module classes present: {', '.join(sorted(present))}"
        )
    return [present[n] for n in wanted]


def build_auto_wrap_policy(model: nn.Module, cfg: FSDPConfig) -> Any:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if cfg.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        return ModuleWrapPolicy(set(find_block_classes(model, cfg.transformer_cls_names_to_wrap)))
    if cfg.auto_wrap_policy == "SIZE_BASED_WRAP":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.min_num_params)
    return None


def _mixed_precision(cfg: FSDPConfig) -> Any:
    if cfg.mixed_precision in (None, "no"):
        return None
    from torch.distributed.fsdp import MixedPrecision

    dtype = _MIXED_PRECISION_DTYPES[cfg.mixed_precision]
    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)


class ShardlightFSDPStrategy(FSDPStrategy):
    """FSDP configured from a recipe's ``fsdp:`` section (Accelerate's FSDP plugin field names).

    Args:
        fsdp: the recipe's FSDP section. Wrapping and activation checkpointing are resolved against
            the model when it is wrapped, since the block classes are only known then.
        num_threads: torch intra-op threads per rank on CPU (None: cores shared between local ranks).
        timeout: collective timeout.
    """

    strategy_name = "shardlight_fsdp"

    def __init__(
        self,
        fsdp: FSDPConfig,
        num_threads: Optional[int] = None,
        timeout: timedelta = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        from torch.distributed.fsdp import BackwardPrefetch

        fsdp_kwargs: Dict[str, Any] = {
            "forward_prefetch": fsdp.forward_prefetch,
            "limit_all_gathers": fsdp.limit_all_gathers,
            "use_orig_params": fsdp.use_orig_params,
            "sync_module_states": fsdp.sync_module_states,
        }
        if fsdp.backward_prefetch not in (None, "NO_PREFETCH"):
            fsdp_kwargs["backward_prefetch"] = BackwardPrefetch[fsdp.backward_prefetch]
        else:
            fsdp_kwargs["backward_prefetch"] = None
        super().__init__(
            sharding_strategy=fsdp.sharding_strategy,
            # Hybrid sharding needs a mesh; the policy is only known at wrap time.
            auto_wrap_policy=None,
            cpu_offload=fsdp.cpu_offload,
            mixed_precision=_mixed_precision(fsdp),
            state_dict_type="sharded" if fsdp.state_dict_type == "SHARDED_STATE_DICT" else "full",
            timeout=timeout,
            **({"device_mesh": ()} if "HYBRID" in fsdp.sharding_strategy else {}),
            **fsdp_kwargs,
            **kwargs,
        )
        self.fsdp_config = fsdp
        self.num_threads = num_threads

    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            local_ranks = max(1, self.num_processes)
            torch.set_num_threads(self.num_threads or max(1, (os.cpu_count() or 1) // local_ranks))
        if self.kwargs.get("device_mesh") == ():
            # HYBRID_SHARD: shard inside a node, replicate across nodes.
            self.kwargs["device_mesh"] = (self.num_nodes, self.num_processes)
        mesh = self.kwargs.get("device_mesh")
        if isinstance(mesh, tuple):
            # The parent hard-codes a CUDA mesh; build it for the device we actually run on.
            self.kwargs.pop("device_mesh")
            super().setup_environment()
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, mesh)
        else:
            super().setup_environment()

    def _device_id(self) -> Any:
        # FSDP refuses device_id=None on a CPU-only host; the device itself is accepted on both.
        return self.root_device if self.root_device.type == "cpu" else self.root_device.index

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = getattr(self, "_wrapped_root", None)
        if root is not None and root.module is model:
            # trainer.validate() after fit() hands back the bare module; reuse the root wrapper, whose
            # parameters (embeddings, final norm, head) are only unsharded by the root's forward.
            return root
        if any(isinstance(mod, FullyShardedDataParallel) for mod in model.modules()):
            return model
        policy = build_auto_wrap_policy(model, self.fsdp_config)
        if policy is not None:
            self.kwargs["auto_wrap_policy"] = policy
        if self.fsdp_config.activation_checkpointing:
            blocks = find_block_classes(model, self.fsdp_config.transformer_cls_names_to_wrap)
            self._activation_checkpointing_kwargs = _activation_checkpointing_kwargs(None, set(blocks))
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._device_id(),
            **self.kwargs,
        )
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        self._wrapped_root = wrapped
        units = len(FullyShardedDataParallel.fsdp_modules(wrapped))
        rank_zero_info(
            f"FSDP {self.fsdp_config.sharding_strategy}: {units} units ({self.fsdp_config.auto_wrap_policy}) "
            f"on {self.world_size} ranks, backend {self._process_group_backend}"
        )
        return wrapped

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        kwargs = {k: v for k, v in self.kwargs.items() if k != "auto_wrap_policy"}
        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self._device_id(),
            **kwargs,
        ):
            yield

    @override
    def lightning_module_state_dict(self) -> Dict[str, Any]:
        if self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        return self.full_state_dict()

    def full_state_dict(self) -> Dict[str, Any]:
        """Unsharded weights on rank 0 (empty elsewhere); a collective, so every rank must call it."""
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert self.model is not None
        # offload_to_cpu on a CPU rank frees the storage it "copied" from: a segfault, not a copy.
        config = FullStateDictConfig(offload_to_cpu=self.root_device.type != "cpu", rank0_only=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, config):
            return self.model.state_dict()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm across shards (``torch.nn.utils`` would clip per shard)."""
        assert self.model is not None
        return self.model.clip_grad_norm_(max_norm)
