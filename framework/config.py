"""The typed recipe schema and its loader.

A recipe is YAML. It is merged onto the schema defaults with OmegaConf (``base:`` recipes first,
then the recipe, then ``key.path=value`` overrides) and validated here, before any rank is spawned,
so that bad input is one clear line instead of a traceback from deep inside torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.errors import ShardlightError

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "tiny-llama-sft.yaml"


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local directory or Hugging Face hub id, loaded with from_pretrained."}
    )
    config: Optional[Dict[str, Any]] = field(
        default=None,
        metadata={"help": "Inline Hugging Face architecture config (needs model_type); builds with from_config."},
    )
    dtype: str = field(default="float32", metadata={"help": "Weight dtype at load: float32, bfloat16, float16."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code shipped with the model repo."})
    attn_implementation: Optional[str] = field(
        default="sdpa", metadata={"help": "eager, sdpa or flash_attention_2 (null: transformers' choice)."}
    )


@dataclass
class TokenizerConfig:
    name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory or hub id; null uses model.name_or_path."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run code shipped with the tokenizer repo."})


@dataclass
class DataConfig:
    train_files: List[str] = field(
        default_factory=list, metadata={"help": "Local JSONL/JSON/CSV/Parquet/text files (relative to the recipe)."}
    )
    val_files: List[str] = field(default_factory=list, metadata={"help": "Local validation files."})
    dataset: Optional[str] = field(default=None, metadata={"help": "Hub dataset name, used when train_files is empty."})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration name."})
    split: str = field(default="train", metadata={"help": "Training split of the hub dataset."})
    val_split: Optional[str] = field(default=None, metadata={"help": "Validation split of the hub dataset."})
    val_fraction: float = field(
        default=0.05, metadata={"help": "Held-out fraction of the training rows when no validation data is given."}
    )
    format: str = field(default="instruction", metadata={"help": "text, instruction or chat."})
    text_field: str = field(default="text", metadata={"help": "Column with raw text (format: text)."})
    prompt_field: str = field(default="prompt", metadata={"help": "Column with the prompt (format: instruction)."})
    response_field: str = field(default="response", metadata={"help": "Column with the answer (format: instruction)."})
    messages_field: str = field(default="messages", metadata={"help": "Column with chat messages (format: chat)."})
    prompt_template: str = field(
        default="### Instruction:\n{prompt}\n\n### Response:\n",
        metadata={"help": "Template wrapped around the prompt; must contain {prompt}."},
    )
    seq_len: int = field(default=256, metadata={"help": "Tokens per training sequence."})
    packing: bool = field(default=True, metadata={"help": "Concatenate examples into seq_len blocks."})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank."})


@dataclass
class OptimConfig:
    lr: float = field(default=3e-4, metadata={"help": "Peak AdamW learning rate."})
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95], metadata={"help": "AdamW betas."})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warmup steps from 0 to lr."})
    schedule: str = field(default="cosine", metadata={"help": "cosine, linear or constant after warmup."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Final lr as a fraction of lr (cosine, linear)."})


@dataclass
class TrainerConfig:
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to train."})
    micro_batch_size: int = field(default=8, metadata={"help": "Sequences per rank per forward pass."})
    accumulate_grad_batches: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    precision: str = field(
        default="32-true", metadata={"help": "Lightning precision: 32-true, bf16-mixed, bf16-true, 16-mixed."}
    )
    accelerator: str = field(default="auto", metadata={"help": "auto, cpu, gpu or cuda."})
    devices: int = field(default=1, metadata={"help": "Ranks (processes) per node."})
    num_nodes: int = field(default=1, metadata={"help": "Nodes."})
    seed: int = field(default=1234, metadata={"help": "Seed for weights, shuffling and dropout."})
    log_every_n_steps: int = field(default=10, metadata={"help": "Logging interval in optimizer steps."})
    val_every_n_steps: int = field(default=50, metadata={"help": "Validation interval in optimizer steps."})
    limit_val_batches: Optional[int] = field(default=None, metadata={"help": "Cap on validation batches per rank."})
    gradient_clip_val: Optional[float] = field(default=1.0, metadata={"help": "Clip the gradient norm (null: off)."})
    num_threads: Optional[int] = field(
        default=None, metadata={"help": "torch threads per rank on CPU (null: cores / ranks on the node)."}
    )
    progress_bar: bool = field(default=True, metadata={"help": "Show Lightning's progress bar on rank 0."})
    collective_timeout_s: int = field(
        default=1800, metadata={"help": "Seconds a collective may wait for a dead or hung rank before failing."}
    )


@dataclass
class FSDPConfig:
    """Accelerate's ``FullyShardedDataParallelPlugin`` fields, same names and meanings.

    ``null`` means Accelerate's default for the chosen ``fsdp_version``. shardlight's own defaults
    differ from Accelerate's in three places, each to hide communication better: transformer-block
    wrapping (Accelerate: NO_WRAP, a single unit), BACKWARD_PRE prefetch for FSDP1 (Accelerate:
    none) and ``use_orig_params: true`` for FSDP1 (needed for per-parameter optimizer groups).
    """

    fsdp_version: int = field(default=1, metadata={"help": "1: FullyShardedDataParallel; 2: fully_shard (DTensor)."})
    sharding_strategy: Optional[str] = field(
        default=None,
        metadata={"help": "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 (null: FULL_SHARD)."},
    )
    reshard_after_forward: Optional[Any] = field(
        default=None,
        metadata={"help": "FSDP2: free gathered params after forward (true ~ FULL_SHARD, false ~ SHARD_GRAD_OP)."},
    )
    auto_wrap_policy: str = field(
        default="TRANSFORMER_BASED_WRAP", metadata={"help": "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP."}
    )
    transformer_cls_names_to_wrap: Optional[List[str]] = field(
        default=None, metadata={"help": "Block classes to wrap (null: the model's _no_split_modules)."}
    )
    transformer_layer_cls_to_wrap: Optional[List[str]] = field(
        default=None, metadata={"help": "Alias of transformer_cls_names_to_wrap (Accelerate's config name)."}
    )
    min_num_params: Optional[int] = field(
        default=None, metadata={"help": "SIZE_BASED_WRAP: parameters per unit at least (null: 0, as Accelerate)."}
    )
    backward_prefetch: Optional[str] = field(
        default=None,
        metadata={"help": "FSDP1: BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (null: BACKWARD_PRE; FSDP2: invalid)."},
    )
    forward_prefetch: Optional[bool] = field(
        default=None, metadata={"help": "FSDP1: issue the next all-gather during forward (null: false; FSDP2: invalid)."}
    )
    limit_all_gathers: bool = field(default=True, metadata={"help": "FSDP1: rate-limit all-gathers in flight."})
    use_orig_params: Optional[bool] = field(
        default=None, metadata={"help": "FSDP1: keep original parameters visible (null: true; FSDP2 always does)."}
    )
    cpu_offload: bool = field(default=False, metadata={"help": "Offload parameters and gradients to CPU."})
    offload_params: Optional[bool] = field(
        default=None, metadata={"help": "Alias of cpu_offload (Accelerate's config name)."}
    )
    state_dict_type: Optional[str] = field(
        default=None,
        metadata={"help": "FULL_STATE_DICT or SHARDED_STATE_DICT (null: FULL for FSDP1, SHARDED for FSDP2)."},
    )
    sync_module_states: Optional[bool] = field(
        default=None, metadata={"help": "FSDP1: broadcast rank 0's weights at wrap time (null: false)."}
    )
    cpu_ram_efficient_loading: Optional[bool] = field(
        default=None, metadata={"help": "Load pretrained weights on rank 0 only and broadcast them (null: false)."}
    )
    activation_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute each transformer block in backward (non-reentrant)."}
    )
    mixed_precision: Optional[str] = field(
        default=None,
        metadata={"help": "FSDP param/reduce dtype: bf16, fp16, fp32 or no (null: from trainer.precision)."},
    )
    mixed_precision_policy: Optional[str] = field(
        default=None, metadata={"help": "Alias of mixed_precision (Accelerate's field name)."}
    )
    sync_each_batch: bool = field(
        default=False,
        metadata={"help": "Reduce-scatter on every micro-batch under accumulation (less memory, more traffic)."},
    )
    mesh_shape: Optional[List[int]] = field(
        default=None, metadata={"help": "HYBRID_SHARD (replicate, shard) mesh (null: (num_nodes, devices))."}
    )
    wrap_report_tiny_unit_params: int = field(
        default=1_000_000, metadata={"help": "Wrap report: warn when units are smaller than this."}
    )


@dataclass
class WandbConfig:
    enabled: bool = field(default=True, metadata={"help": "Log to Weights & Biases."})
    project: str = field(default="shardlight", metadata={"help": "W&B project."})
    entity: Optional[str] = field(default=None, metadata={"help": "W&B entity (team or user)."})
    group: Optional[str] = field(default=None, metadata={"help": "W&B group."})
    name: Optional[str] = field(default=None, metadata={"help": "W&B run name (null: the run dir name)."})
    mode: Optional[str] = field(
        default=None, metadata={"help": "online, offline or disabled (null: offline unless WANDB_API_KEY is set)."}
    )
    tags: List[str] = field(default_factory=list, metadata={"help": "W&B tags."})


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: bool = field(default=True, metadata={"help": "Also write metrics.csv in the run dir."})


@dataclass
class CommCallbackConfig:
    enabled: bool = field(default=True, metadata={"help": "Profile collectives vs compute in short windows."})
    every_n_steps: int = field(default=50, metadata={"help": "Steps between profiling windows (plus one early)."})
    first_step: Optional[int] = field(
        default=5, metadata={"help": "Step of the early profiling window (null or 0: none)."}
    )
    wait: int = field(default=0, metadata={"help": "Profiler schedule: steps skipped at a window's start."})
    warmup: int = field(default=1, metadata={"help": "Profiler schedule: warm-up steps (traced, not recorded)."})
    active: int = field(
        default=2, metadata={"help": "Profiler schedule: recorded steps (the last is dropped in analysis, as HTA)."}
    )
    per_rank: bool = field(default=True, metadata={"help": "Also log comm/rank<R>/... keys for every rank."})
    keep_windows: Optional[int] = field(
        default=10, metadata={"help": "Keep the traces of this many latest windows in run_dir/traces (null: all)."}
    )


@dataclass
class MemoryCallbackConfig:
    enabled: bool = field(default=True, metadata={"help": "Log memory headroom and shard bytes per rank."})
    every_n_steps: Optional[int] = field(
        default=None, metadata={"help": "Steps between memory logs (null: trainer.log_every_n_steps)."}
    )
    per_rank: bool = field(default=True, metadata={"help": "Also log memory/rank<R>/... keys for every rank."})


@dataclass
class ThroughputCallbackConfig:
    enabled: bool = field(default=True, metadata={"help": "Log tokens/s per device, MFU, scaling efficiency."})
    peak_tflops: Optional[float] = field(
        default=None, metadata={"help": "Peak TFLOP/s per device for MFU (null: from the built-in table)."}
    )
    peak_tflops_table: Dict[str, float] = field(
        default_factory=dict,
        metadata={"help": "Device-name substring -> peak TFLOP/s; overrides/extends the built-in A100/H100/H200 table."},
    )
    baseline_file: Optional[str] = field(
        default=None,
        metadata={"help": "JSON with tokens_per_sec_per_device (shardlight profile) for scaling efficiency."},
    )
    every_n_steps: Optional[int] = field(
        default=None, metadata={"help": "Steps between throughput logs (null: trainer.log_every_n_steps)."}
    )
    measure_flops: bool = field(
        default=True, metadata={"help": "Count FLOPs/token with torch.utils.flop_counter (false: 6N + attention)."}
    )


@dataclass
class CallbacksConfig:
    comm: CommCallbackConfig = field(default_factory=CommCallbackConfig)
    memory: MemoryCallbackConfig = field(default_factory=MemoryCallbackConfig)
    throughput: ThroughputCallbackConfig = field(default_factory=ThroughputCallbackConfig)


@dataclass
class CheckpointConfig:
    enabled: bool = field(default=True, metadata={"help": "Save sharded (DCP) checkpoints to run_dir/checkpoints/."})
    every_n_steps: Optional[int] = field(
        default=100, metadata={"help": "Optimizer steps between checkpoints (null: only at the end)."}
    )
    keep_last: Optional[int] = field(default=2, metadata={"help": "Keep this many newest checkpoints (null: all)."})
    save_last: bool = field(default=True, metadata={"help": "Also save when training ends."})


@dataclass
class LaunchConfig:
    env: Dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "Environment for launched jobs (e.g. NCCL_* settings); written into sbatch scripts."},
    )


@dataclass
class RecipeConfig:
    name: Optional[str] = field(default=None, metadata={"help": "Recipe name (null: the recipe file's stem)."})
    base: Optional[str] = field(default=None, metadata={"help": "Recipe merged underneath this one."})
    output_dir: str = field(default="runs", metadata={"help": "Runs go to output_dir/<name>/<timestamp>/."})
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    resume: Optional[str] = field(
        default=None, metadata={"help": "auto (newest complete checkpoint, if any) or a checkpoint/run dir path."}
    )
    resume_dir: Optional[str] = field(
        default=None, metadata={"help": "resume=auto: the run dir to look in (null: newest run of this recipe)."}
    )
    export: bool = field(
        default=False, metadata={"help": "After training, export the final checkpoint to run_dir/export (verified)."}
    )


ALLOWED_VALUES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": (None, "eager", "sdpa", "flash_attention_2", "flex_attention"),
    "data.format": ("text", "instruction", "chat"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true"),
    "trainer.accelerator": ("auto", "cpu", "gpu", "cuda"),
    "fsdp.fsdp_version": (1, 2),
    "fsdp.sharding_strategy": (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
    "fsdp.auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    "fsdp.backward_prefetch": (None, "BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
    "fsdp.state_dict_type": (None, "FULL_STATE_DICT", "SHARDED_STATE_DICT"),
    "fsdp.mixed_precision": (None, "no", "bf16", "fp16", "fp32"),
    "logging.wandb.mode": (None, "online", "offline", "disabled"),
}
POSITIVE = ("optim.lr", "trainer.max_steps", "trainer.micro_batch_size", "trainer.accumulate_grad_batches",
            "trainer.devices", "trainer.num_nodes", "trainer.log_every_n_steps", "trainer.val_every_n_steps",
            "data.seq_len", "callbacks.comm.every_n_steps", "callbacks.comm.active", "trainer.collective_timeout_s")
NON_NEGATIVE = ("optim.weight_decay", "optim.warmup_steps", "optim.eps", "optim.min_lr_ratio", "data.num_workers")


def _load_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ShardlightError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ShardlightError(f"YAML syntax error in {where}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ShardlightError(f"YAML error in {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ShardlightError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _check_keys(raw: Any, schema: type, prefix: str, source: str) -> None:
    """Unknown keys get a did-you-mean; OmegaConf's own message names neither the file nor a fix."""
    if not isinstance(raw, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; allowed: {', '.join(fields)}"
            raise ShardlightError(f"unknown recipe key '{full}' in {source}{hint}")
        sub = fields[key].type
        sub_schema = _NESTED.get(sub) if isinstance(sub, str) else None
        if sub_schema is not None:
            if value is not None and not isinstance(value, dict):
                raise ShardlightError(f"recipe key '{full}' in {source} must be a mapping, got {value!r}")
            _check_keys(value, sub_schema, f"{full}.", source)


_NESTED = {cls.__name__: cls for cls in (ModelConfig, TokenizerConfig, DataConfig, OptimConfig, TrainerConfig,
                                          FSDPConfig, WandbConfig, LoggingConfig, CommCallbackConfig,
                                          MemoryCallbackConfig, ThroughputCallbackConfig, CallbacksConfig,
                                          CheckpointConfig, LaunchConfig)}

# Paths in a recipe file are relative to that file, so a recipe works from any directory.
_FILE_LIST_KEYS = ("train_files", "val_files")
_LOCAL_OR_HUB_KEYS = (("model", "name_or_path"), ("tokenizer", "name_or_path"))


def _resolve_paths(raw: dict, base_dir: Path) -> None:
    data = raw.get("data")
    if isinstance(data, dict):
        for key in _FILE_LIST_KEYS:
            value = data.get(key)
            if isinstance(value, str):
                value = [value]
            if isinstance(value, list):
                data[key] = [str(base_dir / v) if isinstance(v, str) and not os.path.isabs(v) else v for v in value]
    for section, key in _LOCAL_OR_HUB_KEYS:
        sub = raw.get(section)
        value = sub.get(key) if isinstance(sub, dict) else None
        if isinstance(value, str) and not os.path.isabs(value):
            candidate = base_dir / value
            if value.startswith((".", "~")) or candidate.exists():
                sub[key] = str(candidate)


def _recipe_chain(path: Path, seen: tuple = ()) -> List[tuple]:
    path = path.resolve()
    if path in seen:
        raise ShardlightError(f"recipe inheritance loop: {' -> '.join(str(p) for p in seen + (path,))}")
    raw = _load_yaml(path)
    _check_keys(raw, RecipeConfig, "", str(path))
    _resolve_paths(raw, path.parent)
    chain = []
    base = raw.pop("base", None)
    if base is not None:
        base_path = Path(base) if os.path.isabs(base) else path.parent / base
        if not base_path.is_file() and (RECIPES_DIR / base).is_file():
            base_path = RECIPES_DIR / base
        if not base_path.is_file():
            raise ShardlightError(f"base recipe '{base}' named in {path} not found")
        chain.extend(_recipe_chain(base_path, seen + (path,)))
    chain.append((str(path), raw))
    return chain


def _parse_overrides(overrides: List[str]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ShardlightError(f"override '{item}' is not of the form key.path=value")
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as exc:
        raise ShardlightError(f"bad override: {str(exc).splitlines()[0]}") from None
    return parsed


def _normalize_raw(raw: dict) -> None:
    """Accelerate writes class lists as comma-separated strings; accept them as such."""
    fsdp = raw.get("fsdp")
    if isinstance(fsdp, dict):
        for key in ("transformer_cls_names_to_wrap", "transformer_layer_cls_to_wrap"):
            if isinstance(fsdp.get(key), str):
                fsdp[key] = [name.strip() for name in fsdp[key].split(",") if name.strip()]


def load_recipe(path: Optional[str] = None, overrides: Optional[List[str]] = None,
                accelerate_config: Optional[str] = None) -> RecipeConfig:
    """Recipe file (or the default) [+ an ``accelerate config`` YAML] + overrides → validated ``RecipeConfig``."""
    recipe_path = Path(path) if path else DEFAULT_RECIPE
    chain = _recipe_chain(recipe_path)
    if accelerate_config:
        from framework.strategy.options import accelerate_config_overrides

        chain.append((f"accelerate config {accelerate_config}", accelerate_config_overrides(accelerate_config)))
    override_dict = _parse_overrides(list(overrides or []))
    _check_keys(override_dict, RecipeConfig, "", "command-line overrides")
    for _, raw in chain + [("", override_dict)]:
        _normalize_raw(raw)
    for _, raw in chain[:-1]:
        raw.pop("name", None)  # a run is named after the recipe it was started from, not its base
    merged = OmegaConf.structured(RecipeConfig)
    for source, raw in chain + [("command-line overrides", override_dict)]:
        try:
            merged = OmegaConf.merge(merged, raw)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            detail = str(exc).splitlines()[0]
            raise ShardlightError(f"recipe key '{key}' in {source}: {detail}") from None
    cfg: RecipeConfig = OmegaConf.to_object(merged)
    if cfg.name is None:
        cfg.name = recipe_path.stem
    cfg.base = None
    _merge_fsdp_aliases(cfg.fsdp)
    validate(cfg)
    return cfg


def _merge_fsdp_aliases(fsdp: FSDPConfig) -> None:
    """Accelerate spells some options two ways; keep one spelling in the resolved recipe."""
    if fsdp.transformer_layer_cls_to_wrap and not fsdp.transformer_cls_names_to_wrap:
        fsdp.transformer_cls_names_to_wrap = list(fsdp.transformer_layer_cls_to_wrap)
    fsdp.transformer_layer_cls_to_wrap = None
    if fsdp.offload_params is not None:
        fsdp.cpu_offload = bool(fsdp.offload_params)
    fsdp.offload_params = None
    if fsdp.mixed_precision_policy is not None and fsdp.mixed_precision is None:
        fsdp.mixed_precision = str(fsdp.mixed_precision_policy).lower()
    fsdp.mixed_precision_policy = None
    for key in ("sharding_strategy", "auto_wrap_policy", "backward_prefetch", "state_dict_type"):
        value = getattr(fsdp, key)
        if isinstance(value, str):
            setattr(fsdp, key, value.upper())


def get_key(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: RecipeConfig) -> None:
    for key, allowed in ALLOWED_VALUES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            raise ShardlightError(f"{key}: '{value}' is not allowed; allowed values: {shown}")
    for key in POSITIVE:
        if get_key(cfg, key) <= 0:
            raise ShardlightError(f"{key} must be positive, got {get_key(cfg, key)}")
    for key in NON_NEGATIVE:
        if get_key(cfg, key) < 0:
            raise ShardlightError(f"{key} must not be negative, got {get_key(cfg, key)}")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ShardlightError(f"data.val_fraction must be in [0, 1), got {cfg.data.val_fraction}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ShardlightError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    if cfg.trainer.gradient_clip_val is not None and cfg.trainer.gradient_clip_val <= 0:
        raise ShardlightError(f"trainer.gradient_clip_val must be positive or null, got {cfg.trainer.gradient_clip_val}")
    if (cfg.model.name_or_path is None) == (cfg.model.config is None):
        raise ShardlightError("model: set exactly one of model.name_or_path (pretrained) or model.config (inline)")
    if cfg.model.config is not None and "model_type" not in cfg.model.config:
        raise ShardlightError("model.config must name its architecture with model_type (e.g. llama)")
    if not cfg.data.train_files and not cfg.data.dataset:
        raise ShardlightError("data: set data.train_files (local files) or data.dataset (hub dataset)")
    secrets = [k for k in cfg.launch.env if any(w in k.upper() for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))]
    if secrets:
        raise ShardlightError(
            f"launch.env.{secrets[0]} looks like a secret; recipes and job scripts are written to disk, so export "
            "it in the submitting shell instead (sbatch passes the environment through)"
        )
    if cfg.data.format == "instruction" and "{prompt}" not in cfg.data.prompt_template:
        raise ShardlightError("data.prompt_template must contain {prompt}")
    for key in ("checkpoint.every_n_steps", "checkpoint.keep_last"):
        if get_key(cfg, key) is not None and get_key(cfg, key) <= 0:
            raise ShardlightError(f"{key} must be positive or null, got {get_key(cfg, key)}")


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RecipeConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def recipe_reference_markdown() -> str:
    """The README's recipe reference table, generated from the schema so the two cannot drift."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(schema: type, prefix: str) -> None:
        for f in dataclasses.fields(schema):
            if isinstance(f.type, str) and f.type in _NESTED:
                walk(_NESTED[f.type], f"{prefix}{f.name}.")
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                default = f.default_factory()  # type: ignore[misc]
            shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
            shown = shown.replace("\n", "\\n")
            rows.append(f"| `{prefix}{f.name}` | `{shown}` | {f.metadata.get('help', '')} |")

    walk(RecipeConfig, "")
    return "\n".join(rows) + "\n"


README_TABLE_START = "<!-- recipe-reference:start (generated by `make docs`) -->\n"
README_TABLE_END = "<!-- recipe-reference:end -->"


def update_readme(path: str) -> None:
    text = Path(path).read_text()
    head, rest = text.split(README_TABLE_START)
    _, tail = rest.split(README_TABLE_END)
    Path(path).write_text(head + README_TABLE_START + recipe_reference_markdown() + README_TABLE_END + tail)


if __name__ == "__main__":
    import sys

    # `python -m framework.config --update-readme README.md` (make docs); otherwise print the table.
    if sys.argv[1:2] == ["--update-readme"]:
        update_readme(sys.argv[2])
    else:
        print(recipe_reference_markdown(), end="")
