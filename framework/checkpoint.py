"""Sharded, atomic checkpoints with exact resume (``torch.distributed.checkpoint``).

Layout of ``run_dir/checkpoints/``::

    step-N/            .metadata + __<rank>_<i>.distcp (DCP: model and optimizer, sharded)
                       extra_rank<R>.pt (loop progress, LR schedulers, RNG states, data position)
                       hf/ (config, generation config, tokenizer: what an export needs besides weights)
                       shardlight.json (written last: step, world size, size + sha256 of every file)
    latest             "step-N", replaced atomically after step-N is renamed into place
    .tmp-step-N/       a save in progress; never read, removed by the next save

A save writes into ``.tmp-step-N`` and is renamed only when every rank's files are on disk and hashed,
so a run killed mid-save leaves the previous checkpoint as the newest complete one.
The model and optimizer go through ``get_state_dict``/``set_state_dict``, which speak FSDP1, FSDP2 and
plain modules alike, so DCP can reshard a checkpoint onto a different number of ranks.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from shardlight.checkpoint_store import (  # noqa: F401  (re-exported: the checkpoint API lives here)
    CHECKPOINTS,
    HF_DIR,
    LATEST,
    META,
    checkpoint_in,
    complete_checkpoints,
    describe_file,
    find_resume,
    newest_checkpoint,
    read_dcp_metadata,
    resolve_resume,
    verify_checkpoint,
)
from shardlight.errors import ShardlightError
from shardlight.runtime import RunContext

# Test hook: SIGKILL rank 0 after the shards of this step are written, before the rename.


# ---------------------------------------------------------------- data position
class _SkipOnce:
    """Index sampler view that drops the loader's pending ``skip`` batches on the next pass only."""

    def __init__(self, base: Any, loader: "ResumableDataLoader") -> None:
        self.base, self.loader = base, loader

    def __iter__(self):
        # Consumed when iterated, not when looked at: len() on the loader must not use up the skip.
        skip, self.loader._pending_skip = self.loader._pending_skip, 0
        return itertools.islice(iter(self.base), skip, None)

    def __len__(self) -> int:
        # The full length: Lightning adds the restored batch count to what the iterator yields.
        return len(self.base)


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning treats as stateful, so a resumed run continues mid-epoch where it stopped.

    The state (batches already consumed this epoch) is written by :class:`CheckpointCallback` from the loop's
    own counters, not counted here: Lightning may prefetch, so an iterator count would be off by one.
    """

    _pending_skip = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"skip_batches": 0}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending_skip = int(state.get("skip_batches", 0))

    @property
    def _index_sampler(self):
        base = super()._index_sampler
        return _SkipOnce(base, self) if self._pending_skip else base


# ---------------------------------------------------------------- RNG and extra state
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


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _all_gather(obj: Any) -> List[Any]:
    dist = _dist()
    if dist is None:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


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


# ---------------------------------------------------------------- the callback
class CheckpointCallback(Callback):
    """Saves every ``every_n_steps`` optimizer steps and at the end; resumes from ``resume_from``.

    Saving happens in ``on_train_batch_end``, where Lightning's own ModelCheckpoint saves, so the loop
    progress we store is the state Lightning's restart logic expects.
    """

    def __init__(self, run_dir: Path, every_n_steps: Optional[int], keep_last: Optional[int],
                 save_last: bool = True, resume_from: Optional[Path] = None,
                 fault_kill_in_save_step: Optional[int] = None) -> None:
        self.root = Path(run_dir) / CHECKPOINTS
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.save_last = save_last
        self.resume_from = Path(resume_from) if resume_from else None
        self.fault_kill_in_save_step = fault_kill_in_save_step  # tests: die mid-save at this step
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
        epoch_loop = trainer.fit_loop.epoch_loop
        consumed = epoch_loop.batch_progress.current.ready
        if consumed >= trainer.num_training_batches:
            consumed = 0  # saved at the end of an epoch: Lightning moves on to the next one
        if isinstance(trainer.train_dataloader, ResumableDataLoader):
            state.setdefault("state_dict", {})["combined_loader"] = [{"skip_batches": consumed}]
        return state

    def save(self, trainer, pl_module) -> Path:
        with warnings.catch_warnings():
            # torch's own deprecation chatter from inside FSDP1's sharded state dict, once per tensor.
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
            return self._save(trainer, pl_module)

    def _save(self, trainer, pl_module) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        step, rank = trainer.global_step, trainer.global_rank
        tmp, final = self.root / f".tmp-step-{step}", self.root / f"step-{step}"
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        trainer.strategy.barrier("shardlight-ckpt-mkdir")
        model_sd, optim_sd = get_state_dict(trainer.strategy.model, trainer.optimizers)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=_dist() is None)
        fit_loop = trainer.fit_loop
        extra = {
            "global_step": step,
            "world_size": trainer.world_size,
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
        mine = [p for p in tmp.glob(f"__{rank}_*.distcp")] + [tmp / extra_name]
        if rank == 0:
            mine.append(tmp / ".metadata")
        described = {p.name: describe_file(p) for p in mine}
        gathered = _all_gather(described)
        if rank == 0:
            self._write_hf_files(trainer, pl_module, tmp / HF_DIR)
            files = {k: v for part in gathered for k, v in part.items()}
            for p in sorted((tmp / HF_DIR).rglob("*")):
                if p.is_file():
                    files[str(p.relative_to(tmp))] = describe_file(p)
            meta = {"format": "shardlight-dcp-1", "step": step, "world_size": trainer.world_size,
                    "fsdp_version": getattr(getattr(trainer.strategy, "resolved", None), "version", None),
                    "epoch": extra["epoch"], "batch_in_epoch": extra["batch_in_epoch"], "files": files}
            if self.fault_kill_in_save_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            pointer = self.root / f".{LATEST}.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / LATEST)
            self._prune(keep=final)
        trainer.strategy.barrier("shardlight-ckpt-done")
        self.last_saved_step, self.last_saved = step, final
        return final

    def _write_hf_files(self, trainer, pl_module, hf_dir: Path) -> None:
        hf_dir.mkdir(parents=True, exist_ok=True)
        model = getattr(pl_module, "model", None)
        if model is not None and hasattr(model, "config"):
            model.config.save_pretrained(str(hf_dir))
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
        from shardlight.export import register_fsdp_root

        register_fsdp_root(trainer.strategy.model)  # lets full_params(pl_module.model) find the FSDP1 root
        if self.resume_from is None:
            return
        path, rank = self.resume_from, trainer.global_rank
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
            load_sharded(trainer.strategy.model, trainer.optimizers, path)
        saved = sorted(path.glob("extra_rank*.pt"), key=lambda p: int(p.stem[len("extra_rank"):]))
        own = path / f"extra_rank{rank}.pt"
        extra = torch.load(own if own.is_file() else saved[0], weights_only=True)
        for config, state in zip(trainer.lr_scheduler_configs, extra["schedulers"]):
            config.scheduler.load_state_dict(state)
        loop_state = extra["fit_loop"]
        if extra["world_size"] != trainer.world_size:
            self._rescale_position(loop_state, extra["world_size"], trainer.world_size)
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
        old = combined[0]["skip_batches"]
        new = old * old_world // new_world
        combined[0]["skip_batches"] = new
        for key in ("ready", "started", "processed", "completed"):
            progress[key] = max(0, progress[key] - old + new)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        dist_errors = tuple(t for t in (getattr(torch.distributed, "DistError", None),) if t)
        text = str(exception).strip().splitlines()
        first = text[0] if text else type(exception).__name__
        if isinstance(exception, dist_errors) or any(w in first.lower() for w in ("gloo", "nccl", "connection",
                                                                                   "timed out", "peer")):
            print(f"error: rank {trainer.global_rank}: a collective failed, another rank probably died or "
                  f"hung ({type(exception).__name__}: {first[:300]}); stopping this rank", file=sys.stderr,
                  flush=True)


def load_sharded(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: Path) -> None:
    """Model and optimizer from a DCP checkpoint, resharded onto however many ranks run now."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_dist() is None)
    except Exception as exc:
        raise ShardlightError(f"could not load checkpoint {path}: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def build_checkpoint_callback(cfg: Any, ctx: RunContext) -> Optional[CheckpointCallback]:
    ck, resume, kill = cfg.checkpoint, ctx.resume_from, ctx.fault_kill_in_save_step
    if not ck.enabled:
        # Resuming still works with saving turned off.
        return CheckpointCallback(ctx.run_dir, None, None, save_last=False, resume_from=resume,
                                  fault_kill_in_save_step=kill) if resume else None
    return CheckpointCallback(ctx.run_dir, ck.every_n_steps, ck.keep_last, save_last=ck.save_last,
                              resume_from=resume, fault_kill_in_save_step=kill)


def find_callback(trainer: Any) -> Optional[CheckpointCallback]:
    return next((c for c in trainer.callbacks if isinstance(c, CheckpointCallback)), None)
