"""Checks on a merged recipe that its types alone cannot express. Allowed values and number ranges come from
the schema's field metadata (``RULES``), so every setting is checked in one place; the rest are cross-field
rules."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator, Optional, Tuple

from shardlight.errors import ShardlightError
from shardlight.recipe.schema import TP_STYLES, MixtureSource, RecipeConfig


def get_key(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def schema_fields(schema: type = RecipeConfig, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field]]:
    """Every leaf field of the schema with its dotted key, in declaration order."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


# The value rules a field's metadata may carry; null always passes. For a list or a mapping they apply to
# every item (``length`` is the list's own). Every int/float field has at least one of RANGE_RULES
# (tests/test_recipe_errors.py walks the schema), so no number reaches training unchecked.
RANGE_RULES = ("allowed", "positive", "non_negative", "fraction", "min", "max")
RULES = RANGE_RULES + ("length",)  # and "help", the reference text


def _range_problem(value: Any, meta: Any) -> Optional[str]:
    """What ``value`` breaks of ``meta``'s rules, as the rest of a sentence ("must be positive"), or None."""
    allowed = meta.get("allowed")
    if allowed is not None and value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        return f"is not allowed; allowed values: {shown}"
    if value is None:
        return None
    if meta.get("positive") and not value > 0:
        return "must be positive"
    if meta.get("non_negative") and not value >= 0:
        return "must not be negative"
    if meta.get("fraction") and not 0 <= value < 1:
        return "must be in [0, 1)"
    low, high = meta.get("min"), meta.get("max")
    if (low is not None and not value >= low) or (high is not None and not value <= high):
        if low is not None and high is not None:
            return f"must be between {low} and {high}"
        return f"must be at least {low}" if low is not None else f"must be at most {high}"
    return None


def _fail(key: str, value: Any, problem: str) -> ShardlightError:
    if problem.startswith("is not allowed"):
        return ShardlightError(f"{key}: '{value}' {problem}")
    return ShardlightError(f"{key} {problem}, got {value}")


def _check_field(key: str, value: Any, meta: Any) -> None:
    if isinstance(value, (list, tuple)):
        length = meta.get("length")
        if length is not None and len(value) != length:
            raise ShardlightError(f"{key} must have {length} items, got {list(value)}")
        items = [(f"{key}[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        items = [(f"{key}.{name}", item) for name, item in value.items()]
    else:
        items = [(key, value)]
    for item_key, item in items:
        problem = _range_problem(item, meta)
        if problem:
            raise _fail(item_key, item, problem)


def validate(cfg: RecipeConfig) -> None:
    for key, f in schema_fields():
        _check_field(key, get_key(cfg, key), f.metadata)
    if (cfg.model.name_or_path is None) == (cfg.model.config is None):
        raise ShardlightError("model: set exactly one of model.name_or_path (pretrained) or model.config (inline)")
    if cfg.model.config is not None and "model_type" not in cfg.model.config:
        raise ShardlightError("model.config must name its architecture with model_type (e.g. llama)")
    _check_data(cfg)
    secrets = [k for k in cfg.launch.env if any(w in k.upper() for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))]
    if secrets:
        raise ShardlightError(
            f"launch.env.{secrets[0]} looks like a secret; recipes and job scripts are written to disk, so export "
            "it in the submitting shell instead (sbatch passes the environment through)"
        )
    _check_peft(cfg)
    _check_parallelism(cfg)
    _check_hang(cfg)
    _check_block_knobs(cfg)
    max_shard_bytes(cfg)


def _check_hang(cfg: RecipeConfig) -> None:
    """The hang watchdog must act before torch's collective timeout ends the run without naming anyone."""
    hang, timeout = cfg.callbacks.hang, cfg.trainer.collective_timeout_s
    if hang.enabled and hang.after_s is not None and hang.after_s + hang.grace_s >= timeout:
        raise ShardlightError(
            f"callbacks.hang.after_s={hang.after_s:g} plus callbacks.hang.grace_s={hang.grace_s:g} must be below "
            f"trainer.collective_timeout_s={timeout}: the watchdog names the stuck rank only before torch's "
            "timeout stops the run")


def _check_block_knobs(cfg: RecipeConfig) -> None:
    """The checkpointing choices refine fsdp.activation_checkpointing; without it they would do nothing. Compiled
    blocks under FSDP1 need its original parameters."""
    fsdp = cfg.fsdp
    if cfg.compile and fsdp.fsdp_version == 1 and fsdp.use_orig_params is False:
        raise ShardlightError("compile: true with fsdp_version 1 needs fsdp.use_orig_params: true (or null): the "
                              "compiled blocks must see their own parameters, not views of FSDP's flat one")
    if fsdp.activation_checkpointing:
        return
    for key, default in (("activation_checkpointing_mode", "full"), ("activation_checkpointing_every", 1),
                         ("activation_checkpointing_offload", False)):
        value = getattr(fsdp, key)
        if value != default:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ShardlightError(f"fsdp.{key}={shown} needs fsdp.activation_checkpointing=true "
                                  "(it chooses how the checkpointed blocks are recomputed)")


def max_shard_bytes(cfg: RecipeConfig) -> int:
    """``export.max_shard_size`` in bytes (one line naming the value when it is no size)."""
    return parse_size(cfg.export.max_shard_size, "export.max_shard_size")


def parse_size(value: Any, key: str) -> int:
    """A size as ``save_pretrained``'s ``max_shard_size`` takes it (bytes, or 5GB, 500MB) → bytes; one line
    naming ``key`` when it is none."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(value).strip()
    try:
        size = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ShardlightError(f"{key}: '{value}' is not a size; give a number of bytes or one with a unit "
                              f"(e.g. 5GB, 500MB)")
    return size


def _check_data(cfg: RecipeConfig) -> None:
    """One dataset (the data section's own keys) or a mixture (``data.datasets``), each source complete."""
    d = cfg.data
    sources = [("data", d)]
    if d.datasets:
        if d.train_files or d.val_files or d.dataset:
            raise ShardlightError("data.datasets (a mixture) replaces data.train_files, data.val_files and "
                                  "data.dataset; move them into one of its items")
        sources = [(f"data.datasets[{i}]", source) for i, source in enumerate(d.datasets)]
        for prefix, source in sources:
            for key, f in schema_fields(MixtureSource, f"{prefix}."):
                _check_field(key, getattr(source, f.name), f.metadata)
        names = [name for name, _, _ in d.sources()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ShardlightError(f"data.datasets: more than one source is named '{twice[0]}'; give each a "
                                  "distinct name (it names its validation loss, val/loss/<name>)")
    for prefix, source in sources:
        if not source.train_files and not source.dataset:
            raise ShardlightError(f"{prefix}: set {prefix}.train_files (local files) or {prefix}.dataset (hub "
                                  "dataset)")
        if source.format == "instruction" and "{prompt}" not in source.prompt_template:
            raise ShardlightError(f"{prefix}.prompt_template must contain {{prompt}}")


def _check_peft(cfg: RecipeConfig) -> None:
    """Adapters leave frozen and trainable parameters in one FSDP unit; FSDP1 can only flatten such a unit
    while keeping the original parameters visible (FSDP2 shards each parameter on its own)."""
    if cfg.peft.method is None:
        return
    if cfg.fsdp.fsdp_version == 1 and cfg.fsdp.use_orig_params is False:
        raise ShardlightError(
            f"peft.method {cfg.peft.method} with fsdp_version 1 needs fsdp.use_orig_params: true (each FSDP unit "
            "holds frozen base and trainable adapter weights); set it to true (or null), or use fsdp_version: 2")
    if cfg.peft.target_modules is not None and not cfg.peft.target_modules:
        raise ShardlightError("peft.target_modules is empty; name modules to adapt, or null for peft's default")


def _check_parallelism(cfg: RecipeConfig) -> None:
    """The recipe-only rules of the ``parallelism:`` section (the mesh against the world and the model's shapes
    are checked by the strategy's resolution and by preflight)."""
    p = cfg.parallelism
    if p.cp_size not in (None, 1):
        raise ShardlightError(f"parallelism.cp_size {p.cp_size}: context parallelism is not supported yet; remove it")
    for pattern, style in (p.tp_plan or {}).items():
        if style not in TP_STYLES:
            raise ShardlightError(
                f"parallelism.tp_plan.{pattern}: '{style}' is not allowed; allowed values: {', '.join(TP_STYLES)}")
