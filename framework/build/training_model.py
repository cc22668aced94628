"""The model: its Hugging Face config (cheap, no weights), the model itself (``from_pretrained`` for a path
or hub id, ``from_config`` for an inline architecture), with the recipe's PEFT adapters when it asks for them
(``build_training_model``), and the LightningModule that trains it. Also how anything is loaded from the hub
(``load_pretrained``; the tokenizer uses it too)."""

from __future__ import annotations

import functools
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, TypeVar

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import is_offline_mode
from huggingface_hub.errors import StrictDataclassError
from huggingface_hub.utils import get_session, validate_repo_id
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from shardlight.adapters import apply_adapters, quantization_config
from shardlight.build.optimizer import build_optimization
from shardlight.errors import ShardlightError, first_line
from shardlight.recipe import ModelConfig, RecipeConfig
from shardlight.strategy.sharded_load import build_skeleton, checkpoint_keys

if TYPE_CHECKING:  # the LightningModule (and Lightning) only where a run builds it, not for a config
    from shardlight.causal_lm import CausalLMModule

# Long enough for a slow but working link; an air-gapped node answers in ms (no DNS) or never (dropped).
HUB_PROBE_TIMEOUT_S = 3.0

Loaded = TypeVar("Loaded")


def transformers_reason(exc: BaseException) -> str:
    """One line for a transformers refusal. huggingface_hub's strict-dataclass config validation puts a header
    first ("Class validation error for validator ...") and the real reason in the exception it wraps."""
    if isinstance(exc, StrictDataclassError) and exc.__cause__ is not None:
        return first_line(exc.__cause__)
    if isinstance(exc, KeyError):  # a lookup table's refusal is just the key, e.g. 'nope' for hidden_act: nope
        return f"unknown name {first_line(exc)}"
    return first_line(exc)


@functools.lru_cache(maxsize=None)
def hub_reachable(endpoint: str) -> bool:
    """One quick request to the hub (through huggingface_hub's own session, so proxies apply), once per process."""
    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception:  # DNS, refused, timed out, proxy: every download would fail the same way, five times a file
        return False
    return True


def _is_hub_id(name: str) -> bool:
    if os.path.isdir(name):
        return False
    try:
        validate_repo_id(name)
    except ValueError:  # a path ("./x", "/abs/x", "a/b/c"): transformers reports it as not found
        return False
    return True


def load_pretrained(load: Callable[..., Loaded], name: str, key: str, **kwargs: Any) -> Loaded:
    """``load(name, **kwargs)`` (a ``from_pretrained``) that never sits in Hugging Face's retries (five per file,
    about 50 s) on a machine that cannot reach the hub: with the hub unreachable or HF_HUB_OFFLINE set it uses
    the local cache only, and an id that is not cached fails at once, as one line naming ``key``."""
    if not _is_hub_id(name):
        return load(name, **kwargs)
    offline = is_offline_mode()
    if not offline and hub_reachable(hub_constants.ENDPOINT):
        return load(name, **kwargs)
    try:
        return load(name, local_files_only=True, **kwargs)
    except OSError:  # not in the cache (other refusals, e.g. remote code, are the caller's to report)
        pass
    if offline:
        raise ShardlightError(
            f"{key} '{name}' is not a local directory and not in the Hugging Face cache, and HF_HUB_OFFLINE is "
            f"set, so it is not downloaded: pre-download it (`hf download {name}`) or point {key} at a local "
            "directory") from None
    raise ShardlightError(
        f"{key} '{name}' is not a local directory or in the Hugging Face cache, and the hub "
        f"({hub_constants.ENDPOINT}) cannot be reached: pre-download it where there is network "
        f"(`hf download {name}`) and run with HF_HUB_OFFLINE=1, or point {key} at a local directory") from None


def build_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The architecture config, without weights (cheap; used by preflight checks and the builders)."""
    if cfg.config is not None:
        spec = dict(cfg.config)
        model_type = spec.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **spec)
        except Exception as exc:  # ValueError, strict-dataclass validation, even ZeroDivisionError (0 heads)
            raise ShardlightError(f"model.config: {transformers_reason(exc)}") from None
    try:
        return load_pretrained(AutoConfig.from_pretrained, cfg.name_or_path, "model.name_or_path",
                               trust_remote_code=cfg.trust_remote_code)
    except ShardlightError:
        raise
    except Exception as exc:  # OSError (not found), ValueError (remote code), config validation
        raise ShardlightError(
            f"model.name_or_path '{cfg.name_or_path}' could not be loaded: {transformers_reason(exc)}"
        ) from None


def build_hf_model(cfg: ModelConfig, weights: bool = True, config: Optional[PretrainedConfig] = None,
                   quantization: Optional[Any] = None) -> PreTrainedModel:
    """``from_pretrained`` for a path or hub id, ``from_config`` for an inline config (or ``weights=False``);
    ``quantization``: a transformers quantization config for ``from_pretrained`` (QLoRA's 4-bit base)."""
    kwargs: Dict[str, Any] = {"dtype": getattr(torch, cfg.dtype), "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.config is not None or not weights:
        return AutoModelForCausalLM.from_config(config or build_hf_config(cfg), **kwargs)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    return load_pretrained(AutoModelForCausalLM.from_pretrained, cfg.name_or_path, "model.name_or_path", **kwargs)


def build_training_model(cfg: RecipeConfig, weights: bool = True) -> nn.Module:
    """The model a run trains: the HF model (4-bit for ``qlora``), wrapped by peft when ``peft.method`` is set.
    ``weights=False``: its skeleton for a sharded load (parameters on the meta device; buffers and adapters
    real)."""
    if weights:
        model = build_hf_model(cfg.model, quantization=quantization_config(cfg))
    else:
        model = build_skeleton(partial(build_hf_model, cfg.model, weights=False))
    return apply_adapters(model, peft_cfg=cfg.peft, seed=cfg.trainer.seed)


def reads_into_shards(cfg: RecipeConfig) -> bool:
    """Whether the recipe's pretrained weights go straight into each rank's shards (a checkpoint in
    safetensors assumed; ``sharded_weights_folder`` checks)."""
    return (cfg.model.name_or_path is not None and cfg.peft.method != "qlora"
            and cfg.fsdp.cpu_ram_efficient_loading is not False)


def sharded_weights_folder(cfg: RecipeConfig) -> Optional[Path]:
    """The safetensors checkpoint the strategy reads into each rank's shards (``shardlight.strategy.sharded_load``)
    instead of every rank calling ``from_pretrained``: the folder of ``model.name_or_path`` (a hub id's cached
    snapshot). None, and each rank loads the whole model, for an inline ``model.config``, a ``qlora`` base
    (bitsandbytes quantizes while loading), ``fsdp.cpu_ram_efficient_loading: false``, or a checkpoint with no
    safetensors."""
    name = cfg.model.name_or_path
    if not reads_into_shards(cfg):
        return None
    if os.path.isdir(name):
        folder = Path(name)
    else:
        from huggingface_hub import snapshot_download

        folder = Path(load_pretrained(snapshot_download, name, "model.name_or_path",
                                      allow_patterns=["*.safetensors", "*.json"]))
    return folder if checkpoint_keys(folder) is not None else None


def build_module(cfg: RecipeConfig, *, sharded_load: bool = True) -> "CausalLMModule":
    """The LightningModule, with the recipe's model and optimizer builders. ``sharded_load=False``: the model is
    built with its weights (``from_pretrained``) even where the strategy could read them into its shards (a
    single process that no strategy shards)."""
    from shardlight.causal_lm import CausalLMModule

    return CausalLMModule(
        cfg,
        make_model=partial(build_training_model, cfg),
        make_optimization=partial(build_optimization, optim=cfg.optim, max_steps=cfg.trainer.max_steps),
        sharded_weights=sharded_weights_folder(cfg) if sharded_load else None,
    )
