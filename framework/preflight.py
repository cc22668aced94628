"""Everything that can be checked without training, before any rank is spawned or anything is written: bad
input fails here with one clear line (``ShardlightError``), never as a traceback on every rank."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from transformers import PretrainedConfig, PreTrainedModel

from shardlight.adapters import apply_adapters, check_adapter_machine, check_adapter_targets
from shardlight.build import build_hf_config, build_hf_model, build_tokenizer
from shardlight.build.optimizer import check_optimizer
from shardlight.build.training_model import reads_into_shards, transformers_reason
from shardlight.data_files import check_data
from shardlight.errors import ShardlightError, first_line, warn
from shardlight.fake_tensors import fake_process_group, fake_training_step, shallow_copy, uncheckable
from shardlight.lm_loss import logit_transform, model_router_aux_coef, router_aux_coef
from shardlight.prepared_data import cache_root
from shardlight.recipe import ModelConfig, RecipeConfig
from shardlight.run_context import RunContext, usable_cores
from shardlight.strategy import find_block_classes, resolve_recipe_fsdp
from shardlight.strategy.sharded_load import PEFT_PREFIX, checkpoint_keys, file_key, largest_read_bytes, load_host_bytes
from shardlight.strategy.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from shardlight.strategy.wrapping import block_modules, check_tied_weights, tie_groups, unit_modules

# Ranks per core on CPU beyond which a run crawls so badly it looks hung (2 is normal: 4-rank tests on 2 cores).
MAX_CPU_RANKS_PER_CORE = 2
ATTENTION_IMPLEMENTATIONS = next(
    f.metadata["allowed"] for f in dataclasses.fields(ModelConfig) if f.name == "attn_implementation")


def preflight(cfg: RecipeConfig, ctx: Optional[RunContext] = None, notes: Optional[List[str]] = None):
    """Everything that can be checked without training: bad input fails here with one clear line. ``ctx``: this
    process's facts (default: the process that starts the ranks on this machine, i.e. ``shardlight train``
    typed in a shell). ``notes`` receives what the caller should tell the user once the run is accepted (the
    host RAM of the load). Returns the tokenizer."""
    ctx = ctx or RunContext()
    if ctx.launcher == "local" and not _uses_gpu(cfg):  # Lightning is about to spawn the ranks right here
        check_cpu_ranks(cfg)
    check_data(cfg)
    check_compile(cfg)
    check_optimizer(cfg.optim, _uses_gpu(cfg))
    check_adapter_machine(cfg, uses_gpu=_uses_gpu(cfg))
    tokenizer = build_tokenizer(cfg)
    config = build_hf_config(cfg.model)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and cfg.data.seq_len > max_positions:
        raise ShardlightError(
            f"data.seq_len {cfg.data.seq_len} exceeds the model's maximum positions ({max_positions})"
        )
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ShardlightError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}")
    resolved = resolve_recipe_fsdp(cfg)
    if cfg.trainer.precision.startswith("16") and not _uses_gpu(cfg):
        raise ShardlightError(f"trainer.precision {cfg.trainer.precision} needs a GPU; use bf16-mixed on CPU")
    if resolved.sync_module_states and not _uses_gpu(cfg):
        raise ShardlightError(
            "fsdp.sync_module_states needs GPUs: FSDP broadcasts module states from GPU memory only (Accelerate "
            "refuses it on CPU too)"
        )
    # The ranks Lightning spawns run the same recipe their parent process already stepped on fake tensors.
    skeleton, classes = check_model(cfg, config, resolved, step=not (ctx.launched and ctx.launcher == "lightning"))
    if cfg.model.name_or_path is not None and ctx.rank == 0:
        # Compared with this machine's RAM only where the ranks run (not on a login node submitting a job).
        note = check_load_memory(cfg, resolved, skeleton, classes, here=ctx.launcher == "local" or ctx.launched)
        if notes is not None:
            notes.append(note)
    check_writable_dir(cache_root(cfg), "data.cache_dir")
    check_writable_dir(cfg.output_dir)  # last: the checks that write (probe files, removed again)
    return tokenizer


def check_compile(cfg: RecipeConfig) -> None:
    """``compile: true`` on CPU needs a C++ compiler: inductor writes and builds C++ kernels there."""
    if not cfg.compile or _uses_gpu(cfg):
        return
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(name) for name in names):
        raise ShardlightError(f"compile: true on CPU needs a C++ compiler for torch.compile's kernels (none of "
                              f"{', '.join(names)} found on PATH); install one, set CXX, or set compile: false")


def check_model(cfg: RecipeConfig, config: PretrainedConfig, resolved,
                step: bool = True) -> Tuple[PreTrainedModel, Optional[list]]:
    """Everything about the model itself: it builds (on the meta device, as the ranks build it), takes packed
    blocks, fits the TP plan and the adapters, has the blocks to wrap, and (``step``) runs one training step on
    fake tensors. Returns the skeleton (with adapters) and the block classes FSDP wraps (None: no transformer
    wrap)."""
    skeleton = build_skeleton(cfg.model, config)
    if cfg.data.packing:
        check_packing(skeleton)
    if resolved.parallel is not None:
        if cfg.peft.method is not None:
            raise ShardlightError(f"peft.method {cfg.peft.method} with parallelism.tp_size > 1 is not supported yet")
        check_tensor_parallel(skeleton, resolved.parallel)
    check_adapter_targets(skeleton, peft_cfg=cfg.peft)
    check_loss_chunks(cfg, config)
    check_router_aux(cfg, config)
    # On the meta device, as the ranks will (peft's own refusals surface here); the block classes to wrap
    # are looked up in the wrapped model, as FSDP will.
    with torch.device("meta"), warnings.catch_warnings():
        # peft's own hint that an adapter sits on a tied layer: check_adapters_keep_ties refuses it in one line.
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*", category=UserWarning)
        skeleton = apply_adapters(skeleton, peft_cfg=cfg.peft, seed=cfg.trainer.seed)
    check_adapters_keep_ties(skeleton)
    classes = None
    if cfg.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        classes = find_block_classes(skeleton, cfg.fsdp.transformer_cls_names_to_wrap)
    elif cfg.compile or cfg.fsdp.activation_checkpointing:  # both act per block, whatever the FSDP units
        find_block_classes(skeleton, cfg.fsdp.transformer_cls_names_to_wrap)
    check_tied_weights(skeleton, unit_modules(skeleton, resolved.auto_wrap_policy,
                                              cfg.fsdp.transformer_cls_names_to_wrap, resolved.min_num_params))
    if step:
        check_model_step(cfg, config, skeleton, resolved)
    return skeleton, classes


def check_adapters_keep_ties(adapted: torch.nn.Module) -> None:
    """peft keeps a tied weight one parameter only while no adapter or trainable copy sits on one of its
    modules: a LoRA on the head alone would be lost when the merged model ties it again, a ``modules_to_save``
    copy trains apart from the embedding. Refuse both, naming the module."""
    for group in tie_groups(adapted):
        wrapped = [name for name in group if file_key(name) != name.removeprefix(PEFT_PREFIX)]
        if wrapped:
            module = file_key(wrapped[0]).rsplit(".", 1)[0]
            others = " and ".join(sorted({file_key(n) for n in group} - {file_key(wrapped[0])}))
            raise ShardlightError(
                f"peft: {module} holds a weight tied to {others} (tied embeddings), and an adapter or trainable "
                f"copy on one of them would untie them; leave {module.rsplit('.', 1)[-1]} out of "
                "peft.target_modules and peft.modules_to_save, or untie with model.config.tie_word_embeddings=false")


def check_cpu_ranks(cfg: RecipeConfig) -> None:
    """CPU ranks share this machine's cores: a few more ranks than cores is slow, far more looks hung."""
    ranks, cores = cfg.trainer.devices, usable_cores()
    if ranks > MAX_CPU_RANKS_PER_CORE * cores and not cfg.trainer.allow_oversubscribe:
        raise ShardlightError(
            f"trainer.devices={ranks} would start {ranks} CPU ranks on {cores} usable cores (at most "
            f"{MAX_CPU_RANKS_PER_CORE * cores} here, {MAX_CPU_RANKS_PER_CORE} per core); use fewer devices, "
            "or set trainer.allow_oversubscribe=true to run them anyway")
    if ranks > cores:
        warn(f"trainer.devices={ranks} CPU ranks share {cores} usable cores; each step will be slower")


def check_load_memory(cfg: RecipeConfig, resolved, skeleton: torch.nn.Module, classes: Optional[list],
                      here: bool = True) -> str:
    """The host RAM the pretrained load needs per node (``load_host_bytes``: each rank's share plus what it
    reads whole), as a line to print; (``here``: on the node the ranks run on) refuses a load that this
    node's RAM cannot hold at all."""
    import psutil

    t, dims = cfg.trainer, resolved.parallel
    folder = Path(cfg.model.name_or_path)
    sharded = reads_into_shards(cfg) and (not folder.is_dir() or checkpoint_keys(folder) is not None)
    if dims is not None:
        shard_ranks = dims.tp * dims.dp_shard
    elif resolved.sharding_strategy == "NO_SHARD":
        shard_ranks = 1
    else:
        shard_ranks = resolved.mesh_shape[1] if resolved.hybrid and resolved.mesh_shape else t.devices * t.num_nodes
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in skeleton.parameters()}.values())
    unit_classes = tuple(classes or ()) if resolved.version == 1 else ()
    per_rank = load_host_bytes(total, largest_read_bytes(skeleton, unit_classes), shard_ranks,
                               sharded=sharded, on_gpu=_uses_gpu(cfg))
    node, memory = per_rank * t.devices, psutil.virtual_memory()
    read = "one unit" if unit_classes else "one tensor"
    how = ("the whole model" if not sharded else f"{read} at a time into its shards on the GPU" if _uses_gpu(cfg)
           else f"its share and {read}")
    line = (f"loading {cfg.model.name_or_path}: {_gb(total)} of weights; about {_gb(node)} of host RAM per node "
            f"({t.devices} rank(s) x {_gb(per_rank)}: {how})")
    if here:
        line += f"; this machine has {_gb(memory.available)} available"
    if here and node > memory.total:
        fix = "use more ranks" if sharded else "set fsdp.cpu_ram_efficient_loading: true (each rank reads its share)"
        raise ShardlightError(f"{line}, {_gb(memory.total)} in all: it cannot hold the load; {fix}")
    return f"shardlight: {line}"


def _gb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"


def build_skeleton(model_cfg: ModelConfig, config: PretrainedConfig) -> PreTrainedModel:
    """The model exactly as the ranks build it (their builder, dtype, attention, remote code) but on the meta
    device: no memory, and whatever transformers refuses surfaces here, once, as one line."""
    try:
        return _build_on_meta(model_cfg, config)
    except Exception as exc:  # ValueError, ImportError (flash-attn), RuntimeError (negative size), KeyError...
        raise _model_refusal(model_cfg, config, exc) from None


def _build_on_meta(model_cfg: ModelConfig, config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        # from_config writes dtype and attention into the config it is given; keep the caller's untouched.
        return build_hf_model(model_cfg, weights=False, config=copy.deepcopy(config))


def check_packing(skeleton: PreTrainedModel) -> None:
    """Packed blocks are told apart only by ``position_ids`` restarting at each example; the model must take
    them and build its attention mask with transformers' masking utilities, which turn them into a
    block-causal mask (eager, sdpa, flex) or variable-length attention (flash-attention)."""
    cls = type(skeleton)
    modeling = sys.modules.get(cls.__module__)
    takes_positions = "position_ids" in inspect.signature(cls.forward).parameters
    if not (takes_positions and hasattr(modeling, "create_causal_mask")):
        raise ShardlightError(
            f"data.packing: true needs a model whose attention stays inside each packed example (position_ids "
            f"and transformers' masking utilities); {cls.__name__} has none; set data.packing: false")


def check_loss_chunks(cfg: RecipeConfig, config: PretrainedConfig) -> None:
    """``trainer.loss_chunks`` > 1 computes the loss from the output projection's pieces itself: refused for a
    model that changes its logits after the projection, and with tensor parallelism (a sharded projection)."""
    chunks = cfg.trainer.loss_chunks
    if chunks == 1:
        return
    transform = logit_transform(config.get_text_config())
    if transform is not None:
        raise ShardlightError(f"trainer.loss_chunks {chunks}: {config.model_type} changes its logits after the "
                              f"output projection ({transform}), which a chunked loss would leave out; use 1")
    if cfg.parallelism.tp_size > 1:
        raise ShardlightError(f"trainer.loss_chunks {chunks} with parallelism.tp_size > 1 is not supported yet; "
                              "use 1")
    if chunks >= cfg.data.seq_len:
        raise ShardlightError(f"trainer.loss_chunks {chunks}: more pieces than the {cfg.data.seq_len - 1} "
                              "positions a sequence has (data.seq_len); use fewer")


def check_router_aux(cfg: RecipeConfig, config: PretrainedConfig) -> None:
    """``model.router_aux_loss_coef`` > 0 needs a model whose router has a load-balancing loss."""
    chosen = cfg.model.router_aux_loss_coef
    if chosen and model_router_aux_coef(config) is None:
        raise ShardlightError(f"model.router_aux_loss_coef {chosen:g}: {config.model_type} has no router "
                              "load-balancing loss (not a mixture of experts, or one balanced otherwise); use null")


def check_model_step(cfg: RecipeConfig, config: PretrainedConfig, model: PreTrainedModel, resolved) -> None:
    """One forward, loss and backward of the exact model the ranks build (``model``: its meta skeleton with
    the recipe's dtype, attention, adapters; with its TP plan and the precision's autocast) on fake tensors,
    one block of each kind deep (``shardlight.fake_tensors``): whatever shape error the model has surfaces
    here as one line naming the recipe keys involved, not on every rank after spawn."""
    reason = _step_failure(cfg, model, resolved)
    if reason is None:
        return
    # Blame the one setting without which the step runs; else the model itself.
    if resolved.parallel is not None and _step_failure(cfg, model, resolved, tensor_parallel=False) is None:
        raise ShardlightError(f"parallelism.tp_size {resolved.parallel.tp}: the tensor-parallel model's training "
                              f"step fails ({reason}); use a tp_size or parallelism.tp_plan that fits the model")
    model_cfg = cfg.model
    if cfg.peft.method is not None and _step_failure(cfg, _build_on_meta(model_cfg, config), resolved) is None:
        raise ShardlightError(f"peft.target_modules {list(cfg.peft.target_modules or [])}: the model with these "
                              f"adapters fails its training step ({reason})")
    chosen = model_cfg.attn_implementation
    if chosen not in (None, "eager"):
        eager = dataclasses.replace(model_cfg, attn_implementation="eager")
        with torch.device("meta"):
            eager_model = apply_adapters(_build_on_meta(eager, config), peft_cfg=cfg.peft, seed=cfg.trainer.seed)
        if _step_failure(cfg, eager_model, resolved) is None:
            raise ShardlightError(f"model.attn_implementation: {chosen} fails in this model's training step "
                                  f"({reason}); use eager")
    if cfg.trainer.precision != "32-true" and _step_failure(cfg, model, resolved, precision="32-true") is None:
        raise ShardlightError(f"trainer.precision {cfg.trainer.precision}: the model's training step fails in "
                              f"this precision ({reason}); use 32-true")
    key = "model.config" if model_cfg.config is not None else f"model.name_or_path '{model_cfg.name_or_path}'"
    raise ShardlightError(f"{key}: the model's training step fails before any rank starts (one forward and "
                          f"backward on fake tensors): {reason}")


def _step_failure(cfg: RecipeConfig, model: PreTrainedModel, resolved, *, tensor_parallel: bool = True,
                  precision: Optional[str] = None) -> Optional[str]:
    """Why one fake training step of ``model`` fails, or None when it runs."""
    try:
        blocks = block_modules(model, cfg.fsdp.transformer_cls_names_to_wrap)
    except ShardlightError:  # no block classes: the step runs the whole depth
        blocks = []
    step_model = shallow_copy(model, blocks)
    precision = precision or cfg.trainer.precision
    if precision == "bf16-true":
        step_model.to(torch.bfloat16)
    dims = resolved.parallel if tensor_parallel else None
    group = fake_process_group(dims.tp) if dims is not None else contextlib.nullcontext()
    try:
        with group:
            fake_training_step(
                step_model, micro_batch_size=cfg.trainer.micro_batch_size, seq_len=cfg.data.seq_len,
                vocab_size=int(model.config.get_text_config().vocab_size), packing=cfg.data.packing,
                autocast=torch.bfloat16 if precision == "bf16-mixed" else None,
                before=None if dims is None else functools.partial(_tensor_parallel, dims=dims),
                loss_chunks=cfg.trainer.loss_chunks,
                router_aux_coef=router_aux_coef(cfg.model.router_aux_loss_coef, model.config))
    except ShardlightError:
        raise
    except Exception as exc:  # any failure of the model's own code: it is what the ranks would meet
        return None if uncheckable(exc) else transformers_reason(exc)
    return None


def _tensor_parallel(model: torch.nn.Module, dims) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    apply_tensor_parallel(model, dims, init_device_mesh("cpu", (dims.tp,), mesh_dim_names=("tp",)))


def _builds(model_cfg: ModelConfig, config: PretrainedConfig) -> bool:
    try:
        _build_on_meta(model_cfg, config)
    except Exception:  # the refusal itself is reported for the recipe's own choice, not for each alternative
        return False
    return True


def _model_refusal(model_cfg: ModelConfig, config: PretrainedConfig, exc: Exception) -> ShardlightError:
    """Blame the attention implementation if the same model builds with eager attention, else the architecture."""
    chosen = model_cfg.attn_implementation
    if chosen not in (None, "eager") and _builds(dataclasses.replace(model_cfg, attn_implementation="eager"), config):
        working = _working_attention(model_cfg, config)
        reason = transformers_reason(exc).split(". ")[0].rstrip(".")
        return ShardlightError(
            f"model.attn_implementation: {chosen} does not work for this model here ({reason}); "
            f"use one of: {', '.join(working)}")
    key = "model.config" if model_cfg.config is not None else f"model.name_or_path '{model_cfg.name_or_path}'"
    return ShardlightError(f"{key}: {transformers_reason(exc)}")


def _working_attention(model_cfg: ModelConfig, config: PretrainedConfig) -> List[str]:
    """The recipe's attention choices that this architecture builds with in this environment (by trying each:
    the class flags alone miss a missing flash-attn package)."""
    return [impl for impl in ATTENTION_IMPLEMENTATIONS
            if impl is not None and _builds(dataclasses.replace(model_cfg, attn_implementation=impl), config)]


def check_writable_dir(output_dir, key: str = "output_dir") -> None:
    """Every rank and the export write under ``output_dir`` (the data cache under ``data.cache_dir``): prove it
    can be created and written, and leave the disk as it was (a later check may still refuse the run, and bad
    input writes nothing)."""
    path = Path(output_dir).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ShardlightError(f"{key} '{output_dir}' is a file; it must be a directory (or not exist yet)")
    missing = [p for p in [path, *path.parents] if not p.exists()]  # the dirs this probe creates
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or first_line(exc)
        raise ShardlightError(f"{key} '{output_dir}' cannot be created: {reason}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".shardlight-write-probe-"):
            pass  # removed on close
    except OSError as exc:
        raise ShardlightError(
            f"{key} '{output_dir}' is not writable (a probe file failed: {exc.strerror or first_line(exc)})"
        ) from None
    finally:
        for created in missing:  # innermost first; the run creates them again when it starts writing
            try:
                created.rmdir()
            except OSError:
                break


def _uses_gpu(cfg: RecipeConfig) -> bool:
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        return True
    return cfg.trainer.accelerator == "auto" and torch.cuda.is_available()
