"""``shardlight train``: typed recipe → builders (model, data, strategy, loggers) → ``Trainer.fit``.

Read top to bottom: preflight checks (before any rank is spawned or anything is written), run dir,
builders, fit, final validation, export of the full model with ``save_pretrained``, summary.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import datasets
import lightning.pytorch as pl
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from shardlight.build import build_datamodule, build_hf_config, build_module, build_tokenizer, build_trainer
from shardlight.build.optimizer import check_optimizer
from shardlight.checkpoint import find_callback, resolve_resume
from shardlight.data import check_data
from shardlight.errors import ShardlightError
from shardlight.export import export_checkpoint
from shardlight.launch import launcher_named
from shardlight.model import clean_param_name
from shardlight.recipe import RecipeConfig, to_yaml
from shardlight.runtime import RunContext
from shardlight.strategy import find_block_classes, resolve_recipe_fsdp


def preflight(cfg: RecipeConfig):
    """Everything that can be checked without training: bad input fails here with one clear line."""
    check_data(cfg)
    check_optimizer(cfg.optim, _uses_gpu(cfg))
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
            "fsdp.sync_module_states / cpu_ram_efficient_loading need GPUs: FSDP broadcasts module states from "
            "GPU memory only (Accelerate refuses them on CPU too)"
        )
    if resolved.cpu_ram_efficient_loading and (resolved.version == 2 or cfg.model.name_or_path is None):
        raise ShardlightError(
            "fsdp.cpu_ram_efficient_loading needs fsdp_version: 1 and a pretrained model.name_or_path"
        )
    if cfg.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP":
        # A model on the meta device costs no memory and shows the block classes before ranks spawn.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
        find_block_classes(skeleton, cfg.fsdp.transformer_cls_names_to_wrap)
    return tokenizer


def _uses_gpu(cfg: RecipeConfig) -> bool:
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        return True
    return cfg.trainer.accelerator == "auto" and torch.cuda.is_available()


def resolve_run_dir(ctx: RunContext, cfg: RecipeConfig) -> Path:
    """All ranks must agree on one run dir: the launching process (or an sbatch script) fixes it, the ranks
    inherit it through ``RunContext``; the launcher names it."""
    if ctx.run_dir is not None:
        return ctx.run_dir
    return Path(cfg.output_dir).resolve() / cfg.name / launcher_named(ctx.launcher).run_dir_name(ctx.job_id)


def save_hf_model(trainer, module, tokenizer, model_dir: Path) -> None:
    """Gather the full weights onto rank 0 and write ``save_pretrained`` safetensors + tokenizer."""
    state = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else None
    if not trainer.is_global_zero:
        return
    if state is None:
        state = module.state_dict()
    prefix = "model."
    weights = {clean_param_name(k)[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    config = module.model.config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, trust_remote_code=module.cfg.model.trust_remote_code)
    fresh.load_state_dict(weights, strict=False, assign=True)
    missing = [n for n, p in fresh.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"export is missing weights: {missing[:5]}")
    fresh.tie_weights()
    model_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))


EXPORT_CHECK_FILE = "export_check.safetensors"


@torch.no_grad()
def verify_export(trainer, model_dir: Path, run_dir: Path, vocab_size: int, seed: int) -> Optional[float]:
    """Logits of the trained (sharded) model vs the exported one on a fixed batch; max |diff| on rank 0.

    The batch and the reference logits are kept in the run dir so the check can be repeated offline.
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (2, 32), generator=generator)
    root = trainer.strategy.model
    was_training = root.training
    root.eval()
    reference = root(input_ids=input_ids.to(trainer.strategy.root_device)).float().cpu()
    root.train(was_training)
    if not trainer.is_global_zero:
        return None
    save_file({"input_ids": input_ids, "logits": reference.contiguous()}, str(run_dir / EXPORT_CHECK_FILE))
    reloaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return float((reloaded(input_ids=input_ids).logits.float() - reference).abs().max())


def _quiet_known_noise() -> None:
    datasets.disable_progress_bars()
    # Our validation loss is already reduced across ranks; Lightning cannot know that.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def _checkpoint_summary(cfg: RecipeConfig, trainer, run_dir: Path) -> Dict[str, Any]:
    """The last checkpoint and, with ``export: true``, its verified Hugging Face export (rank 0)."""
    callback = find_callback(trainer)
    saved = callback.last_saved if callback is not None else None
    out: Dict[str, Any] = {"checkpoint": str(saved) if saved else None}
    if cfg.export and saved is not None and trainer.is_global_zero:
        report = export_checkpoint(saved, run_dir / "export")
        out.update(export_dir=report["out"], checkpoint_export_max_abs_diff=report["max_abs_diff"])
    return out


def train(ctx: RunContext, cfg: RecipeConfig, summary_json: Optional[str] = None) -> Dict[str, Any]:
    started = time.time()
    _quiet_known_noise()
    tokenizer = preflight(cfg)
    run_dir = resolve_run_dir(ctx, cfg)
    if not ctx.resume_decided:  # before anything is written: a bad checkpoint is one clear error
        ctx = ctx.replace(resume_from=resolve_resume(cfg), resume_decided=True)
    ctx = ctx.replace(run_dir=run_dir)
    ctx.export()  # the ranks Lightning is about to spawn inherit the run dir and the resume decision
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(to_yaml(cfg))

    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, tokenizer)
    trainer = build_trainer(cfg, ctx)
    trainer.fit(module, datamodule=datamodule)
    if getattr(trainer, "shardlight_preempted", False):
        # Checkpointed and requeued: leave quickly and cleanly; the requeued job resumes and finishes.
        summary = {"preempted": True, "steps": trainer.global_step, "run_dir": str(run_dir)}
        if trainer.is_global_zero:
            print(f"shardlight: preempted at step {trainer.global_step}; requeued, will resume from its checkpoint")
        return summary
    validating = cfg.trainer.limit_val_batches != 0
    if validating and (module.last_val_loss is None or trainer.global_step % cfg.trainer.val_every_n_steps != 0):
        trainer.validate(module, datamodule=datamodule, verbose=False)
    wrap = getattr(trainer.strategy, "wrap_report", None)
    if wrap and trainer.is_global_zero:
        (run_dir / "wrap_report.json").write_text(json.dumps(wrap, indent=2) + "\n")
        for logger in trainer.loggers:
            logger.log_hyperparams({"fsdp_wrap_report": wrap})
    model_dir = run_dir / "model"
    save_hf_model(trainer, module, tokenizer, model_dir)
    export_diff = verify_export(trainer, model_dir, run_dir, module.model.config.vocab_size, cfg.trainer.seed)

    summary = {
        "first_val_loss": module.first_val_loss,
        "final_val_loss": module.last_val_loss,
        "steps": trainer.global_step,
        "run_dir": str(run_dir),
        "model_dir": str(model_dir),
        "wall_time_s": round(time.time() - started, 2),
        "world_size": trainer.world_size,
        "export_max_abs_diff": export_diff,
    }
    summary.update(_checkpoint_summary(cfg, trainer, run_dir))
    if trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if summary_json:
            Path(summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(summary_json).write_text(json.dumps(summary, indent=2) + "\n")
        losses = "" if module.first_val_loss is None else (
            f", val loss {module.first_val_loss:.4f} -> {module.last_val_loss:.4f}")
        print(f"shardlight: {summary['steps']} steps{losses}, model in {model_dir}")
    return summary
