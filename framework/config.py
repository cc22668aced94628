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


@dataclass
class FSDPConfig:
    """Accelerate's ``FullyShardedDataParallelPlugin`` vocabulary (same names and meanings)."""

    fsdp_version: int = field(default=1, metadata={"help": "1: FullyShardedDataParallel."})
    sharding_strategy: str = field(
        default="FULL_SHARD", metadata={"help": "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2."}
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
    min_num_params: int = field(default=100_000_000, metadata={"help": "Unit size for SIZE_BASED_WRAP."})
    backward_prefetch: Optional[str] = field(
        default="BACKWARD_PRE", metadata={"help": "BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH."}
    )
    forward_prefetch: bool = field(default=False, metadata={"help": "Issue the next all-gather during forward."})
    limit_all_gathers: bool = field(default=True, metadata={"help": "Rate-limit all-gathers in flight."})
    use_orig_params: bool = field(default=True, metadata={"help": "Keep original parameters visible."})
    cpu_offload: bool = field(default=False, metadata={"help": "Offload parameters and gradients to CPU."})
    state_dict_type: str = field(
        default="FULL_STATE_DICT", metadata={"help": "FULL_STATE_DICT or SHARDED_STATE_DICT."}
    )
    sync_module_states: bool = field(default=False, metadata={"help": "Broadcast rank 0's weights at wrap time."})
    activation_checkpointing: bool = field(default=False, metadata={"help": "Recompute each block in backward."})
    mixed_precision: Optional[str] = field(
        default=None, metadata={"help": "Param/reduce dtype inside FSDP: null, bf16, fp16 or fp32."}
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


ALLOWED_VALUES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": (None, "eager", "sdpa", "flash_attention_2", "flex_attention"),
    "data.format": ("text", "instruction", "chat"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true"),
    "trainer.accelerator": ("auto", "cpu", "gpu", "cuda"),
    "fsdp.fsdp_version": (1,),
    "fsdp.sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
    "fsdp.auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    "fsdp.backward_prefetch": (None, "BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
    "fsdp.state_dict_type": ("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
    "fsdp.mixed_precision": (None, "no", "bf16", "fp16", "fp32"),
    "logging.wandb.mode": (None, "online", "offline", "disabled"),
}
POSITIVE = ("optim.lr", "trainer.max_steps", "trainer.micro_batch_size", "trainer.accumulate_grad_batches",
            "trainer.devices", "trainer.num_nodes", "trainer.log_every_n_steps", "trainer.val_every_n_steps",
            "data.seq_len", "fsdp.min_num_params")
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
                                          FSDPConfig, WandbConfig, LoggingConfig)}

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


def load_recipe(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> RecipeConfig:
    """Recipe file (or the default) + overrides → validated ``RecipeConfig``."""
    recipe_path = Path(path) if path else DEFAULT_RECIPE
    chain = _recipe_chain(recipe_path)
    override_dict = _parse_overrides(list(overrides or []))
    _check_keys(override_dict, RecipeConfig, "", "command-line overrides")
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
    if fsdp.transformer_layer_cls_to_wrap and not fsdp.transformer_cls_names_to_wrap:
        fsdp.transformer_cls_names_to_wrap = list(fsdp.transformer_layer_cls_to_wrap)
    fsdp.transformer_layer_cls_to_wrap = None
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
    if cfg.data.format == "instruction" and "{prompt}" not in cfg.data.prompt_template:
        raise ShardlightError("data.prompt_template must contain {prompt}")


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RecipeConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))
