"""The Lightning callback that saves sharded, atomic checkpoints (``keep_last`` pruned) and resumes exactly.

A save writes into ``.tmp-step-N`` and is renamed only when every rank's files are on disk and hashed,
so a run killed mid-save leaves the previous checkpoint as the newest complete one. The model and
optimizer go through ``get_state_dict``, which speaks FSDP1, FSDP2 and plain modules alike, so DCP can
reshard a checkpoint onto a different number of ranks. Besides them each rank saves its loop progress,
LR schedulers, RNG states and data position (``extra_rank<R>.pt``, read with ``weights_only=True``).

With PEFT adapters on a pretrained base, the model part holds only the trainable weights (adapters and
``modules_to_save``): the frozen base is referenced by ``shardlight.json``'s ``peft.base_model``, not copied.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from shardlight.adapters import ADAPTER_NAME, base_is_referenced, is_adapter_model
from shardlight.checkpoint.resume import distributed, load_sharded
from shardlight.checkpoint.store import (
    CHECKPOINTS,
    DCP_METADATA,
    FORMAT,
    HF_DIR,
    LATEST,
    META,
    MODEL_KEY,
    OPTIM_KEY,
    complete_checkpoints,
    describe_file,
)
from shardlight.collectives import all_gather_objects
from shardlight.data import SKIP_BATCHES, ResumableDataLoader
from shardlight.run_context import RunContext


# ---------------------------------------------------------------- RNG state
def rng_state() -> Dict[str, Any]:
    # Plain ints and tensors only, so torch.load(weights_only=True) can read it back.
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def data_parallel_size(trainer: Any) -> int:
    """Ranks that read different batches: the world, or world / tp_size with tensor parallelism."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def _quiet_state_dict_warnings() -> Iterator[None]:
    """torch's own deprecation chatter from inside FSDP1's sharded state dict, once per tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


# ---------------------------------------------------------------- the callback
class CheckpointCallback(Callback):
    """Saves every ``every_n_steps`` optimizer steps and at the end; resumes from ``resume_from``.

    Saving happens in ``on_train_batch_end``, where Lightning's own ModelCheckpoint saves, so the loop
    progress we store is the state Lightning's restart logic expects.
    """

    def __init__(self, run_dir: Path, every_n_steps: Optional[int], keep_last: Optional[int],
                 save_last: bool = True, resume_from: Optional[Path] = None,
                 fault_kill_in_save_step: Optional[int] = None, frozen_base: Optional[str] = None) -> None:
        self.root = Path(run_dir) / CHECKPOINTS
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.save_last = save_last
        self.resume_from = Path(resume_from) if resume_from else None
        # The pretrained base a PEFT run's checkpoints reference instead of holding its frozen weights.
        self.frozen_base = frozen_base
        # Test hook: SIGKILL rank 0 at this step after the shards are written, before the rename.
        self.fault_kill_in_save_step = fault_kill_in_save_step
        self.last_saved_step: Optional[int] = None
        self.last_saved: Optional[Path] = None
        self._rng_to_restore: Optional[Dict[str, Any]] = None

    # -- save
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        step = trainer.global_step
        if step == self.last_saved_step or step == 0:
            return
        periodic = bool(self.every_n_steps) and step % self.every_n_steps == 0
        # The final step is saved here too: after on_train_end the loop state no longer resumes cleanly.
        if periodic or (self.save_last and step >= trainer.max_steps > 0):
            self.save(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_last and trainer.global_step != self.last_saved_step:
            self.save(trainer, pl_module)

    def _loop_state(self, trainer) -> Dict[str, Any]:
        state = trainer.fit_loop.state_dict()
        consumed = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if consumed >= trainer.num_training_batches:
            consumed = 0  # saved at the end of an epoch: Lightning moves on to the next one
        if isinstance(trainer.train_dataloader, ResumableDataLoader):
            state.setdefault("state_dict", {})["combined_loader"] = [{SKIP_BATCHES: consumed}]
        return state

    def save(self, trainer, pl_module) -> Path:
        """One checkpoint of this step, on every rank (it is collective); returns its final dir."""
        with _quiet_state_dict_warnings():
            return self._save(trainer, pl_module)

    def _save(self, trainer, pl_module) -> Path:
        step, rank = trainer.global_step, trainer.global_rank
        tmp, final = self.root / f".tmp-step-{step}", self.root / f"step-{step}"
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        trainer.strategy.barrier("shardlight-ckpt-mkdir")
        options = StateDictOptions(ignore_frozen_params=self.frozen_base is not None)
        model_sd, optim_sd = get_state_dict(trainer.strategy.model, trainer.optimizers, options=options)
        dcp.save({MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}, checkpoint_id=str(tmp), no_dist=not distributed())
        fit_loop = trainer.fit_loop
        extra = {
            "global_step": step,
            "world_size": trainer.world_size,
            "dp_size": data_parallel_size(trainer),
            "rank": rank,
            "epoch": fit_loop.epoch_progress.current.processed,
            "batch_in_epoch": fit_loop.epoch_loop.batch_progress.current.ready,
            "fit_loop": self._loop_state(trainer),
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "rng": rng_state(),
            "tokens_seen": int(getattr(pl_module, "tokens_seen", 0)),
        }
        extra_name = f"extra_rank{rank}.pt"
        torch.save(extra, tmp / extra_name)
        mine = list(tmp.glob(f"__{rank}_*.distcp")) + [tmp / extra_name]
        if rank == 0:
            mine.append(tmp / DCP_METADATA)
        gathered = all_gather_objects({p.name: describe_file(p) for p in mine})
        if rank == 0:
            self._write_hf_files(trainer, pl_module, tmp / HF_DIR)
            files = {k: v for part in gathered for k, v in part.items()}
            for p in sorted((tmp / HF_DIR).rglob("*")):
                if p.is_file():
                    files[str(p.relative_to(tmp))] = describe_file(p)
            meta = {"format": FORMAT, "step": step, "world_size": trainer.world_size,
                    "fsdp_version": getattr(getattr(trainer.strategy, "resolved", None), "version", None),
                    "epoch": extra["epoch"], "batch_in_epoch": extra["batch_in_epoch"], "files": files}
            dims = getattr(getattr(trainer.strategy, "resolved", None), "parallel", None)
            if dims is not None:  # for inspect: the mesh the shards were cut on (any mesh can load them)
                meta["mesh"] = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
            if is_adapter_model(getattr(pl_module, "model", None)):
                meta["peft"] = {"method": pl_module.cfg.peft.method, "base_model": pl_module.cfg.model.name_or_path,
                                "base_in_checkpoint": self.frozen_base is None}
            if self.fault_kill_in_save_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            self._commit(tmp, final, meta)
            self._prune(keep=final)
        trainer.strategy.barrier("shardlight-ckpt-done")
        self.last_saved_step, self.last_saved = step, final
        return final

    def _commit(self, tmp: Path, final: Path, meta: Dict[str, Any]) -> None:
        """``shardlight.json`` last, then the rename, then the ``latest`` pointer: each step atomic."""
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, self.root / LATEST)

    def _write_hf_files(self, trainer, pl_module, hf_dir: Path) -> None:
        hf_dir.mkdir(parents=True, exist_ok=True)
        model = getattr(pl_module, "model", None)
        if model is not None and hasattr(model, "config"):
            model.config.save_pretrained(str(hf_dir))
            if is_adapter_model(model):  # what export needs to rebuild the adapters: adapter_config.json
                model.peft_config[ADAPTER_NAME].save_pretrained(str(hf_dir))
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(str(hf_dir))
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(hf_dir))

    def _prune(self, keep: Path) -> None:
        for stale in self.root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed save
        if not self.keep_last:
            return
        found = complete_checkpoints(self.root)
        for old in found[: max(0, len(found) - self.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    # -- resume
    def on_fit_start(self, trainer, pl_module) -> None:
        if self.resume_from is None:
            return
        path, rank = self.resume_from, trainer.global_rank
        with _quiet_state_dict_warnings():
            load_sharded(trainer.strategy.model, trainer.optimizers, path)  # frozen base: see load_sharded
        saved = sorted(path.glob("extra_rank*.pt"), key=lambda p: int(p.stem[len("extra_rank"):]))
        own = path / f"extra_rank{rank}.pt"
        extra = torch.load(own if own.is_file() else saved[0], weights_only=True)
        for config, state in zip(trainer.lr_scheduler_configs, extra["schedulers"]):
            config.scheduler.load_state_dict(state)
        loop_state = extra["fit_loop"]
        # The data position is per data-parallel rank: TP ranks of one group consume one batch together.
        saved_dp = extra.get("dp_size", extra["world_size"])
        if saved_dp != data_parallel_size(trainer):
            self._rescale_position(loop_state, saved_dp, data_parallel_size(trainer))
        trainer.fit_loop.load_state_dict(loop_state)
        if hasattr(pl_module, "tokens_seen"):
            pl_module.tokens_seen = int(extra.get("tokens_seen", 0))
        # RNG states are per rank; on a different number of ranks the data order changes anyway.
        self._rng_to_restore = extra["rng"] if own.is_file() else None
        if rank == 0:
            print(f"shardlight: resumed from {path} at step {extra['global_step']}", file=sys.stderr)

    @staticmethod
    def _rescale_position(loop_state: Dict[str, Any], old_world: int, new_world: int) -> None:
        """Keep the number of samples consumed this epoch when the number of ranks changes."""
        combined = loop_state.get("state_dict", {}).get("combined_loader")
        progress = loop_state.get("epoch_loop.batch_progress", {}).get("current")
        if not combined or not progress:
            return
        old = combined[0][SKIP_BATCHES]
        new = old * old_world // new_world
        combined[0][SKIP_BATCHES] = new
        for key in ("ready", "started", "processed", "completed"):
            progress[key] = max(0, progress[key] - old + new)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None


def build_checkpoint_callback(cfg: Any, ctx: RunContext) -> Optional[CheckpointCallback]:
    """The recipe's ``checkpoint:`` section and the run's resume decision → the callback (or None)."""
    ck, resume, kill = cfg.checkpoint, ctx.resume_from, ctx.fault_kill_in_save_step
    frozen_base = cfg.model.name_or_path if base_is_referenced(cfg) else None
    if not ck.enabled:
        # Resuming still works with saving turned off.
        return CheckpointCallback(ctx.run_dir, None, None, save_last=False, resume_from=resume,
                                  fault_kill_in_save_step=kill, frozen_base=frozen_base) if resume else None
    return CheckpointCallback(ctx.run_dir, ck.every_n_steps, ck.keep_last, save_last=ck.save_last,
                              resume_from=resume, fault_kill_in_save_step=kill, frozen_base=frozen_base)


def find_callback(trainer: Any) -> Optional[CheckpointCallback]:
    return next((c for c in trainer.callbacks if isinstance(c, CheckpointCallback)), None)
