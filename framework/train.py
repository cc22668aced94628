"""``shardlight train``: typed recipe → ``preflight`` → builders (``shardlight.build``) → ``Trainer.fit`` →
export, summary. Read ``train`` top to bottom: run dir, builders, fit, final validation, the verified Hugging
Face export of the full model, summary. A fit stopped by a non-finite step (``trainer.on_nonfinite: stop``)
ends right there: one ``error:`` line, a summary with ``stopped``, no final validation, no export.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence

import lightning.pytorch as pl
import transformers

from shardlight.build import build_datamodule, build_module, build_trainer
from shardlight.callbacks.peer_failure import peer_failure
from shardlight.causal_lm import NonFiniteStop
from shardlight.checkpoint import export_checkpoint, export_live, find_callback, resolve_resume
from shardlight.checkpoint.export import MODEL_DIR
from shardlight.errors import first_line
from shardlight.files import write_json
from shardlight.launch import launcher_named
from shardlight.preflight import preflight
from shardlight.recipe import RecipeConfig, to_yaml
from shardlight.recipe.validate import max_shard_bytes
from shardlight.run_context import RunContext
from shardlight.strategy import resolve_recipe_fsdp
from shardlight.strategy.activation_checkpointing import compile_seconds


class Instrument(Protocol):
    """What a run plugs in on top of the core (``shardlight.instruments``), as Lightning takes callbacks: its
    callbacks for the trainer (every rank), then after fit and the export its entries for the summary."""

    def callbacks(self, cfg: RecipeConfig, ctx: RunContext) -> List[pl.Callback]: ...

    def after_fit(self, trainer: Any, module: Any, cfg: RecipeConfig, run_dir: Path) -> Dict[str, Any]: ...


def resolve_run_dir(ctx: RunContext, cfg: RecipeConfig) -> Path:
    """All ranks must agree on one run dir: the launching process (or an sbatch script) fixes it, the ranks
    inherit it through ``RunContext``; the launcher names it."""
    if ctx.run_dir is not None:
        return ctx.run_dir
    return Path(cfg.output_dir).resolve() / cfg.name / launcher_named(ctx.launcher).run_dir_name(ctx.job_id)


def _quiet_known_noise() -> None:
    # By environment, as datasets reads it when first imported: a rank that reads its data from the cache never
    # imports datasets at all (about 0.5 s of every rank's start-up).
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    # The export's save_pretrained / from_pretrained check draw "Writing model shards" / "Loading weights" bars.
    transformers.utils.logging.disable_progress_bar()
    # Our validation loss is already reduced across ranks; Lightning cannot know that.
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # Lightning sees `srun` on PATH (a login node) and hints at it; `shardlight launch slurm` is the srun path.
    warnings.filterwarnings("ignore", message=".*`srun` command is available on your system but is not used.*")
    # peft asks transformers the old name of a property; transformers warns about its own rename, not our use.
    warnings.filterwarnings("ignore", message=".*`is_gradient_checkpointing` is deprecated.*", category=FutureWarning)
    # The final validation after fit runs on every rank with the training sampler's sharding, as during fit.
    warnings.filterwarnings("ignore", message=r".*During `trainer.validate\(\)`, it is recommended to use.*")


def plan_line(cfg: RecipeConfig, run_dir: Path) -> str:
    """The run as it will happen, in one line: ranks, FSDP version and strategy, precision, the batch per
    optimizer step, steps and where it goes (printed once, before any rank starts)."""
    t, fsdp = cfg.trainer, resolve_recipe_fsdp(cfg)
    ranks = t.num_nodes * t.devices
    nodes = f"{t.num_nodes} nodes" if t.num_nodes > 1 else "1 node"
    backend = "gloo" if t.accelerator == "cpu" else "nccl"
    strategy = ("HYBRID_SHARD" if fsdp.hybrid and fsdp.version == 1 else fsdp.sharding_strategy)
    where = f"{ranks} {t.accelerator} rank{'s' if ranks > 1 else ''}"
    tp = cfg.parallelism.tp_size
    tensor = f" x TP {tp}" if tp > 1 else ""
    per = "per data-parallel rank" if tp > 1 else "per rank"
    return (f"shardlight: {cfg.name} on {where} ({nodes}, {backend}): FSDP{fsdp.version} "
            f"{strategy}{tensor}, wrap {fsdp.auto_wrap_policy}, {t.precision}; {t.micro_batch_size} x "
            f"{cfg.data.seq_len} tokens x {t.accumulate_grad_batches} accumulation {per} per step, {t.max_steps} "
            f"steps -> {run_dir}")


def _checkpoint_summary(cfg: RecipeConfig, trainer, run_dir: Path) -> Dict[str, Any]:
    """The last checkpoint and, with ``export.checkpoint: true``, its verified Hugging Face export (rank 0)."""
    callback = find_callback(trainer)
    saved = callback.wait() if callback is not None else None
    out: Dict[str, Any] = {"checkpoint": str(saved) if saved else None}
    if cfg.export.checkpoint and saved is not None and trainer.is_global_zero:
        report = export_checkpoint(saved, run_dir / "export", max_shard_bytes=max_shard_bytes(cfg))
        out.update(export_dir=report["out"], checkpoint_export_max_abs_diff=report["max_abs_diff"])
    return out


def _stopped_nonfinite(stop: NonFiniteStop, trainer, module, run_dir: Path,
                       started: float, summary_json: Optional[str]) -> Dict[str, Any]:
    """The summary of a run that stopped before a non-finite update; rank 0 says so in one line."""
    callback = find_callback(trainer)
    # Nothing saved since a resume: the checkpoint this run started from is the last good one.
    saved = (callback.wait() or callback.resume_from) if callback is not None else None
    message = (f"{stop}; stopped every rank before that update (trainer.on_nonfinite=stop), nothing exported; "
               f"last good checkpoint: {saved or 'none'}")
    return _stopped(message, message, None, saved, trainer, module, run_dir, started, summary_json)


def _stopped(message: str, line: str, final_val_loss: Optional[float], saved: Optional[Path], trainer, module,
             run_dir: Path, started: float, summary_json: Optional[str]) -> Dict[str, Any]:
    """The summary of a run that ended short of a model (``stopped``: ``message``); rank 0 writes it and says
    ``error: <line>``."""
    summary = {
        "stopped": message,
        "first_val_loss": module.first_val_loss,
        "final_val_loss": final_val_loss,
        "steps": trainer.global_step,
        "run_dir": str(run_dir),
        "model_dir": None,
        "checkpoint": str(saved) if saved else None,
        "wall_time_s": round(time.time() - started, 2),
        "world_size": trainer.world_size,
    }
    if trainer.is_global_zero:
        write_json(run_dir / "summary.json", summary)
        if summary_json:
            write_json(summary_json, summary)
        print(f"error: {line}", file=sys.stderr, flush=True)
    return summary


def _export_failed(exc: Exception, cfg: RecipeConfig, trainer, module, run_dir: Path, started: float,
                   summary_json: Optional[str]) -> Dict[str, Any]:
    """The end-of-run export failed after the final step was checkpointed (``build_checkpoint_callback``): rank 0
    says what failed and the ``shardlight export`` command that retries it, in one line; every rank's traceback
    goes to ``run_dir/export_error_rank<R>.txt``. A dead or hung peer has already been reported in its own line
    (``peer_failures_reported``): this rank adds the retry command and re-raises, as before."""
    rank = trainer.global_rank
    callback = find_callback(trainer)
    saved = callback.last_saved if callback is not None else None
    retry = (f"shardlight export {saved} --out {run_dir / MODEL_DIR}" + (" --merge" if cfg.peft.method else "")
             if saved is not None else None)
    kept = f"step {trainer.global_step} is saved in {saved}; retry with: {retry}" if retry else "no checkpoint"
    trace = run_dir / f"export_error_rank{rank}.txt"
    trace.write_text("".join(traceback.format_exception(exc)))
    if peer_failure(exc) is not None:
        if rank == 0:
            print(f"shardlight: the export failed; {kept}", file=sys.stderr, flush=True)
        raise exc
    message = f"the export to {run_dir / MODEL_DIR} failed ({type(exc).__name__}: {first_line(exc)}); {kept}"
    return _stopped(message, f"{message} (traceback in {trace})", module.last_val_loss, saved, trainer, module,
                    run_dir, started, summary_json)


def drop_export_only_checkpoint(trainer) -> None:
    """With checkpoints off, the final save only kept the run safe until its export verified: remove it."""
    callback = find_callback(trainer)
    if callback is None or not callback.for_export or callback.last_saved is None:
        return
    if trainer.is_global_zero:
        shutil.rmtree(callback.last_saved, ignore_errors=True)
        root = callback.last_saved.parent
        for pointer in root.glob("*"):
            if pointer.is_file():
                pointer.unlink()
        if not any(root.iterdir()):
            root.rmdir()
    callback.last_saved = None


def train(ctx: RunContext, cfg: RecipeConfig, summary_json: Optional[str] = None,
          instruments: Sequence[Instrument] = ()) -> Dict[str, Any]:
    """One run on this process's rank: preflight, run dir and resume decision (made once, handed to the ranks
    Lightning spawns), builders, fit, final validation, verified export, the instruments' end-of-run work,
    summary."""
    started = time.time()
    _quiet_known_noise()
    notes: List[str] = []
    tokenizer = preflight(cfg, ctx, notes)
    run_dir = resolve_run_dir(ctx, cfg)
    if not ctx.resume_decided:  # before anything is written: a bad checkpoint is one clear error
        ctx = ctx.replace(resume_from=resolve_resume(cfg), resume_decided=True)
    ctx = ctx.replace(run_dir=run_dir, flight_recorder_entries=cfg.trainer.flight_recorder_entries)
    # Before the process group starts: the ranks Lightning is about to spawn inherit the run dir and the resume
    # decision, and every rank (this one too) keeps torch's flight recorder.
    ctx.export()
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(to_yaml(cfg))
        print(plan_line(cfg, run_dir), flush=True)
        for note in notes:
            print(note, file=sys.stderr, flush=True)

    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, tokenizer)
    trainer = build_trainer(cfg, ctx, [c for instrument in instruments for c in instrument.callbacks(cfg, ctx)])
    try:
        trainer.fit(module, datamodule=datamodule)
    except NonFiniteStop as stop:  # raised on every rank at the same step
        return _stopped_nonfinite(stop, trainer, module, run_dir, started, summary_json)
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
        write_json(run_dir / "wrap_report.json", wrap)
        for logger in trainer.loggers:
            logger.log_hyperparams({"fsdp_wrap_report": wrap})
    exported = {"model_dir": None, "export_max_abs_diff": None}
    if cfg.export.at_end:  # every rank: each writes its slices of the model
        try:
            exported = export_live(trainer, module, tokenizer, run_dir, max_shard_bytes(cfg))
        except Exception as exc:  # noqa: BLE001 - whatever broke the export, the final step is safe: say how to retry
            return _export_failed(exc, cfg, trainer, module, run_dir, started, summary_json)
        drop_export_only_checkpoint(trainer)
    model_dir = exported["model_dir"]

    summary = {
        "first_val_loss": module.first_val_loss,
        "final_val_loss": module.last_val_loss,
        "steps": trainer.global_step,
        "run_dir": str(run_dir),
        "model_dir": model_dir,
        "wall_time_s": round(time.time() - started, 2),
        "world_size": trainer.world_size,
        "export_max_abs_diff": exported["export_max_abs_diff"],
        "verdict": None,
    }
    for instrument in instruments:  # after the export's collectives
        summary.update(instrument.after_fit(trainer, module, cfg, run_dir))
    if cfg.trainer.on_nonfinite == "skip":
        summary["nonfinite_skips"] = module.nonfinite_skips
    if cfg.compile:  # rank 0's compile time, apart from the step time (throughput leaves it out)
        summary["compile_s"] = round(compile_seconds(), 2)
    summary.update(_checkpoint_summary(cfg, trainer, run_dir))
    if trainer.is_global_zero:
        write_json(run_dir / "summary.json", summary)
        if summary_json:
            write_json(summary_json, summary)
        losses = "" if module.first_val_loss is None else (
            f", val loss {module.first_val_loss:.4f} -> {module.last_val_loss:.4f}")
        where = f"model in {model_dir}" if model_dir else "no export (export.at_end: false)"
        compiled = f", compile {summary['compile_s']:.1f} s" if "compile_s" in summary else ""
        print(f"shardlight: {summary['steps']} steps{losses}{compiled}, {where}")
    return summary
