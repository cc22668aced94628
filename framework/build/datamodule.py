"""The tokenizer and the data module a recipe's ``tokenizer:`` and ``data:`` sections describe."""

from __future__ import annotations

from pathlib import Path

from shardlight.build.training_model import load_pretrained
from shardlight.data import BUILTIN_CHAT_TEMPLATE, SFTDataModule
from shardlight.errors import ShardlightError, first_line
from shardlight.recipe import RecipeConfig


def build_tokenizer(cfg: RecipeConfig):
    """``AutoTokenizer`` for the recipe, with a pad token (falls back to eos), an eos token guaranteed, and the
    chat template the data is rendered with (``data.chat_template``), which the export then carries."""
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
    template = _chat_template(cfg, tokenizer, name)
    if template is not None:
        tokenizer.chat_template = template
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                                          tokenize=False)
        except Exception as exc:  # jinja2's TemplateError, or whatever the template raises itself
            raise ShardlightError(f"data.chat_template does not render a conversation: {first_line(exc)}") from None
    return tokenizer


def _chat_template(cfg: RecipeConfig, tokenizer, name: str):
    """The template to write into the tokenizer, or None to leave it as it is."""
    choice, d = cfg.data.chat_template, cfg.data
    if choice is None:
        return BUILTIN_CHAT_TEMPLATE if d.format == "chat" and not tokenizer.chat_template else None
    if choice == "tokenizer":
        if not tokenizer.chat_template:
            raise ShardlightError(f"data.chat_template: tokenizer, but tokenizer {name} has no chat template; give "
                                  "a template (a Jinja string or a file), or null for the built-in one")
        return None
    if "{" in choice:
        return choice
    path = Path(choice)
    if not path.is_file():
        raise ShardlightError(f"data.chat_template: {choice} is not a file; allowed: a Jinja template string, a "
                              "file holding one, or 'tokenizer'")
    return path.read_text(encoding="utf-8")


def build_datamodule(cfg: RecipeConfig, tokenizer) -> SFTDataModule:
    return SFTDataModule(cfg, tokenizer)
