"""The model side of a plan: a Hugging Face config built on the meta device (no weights, no download),
its parameter count, transformer block class and the FSDP units shardlight would wrap."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from shardlight.errors import ShardlightError
from shardlight.recipe.schema import TP_STYLES
from shardlight.strategy.tensor_parallel import _matches, model_tp_plan
from shardlight.strategy.wrapping import find_block_classes

# transformers is heavy: it is imported lazily, inside the functions that read or build a model config.


@dataclass
class ModelSpec:
    name: str
    model_type: str
    total_params: int
    block_class: str
    num_blocks: int
    block_params: int            # parameters of one transformer block (the largest)
    root_params: int             # parameters outside the blocks (embeddings, final norm, lm head): the root unit
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: Optional[int]
    tied_embeddings: bool
    gated_mlp: bool = True        # SwiGLU-style (gate + up projections) vs a plain 2-layer MLP
    # Per FSDP unit (blocks then root), the numels of its parameters in flattening order.
    unit_numels: List[List[int]] = field(default_factory=list, repr=False)
    # Per unit, in_features + out_features summed over the Linear modules LoRA adapts (peft's default targets
    # for the architecture unless named): a rank-r adapter adds r times this many trainable parameters.
    lora_widths: List[int] = field(default_factory=list, repr=False)
    # Mixture of experts: every expert's weights are stored and sharded (in total_params and unit_numels),
    # but each token runs only experts_per_token of num_experts of them.
    expert_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    # Tensor parallelism (``shardlight.strategy.tensor_parallel``): per unit, parallel to ``unit_numels``,
    # whether each parameter is split across TP ranks (its module is in the TP plan: q/k/v, o, MLP projections);
    # per block, the plan's column- and row-sharded modules (each row-sharded output is all-reduced in forward,
    # each column-sharded module's input gradient in backward, one collective per module as torch's
    # ColwiseParallel/RowwiseParallel do); which halves of a block the plan splits; None, or why TP is not
    # planned (no plan, or styles shardlight does not apply).
    unit_tp_split: List[List[bool]] = field(default_factory=list, repr=False)
    tp_colwise_per_block: int = 0
    tp_rowwise_per_block: int = 0
    tp_splits_attention: bool = False
    tp_splits_mlp: bool = False
    tp_unplanned: Optional[str] = "no TP plan"

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: all but the experts it is not routed to."""
        if not self.num_experts:
            return self.total_params
        idle = self.expert_params * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.total_params - idle

    def tp_local_params(self, tp: int) -> tuple:
        """(largest block, root, total) parameters one TP rank holds before data-parallel sharding."""
        if tp == 1 or not self.unit_tp_split:
            return self.block_params, self.root_params, self.total_params
        units = [sum(n // tp if split else n for n, split in zip(numels, flags))
                 for numels, flags in zip(self.unit_numels, self.unit_tp_split)]
        return max(units[:-1], default=0), units[-1], sum(units)

    def tp_split_fraction(self) -> float:
        """Share of the parameters the TP plan splits (the rest is replicated on every TP rank)."""
        split = sum(n for numels, flags in zip(self.unit_numels, self.unit_tp_split)
                    for n, f in zip(numels, flags) if f)
        return split / self.total_params if self.total_params else 0.0

    def lora_params(self, r: int) -> int:
        return r * sum(self.lora_widths)

    @property
    def largest_unit_params(self) -> int:
        return max(self.block_params, self.root_params)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (forward + backward): 6 N (N: the active parameters, without the
        input embedding) plus causal attention 6·L·d·S (QK^T and AV, halved for the causal mask, ×3 for
        backward)."""
        n = self.active_params - (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)
        return 6.0 * n + 6.0 * self.num_layers * self.heads_dim_total * seq_len

    @property
    def heads_dim_total(self) -> int:
        return self.num_heads * self.head_dim

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data.pop("unit_numels")
        data.pop("lora_widths")
        data.pop("unit_tp_split")
        data["tp_split_fraction"] = round(self.tp_split_fraction(), 6)
        data["largest_unit_params"] = self.largest_unit_params
        data["active_params"] = self.active_params
        data["num_units"] = len(self.unit_numels)
        return data


def _is_causal_lm(config: Any) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    archs = getattr(config, "architectures", None) or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return not archs or any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def load_hf_config_file(path: str) -> Any:
    """A standard Hugging Face ``config.json`` → PretrainedConfig; bad files are one clear line."""
    from transformers import AutoConfig

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        raw = json.loads(file.read_text())
    except OSError as exc:
        raise ShardlightError(f"--hf-config {path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ShardlightError(f"--hf-config {path}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ShardlightError(f"--hf-config {path}: not a Hugging Face model config (no model_type)")
    spec = dict(raw)
    model_type = spec.pop("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        # transformers' own message lists every known model type: hundreds of names on one line.
        import transformers

        raise ShardlightError(f"--hf-config {path}: unknown architecture: model_type '{model_type}' is not one "
                              f"transformers {transformers.__version__} knows")
    try:
        config = AutoConfig.for_model(model_type, **spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise ShardlightError(f"--hf-config {path}: {str(exc).splitlines()[0]}") from None
    if not _is_causal_lm(config):
        archs = ", ".join(getattr(config, "architectures", None) or []) or model_type
        raise ShardlightError(f"--hf-config {path}: {archs} is not a causal language model")
    return config


def _check_positive(config: Any, name: str) -> None:
    value = getattr(config, name, None)
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise ShardlightError(f"model config: {name} must be a positive integer, got {value}")


def _lora_targets(model_type: str, named: Optional[List[str]]) -> List[str]:
    if named:
        return list(named)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    return list(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type, []))


def _lora_width(module: torch.nn.Module, targets: List[str]) -> int:
    return sum(m.in_features + m.out_features for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets))


def _tp_layout(model: torch.nn.Module, blocks: List[torch.nn.Module], units: List[List[int]],
               tp_plan: Optional[Dict[str, str]]) -> Dict[str, Any]:
    """What the TP plan (the recipe's ``parallelism.tp_plan``, else the model's ``base_model_tp_plan``) splits:
    the ``ModelSpec`` fields ``unit_tp_split``, ``tp_colwise_per_block``, ``tp_rowwise_per_block``,
    ``tp_splits_attention``/``mlp`` and ``tp_unplanned``."""
    flags = [[False] * len(u) for u in units]
    out: Dict[str, Any] = {"unit_tp_split": flags}
    try:
        plan = model_tp_plan(model, tp_plan)
    except ShardlightError:
        out["tp_unplanned"] = "the model has no base_model_tp_plan and the recipe gives no parallelism.tp_plan"
        return out
    unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
    if unknown:
        out["tp_unplanned"] = f"its TP plan uses styles shardlight does not apply ({', '.join(unknown)})"
        return out
    styles = {}
    for name, module in model.named_modules():
        style = next((st for pattern, st in plan.items() if name and _matches(name, pattern)), None)
        if style is not None:
            styles[id(module)] = (name, style)
    # Mark each parameter of a planned module, in the order model_spec counted them (blocks, then root).
    owner = {id(p): id(m) for m in model.modules() for p in m.parameters(recurse=False)}
    block_ids = set()
    for i, block in enumerate(blocks):
        seen = []
        for p in block.parameters():
            block_ids.add(id(p))
            seen.append(p)
        flags[i] = [owner.get(id(p)) in styles for p in _unique(seen)][:len(units[i])]
    root = [p for p in _unique(model.parameters()) if id(p) not in block_ids]
    flags[-1] = [owner.get(id(p)) in styles for p in root]
    first = [styles[id(m)] for m in (blocks[0].modules() if blocks else []) if id(m) in styles]
    out.update(tp_colwise_per_block=sum(st.startswith("colwise") for _, st in first),
               tp_rowwise_per_block=sum(st == "rowwise" for _, st in first),
               tp_splits_attention=any("attn" in n or "attention" in n for n, _ in first),
               tp_splits_mlp=any("mlp" in n or "feed_forward" in n for n, _ in first),
               tp_unplanned=None if first else "its TP plan splits nothing inside the transformer blocks")
    return out


def model_spec(config: Any, name: Optional[str] = None, block_classes: Optional[List[str]] = None,
               trust_remote_code: bool = False, lora_targets: Optional[List[str]] = None,
               tp_plan: Optional[Dict[str, str]] = None) -> ModelSpec:
    """Build ``config`` on the meta device and count what FSDP would wrap (transformer-block units + root);
    ``lora_targets``: the module names LoRA would adapt (null: peft's default for the architecture);
    ``tp_plan``: the recipe's ``parallelism.tp_plan`` (null: the model's ``base_model_tp_plan``)."""
    from transformers import AutoModelForCausalLM

    if not _is_causal_lm(config):
        raise ShardlightError(f"{getattr(config, 'model_type', '?')} is not a causal language model")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "num_key_value_heads"):
        _check_positive(config, key)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError) as exc:
        raise ShardlightError(f"model config cannot be built: {str(exc).splitlines()[0]}") from None
    classes = tuple(find_block_classes(model, block_classes))
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    seen: set = set()
    unit_numels: List[List[int]] = []
    block_ids = set()
    for block in blocks:
        numels = []
        for p in block.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                numels.append(p.numel())
            block_ids.add(id(p))
        unit_numels.append(numels)
    root = [p.numel() for p in _unique(model.parameters()) if id(p) not in block_ids]
    unit_numels.append(root)
    targets = _lora_targets(config.model_type, lora_targets)
    lora_widths = [_lora_width(block, targets) for block in blocks]
    lora_widths.append(_lora_width(model, targets) - sum(lora_widths))
    total = sum(sum(u) for u in unit_numels)
    inter = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                or 4 * config.hidden_size)
    wide = [m for m in (blocks[0].modules() if blocks else []) if getattr(m, "out_features", None) == inter
            or getattr(m, "nf", None) == inter]
    experts, per_token = _expert_counts(config)
    expert_params = sum(p.numel() for block in blocks for name, p in block.named_parameters()
                        if experts and _is_routed_expert(name))
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    return ModelSpec(
        name=name or getattr(config, "_name_or_path", "") or config.model_type,
        model_type=config.model_type,
        total_params=total,
        block_class=type(blocks[0]).__name__ if blocks else "",
        num_blocks=len(blocks),
        block_params=max((sum(u) for u in unit_numels[:-1]), default=0),
        root_params=sum(root),
        hidden_size=hidden,
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=int(config.vocab_size),
        max_positions=getattr(config, "max_position_embeddings", None),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        gated_mlp=len(wide) >= 2,
        unit_numels=unit_numels,
        lora_widths=lora_widths,
        expert_params=expert_params,
        num_experts=experts if expert_params else 0,
        experts_per_token=per_token if expert_params else 0,
        **_tp_layout(model, blocks, unit_numels, tp_plan),
    )


def _expert_counts(config: Any) -> tuple:
    """(routed experts, experts per token) from the config's names for them (Mixtral, Qwen-MoE, DeepSeek,
    OLMoE, ...); (0, 0) for a dense model."""
    experts = next((getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(getattr(config, k, None), int)), 0)
    per_token = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_top_k", None) or 0
    if experts and not 0 < per_token <= experts:
        raise ShardlightError(f"model config: num_experts_per_tok must be in 1..{experts}, got {per_token}")
    return int(experts), int(per_token)


def _is_routed_expert(name: str) -> bool:
    # ``mlp.experts.*`` (the routed experts); a ``shared_expert(s)`` runs for every token.
    parts = name.split(".")
    return "experts" in parts and not any(p.startswith("shared_expert") for p in parts)


def _unique(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p
