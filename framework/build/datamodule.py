"""The tokenizer and the data module a recipe's ``tokenizer:`` and ``data:`` sections describe."""

from __future__ import annotations

from shardlight.build.training_model import load_pretrained
from shardlight.data import SFTDataModule
from shardlight.errors import ShardlightError, first_line
from shardlight.recipe import RecipeConfig


def build_tokenizer(cfg: RecipeConfig):
    """``AutoTokenizer`` for the recipe, with a pad token (falls back to eos) and an eos token guaranteed."""
    from transformers import AutoTokenizer

    name = cfg.tokenizer.name_or_path or cfg.model.name_or_path
    key = "tokenizer.name_or_path" if cfg.tokenizer.name_or_path else "model.name_or_path"
    hint = "set tokenizer.name_or_path to a local directory or hub id"
    if not name:
        raise ShardlightError(
            f"tokenizer not found: neither tokenizer.name_or_path nor model.name_or_path is set; {hint}")
    try:
        tokenizer = load_pretrained(AutoTokenizer.from_pretrained, name, key,
                                    trust_remote_code=cfg.tokenizer.trust_remote_code)
    except ShardlightError:
        raise
    except Exception as exc:  # OSError, HFValidationError, ValueError...
        raise ShardlightError(f"tokenizer not found: {name} ({first_line(exc)}); {hint}") from None
    if tokenizer.eos_token_id is None:
        raise ShardlightError(f"tokenizer {name} has no eos token; SFT needs one to mark the end of an answer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_datamodule(cfg: RecipeConfig, tokenizer) -> SFTDataModule:
    return SFTDataModule(cfg, tokenizer)
