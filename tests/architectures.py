"""The architectures the README promises: every decoder of the installed transformers with a causal-LM head
and ``_no_split_modules`` (read from its auto mappings, not typed here), each with a tiny config made by one
generic rule. The one list the architecture matrix (tests/test_architectures.py) trains or sees refused."""

from __future__ import annotations

from typing import Any, Dict, List

import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardlight.fake_tensors import layer_patterns

# Tiny sizes, by what a config key's name says it is (the first pattern that matches wins; a size is only
# ever made smaller). The token ids are the shipped tiny tokenizer's.
SIZES = [("vocab", 512), ("max_position", 256), ("window", 8), ("head_dim", 8), ("experts_per_tok", 2),
         ("n_head", 4), ("heads", 4), ("moe_intermediate", 32), ("intermediate", 64), ("ffn", 64), ("experts", 4),
         ("lora_rank", 16), ("hidden_size", 32), ("d_model", 32), ("n_embd", 32), ("embedding_dim", 32),
         ("state", 16), ("d_ssm", 32), ("chunk", 16), ("dt_rank", 8)]
TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "decoder_layers", "encoder_layers")


def families() -> List[str]:
    """Model types whose causal-LM class declares ``_no_split_modules`` (the blocks FSDP wraps), one per class
    (``exaone`` and ``internlm3`` build ``LlamaForCausalLM``: ``llama`` stands for them)."""
    by_class: Dict[str, List[str]] = {}
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if getattr(getattr(transformers, name, None), "_no_split_modules", None):
            by_class.setdefault(name, []).append(model_type)
    return sorted(next((t for t in types if name.lower().startswith(t.replace("_", "").replace("-", ""))), types[0])
                  for name, types in by_class.items())


def tiny_config(model_type: str) -> Dict[str, Any]:
    """The recipe's ``model.config`` for a tiny ``model_type``."""
    return {"model_type": model_type, **_shrunk(AutoConfig.for_model(model_type))}


def _shrunk(config: PretrainedConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in vars(config).items():
        if isinstance(getattr(type(config), key, None), property):
            continue
        if isinstance(value, PretrainedConfig):  # a multimodal model's text (and vision, audio) configs
            out[key] = {"model_type": value.model_type, **_shrunk(value)}
        elif key in TOKENS:
            out[key] = TOKENS[key]
        elif isinstance(value, float) and "dropout" in key:  # FSDP1 and FSDP2 see the same step
            out[key] = 0.0
        elif isinstance(value, int) and not isinstance(value, bool):
            size = next((size for pattern, size in SIZES if pattern in key), None)
            if size is not None and value > size:
                out[key] = size
    out.update(_depth(config))
    return out


def _depth(config: PretrainedConfig) -> Dict[str, Any]:
    """Two blocks; a config with a per-layer pattern (``layer_types``: sliding and full attention, attention
    and state-space layers) keeps its shortest prefix that holds every kind of layer."""
    key = next((k for k in DEPTH_KEYS if isinstance(getattr(config, k, None), int)), None)
    if key is None:
        return {}
    depth = getattr(config, key)
    patterns = layer_patterns(config, depth) if depth > 2 else {}
    keep = 2
    for values in patterns.values():
        kinds = list(dict.fromkeys(map(str, values)))
        keep = max(keep, max(list(map(str, values)).index(kind) for kind in kinds) + 1)
    out: Dict[str, Any] = {k: min(getattr(config, k), keep) for k in DEPTH_KEYS
                           if isinstance(getattr(config, k, None), int) and not
                           isinstance(getattr(type(config), k, None), property)}
    # Lists of every layer's index (Llama 4's moe_layers) are cut with the depth too.
    out.update({k: v[:keep] for k, v in vars(config).items() if isinstance(v, list) and len(v) == depth > 2})
    return out
