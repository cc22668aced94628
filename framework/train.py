"""``shardlight train``: typed recipe → builders (model, data, strategy, loggers) → ``Trainer.fit``.

Read top to bottom: preflight checks (before any rank is spawned or anything is written), run dir,
builders, fit, final validation, export of the full model with ``save_pretrained``, summary.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from framework.config import RecipeConfig, to_dict, to_yaml
from framework.errors import ShardlightError

RUN_DIR_ENV = "SHARDLIGHT_RUN_DIR"


def preflight(cfg: RecipeConfig):
    """Everything that can be checked without training: bad input fails here with one clear line."""
    from framework.data import build_tokenizer, check_data
    from framework.model import build_hf_config
    from framework.strategy import find_block_classes, resolve_recipe_fsdp

    check_data(cfg)
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
        from transformers import AutoModelForCausalLM

        # A model on the meta device costs no memory and shows the block classes before ranks spawn.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
        find_block_classes(skeleton, cfg.fsdp.transformer_cls_names_to_wrap)
    return tokenizer


def _uses_gpu(cfg: RecipeConfig) -> bool:
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        return True
    return cfg.trainer.accelerator == "auto" and torch.cuda.is_available()


def is_launched_rank() -> bool:
    """True in a process started by a launcher (Lightning's subprocess launcher, torchrun, srun)."""
    return any(k in os.environ for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")) or (
        "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ
    )


def global_rank() -> int:
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def resolve_run_dir(cfg: RecipeConfig) -> Path:
    """All ranks must agree on one run dir: the launching process fixes it and children inherit it."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    root = Path(cfg.output_dir).resolve() / cfg.name
    if "SLURM_JOB_ID" in os.environ:
        run_dir = root / f"slurm-{os.environ['SLURM_JOB_ID']}"
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        run_dir = root / f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    else:
        run_dir = root / datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    os.environ[RUN_DIR_ENV] = str(run_dir)
    return run_dir


def wandb_mode(cfg: RecipeConfig) -> str:
    if cfg.logging.wandb.mode:
        return cfg.logging.wandb.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _appending_csv_logger(run_dir: Path):
    """Lightning's CSVLogger deletes an existing metrics.csv; a resumed (e.g. requeued) run must append."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class AppendingWriter(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            if self._fs.isfile(self.metrics_file_path):
                with open(self.metrics_file_path, newline="") as fh:
                    self.metrics_keys = list(csv.DictReader(fh).fieldnames or [])

    class AppendingCSVLogger(CSVLogger):
        @property
        @rank_zero_experiment
        def experiment(self) -> ExperimentWriter:
            if self._experiment is None:
                self._fs.makedirs(self.root_dir, exist_ok=True)
                self._experiment = AppendingWriter(log_dir=self.log_dir)
            return self._experiment

    return AppendingCSVLogger(save_dir=str(run_dir), name="csv", version="")


def build_loggers(cfg: RecipeConfig, run_dir: Path) -> List[Any]:

    from callbacks import build_wandb_logger

    loggers: List[Any] = []
    if cfg.logging.csv:
        loggers.append(_appending_csv_logger(run_dir))
    if cfg.logging.wandb.enabled and wandb_mode(cfg) != "disabled":
        wb = cfg.logging.wandb
        # W&B failing (misconfigured, unwritable, unreachable) is a warning; the CSV twin keeps every metric.
        logger = build_wandb_logger(
            project=wb.project,
            entity=wb.entity,
            group=wb.group,
            name=wb.name or f"{cfg.name}/{run_dir.name}",
            tags=list(wb.tags) or None,
            save_dir=str(run_dir),  # its default "." would override WANDB_DIR
            mode=wandb_mode(cfg),
            config=to_dict(cfg),
            # A requeued Slurm job keeps its id (set in the sbatch script), so it continues the same W&B run.
            **({"id": os.environ["SHARDLIGHT_WANDB_RUN_ID"], "resume": "allow"}
               if os.environ.get("SHARDLIGHT_WANDB_RUN_ID") else {}),
        )
        if logger is not None:
            loggers.append(logger)
    return loggers


def build_callbacks(cfg: RecipeConfig, run_dir: Path) -> List[Any]:
    from callbacks import build_callbacks as build
    from framework.checkpoint import build_checkpoint_callback

    callbacks = build(cfg, run_dir)
    checkpoint = build_checkpoint_callback(cfg, run_dir)  # sharded checkpoints and resume
    if "SLURM_JOB_ID" in os.environ:
        from callbacks.preemption import PreemptionCallback

        callbacks.append(PreemptionCallback())  # SIGUSR1/SIGTERM: checkpoint, requeue, exit
    return callbacks + ([checkpoint] if checkpoint is not None else [])


def build_strategy(cfg: RecipeConfig):
    from datetime import timedelta

    from framework.strategy import ShardlightFSDPStrategy

    t = cfg.trainer
    return ShardlightFSDPStrategy(
        cfg.fsdp, precision=t.precision, num_nodes=t.num_nodes, devices=t.devices, num_threads=t.num_threads,
        timeout=timedelta(seconds=t.collective_timeout_s),
    )


def build_trainer(cfg: RecipeConfig, run_dir: Path):
    import lightning.pytorch as pl

    t = cfg.trainer
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    # Lightning's own SLURM requeue saves inside the signal handler (hangs; Lightning #21406): ours doesn't.
    plugins = [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else None
    return pl.Trainer(
        plugins=plugins,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
        precision=t.precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        # val_check_interval counts micro-batches; the recipe counts optimizer steps.
        val_check_interval=t.val_every_n_steps * t.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1 if t.limit_val_batches != 0 else 0,  # the pass before step 1 = first_val_loss
        limit_val_batches=t.limit_val_batches,
        enable_checkpointing=False,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        logger=build_loggers(cfg, run_dir),
        callbacks=build_callbacks(cfg, run_dir),
        default_root_dir=str(run_dir),
        use_distributed_sampler=True,
    )


def save_hf_model(trainer, module, tokenizer, model_dir: Path) -> None:
    """Gather the full weights onto rank 0 and write ``save_pretrained`` safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM

    from framework.model import clean_param_name

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
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

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
    import datasets

    datasets.disable_progress_bars()
    # Our validation loss is already reduced across ranks; Lightning cannot know that.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def _checkpoint_summary(cfg: RecipeConfig, trainer, run_dir: Path) -> Dict[str, Any]:
    """The last checkpoint and, with ``export: true``, its verified Hugging Face export (rank 0)."""
    from framework.checkpoint import find_callback

    callback = find_callback(trainer)
    saved = callback.last_saved if callback is not None else None
    out: Dict[str, Any] = {"checkpoint": str(saved) if saved else None}
    if cfg.export and saved is not None and trainer.is_global_zero:
        from framework.export import export_checkpoint

        report = export_checkpoint(saved, run_dir / "export")
        out.update(export_dir=report["out"], checkpoint_export_max_abs_diff=report["max_abs_diff"])
    return out


def train(cfg: RecipeConfig, summary_json: Optional[str] = None) -> Dict[str, Any]:
    import lightning.pytorch as pl

    from framework.data import SFTDataModule
    from framework.model import CausalLMModule

    started = time.time()
    _quiet_known_noise()
    tokenizer = preflight(cfg)
    run_dir = resolve_run_dir(cfg)
    from framework.checkpoint import resolve_resume

    resolve_resume(cfg, run_dir)  # before anything is written: a bad checkpoint is one clear error
    rank = global_rank()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(to_yaml(cfg))

    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = CausalLMModule(cfg)
    datamodule = SFTDataModule(cfg, tokenizer)
    trainer = build_trainer(cfg, run_dir)
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
