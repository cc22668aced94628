"""The Lightning callback that saves sharded, atomic checkpoints (``keep_last`` pruned) and resumes exactly.

A save writes into ``.tmp-step-N`` and is renamed only when every rank's files are on disk and hashed,
so a run killed mid-save leaves the previous checkpoint as the newest complete one. The model and
optimizer go through ``get_state_dict``, which speaks FSDP1, FSDP2 and plain modules alike, so DCP can
reshard a checkpoint onto a different number of ranks. Besides them each rank saves its loop progress,
LR schedulers, RNG states and data position (``extra_rank<R>.pt``, read with ``weights_only=True``).

With ``async_save`` the shards are copied to host memory on the training thread (``dcp.async_save``) and
written, hashed and committed on a background thread, over a gloo group of their own so that they never
interleave with training's collectives. One save is in flight at a time: the next save, the end of
training and the export wait for it. The commit rule is the same, so a crash mid-write leaves the previous
checkpoint as the newest complete one.

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
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.staging import AsyncStager
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
def quiet_state_dict_warnings() -> Iterator[None]:
    """torch's own deprecation chatter from inside FSDP1's sharded state dict, once per tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


# ---------------------------------------------------------------- async saves
def host_copy(value: Any) -> Any:
    """A copy of a state dict whose tensors are this rank's, in host memory, for a background write while
    training changes the originals: a DTensor (FSDP2, TP) or ShardedTensor (FSDP1) keeps its global layout,
    its local tensor copied. (DCP's default stager copies no ShardedTensor.)"""
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    if not torch.is_tensor(value):
        return value
    if hasattr(value, "local_shards"):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata

        def on_host(m: ShardMetadata) -> ShardMetadata:
            return ShardMetadata(m.shard_offsets, m.shard_sizes, f"rank:{m.placement.rank()}/cpu")

        md = value.metadata()
        shards = [Shard(s.tensor.detach().to("cpu", copy=True), on_host(s.metadata)) for s in value.local_shards()]
        layout = ShardedTensorMetadata([on_host(m) for m in md.shards_metadata], md.size, md.tensor_properties)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, layout, process_group=value._process_group)
    if hasattr(value, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.to_local().detach().to("cpu", copy=True), value.device_mesh,
                                  value.placements, run_check=False, shape=value.shape, stride=value.stride())
    return value.detach().to("cpu", copy=True)


class HostCopyStager(AsyncStager):
    """``dcp.async_save``'s staging: ``host_copy`` on the training thread, before it goes on."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        return host_copy(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- the callback
class CheckpointCallback(Callback):
    """Saves every ``every_n_steps`` optimizer steps and at the end; resumes from ``resume_from``.
    ``for_export``: checkpoints are off and the final save only keeps the run safe until its export verified
    (``shardlight.train`` removes it then).

    Saving happens in ``on_train_batch_end``, where Lightning's own ModelCheckpoint saves, so the loop
    progress we store is the state Lightning's restart logic expects.
    """

    def __init__(self, run_dir: Path, every_n_steps: Optional[int], keep_last: Optional[int],
                 save_last: bool = True, resume_from: Optional[Path] = None,
                 fault_kill_in_save_step: Optional[int] = None, frozen_base: Optional[str] = None,
                 async_save: bool = False, for_export: bool = False) -> None:
        self.root = Path(run_dir) / CHECKPOINTS
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.save_last = save_last
        self.async_save = async_save
        self.for_export = for_export
        # async: the background writer, the save in flight, its process group, and the training step
        # (read by the writer to tell how far training went while it wrote).
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._group: Optional[Any] = None
        self._step_now = 0
        self.resume_from = Path(resume_from) if resume_from else None
        # The pretrained base a PEFT run's checkpoints reference instead of holding its frozen weights.
        self.frozen_base = frozen_base
        # Test hook: SIGKILL rank 0 at this step after the shards are written, before the rename.
        self.fault_kill_in_save_step = fault_kill_in_save_step
        self.last_saved_step: Optional[int] = None  # the step of the newest save begun (committed or in flight)
        self.last_saved: Optional[Path] = None  # the newest committed checkpoint
        self._rng_to_restore: Optional[Dict[str, Any]] = None

    # -- save
    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.async_save or stage != "fit":  # saves happen in fit only
            return
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlight-ckpt")
        if distributed():
            # Every rank creates it, in the same order: a group only the writer thread uses.
            timeout = getattr(trainer.strategy, "_timeout", None)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        # FSDP1's sharded state is ShardedTensors, whose every access on the writer thread warns of their
        # deprecation (the training thread's save silences it in place).
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        step = self._step_now = trainer.global_step
        if step == self.last_saved_step or step == 0:
            return
        periodic = bool(self.every_n_steps) and step % self.every_n_steps == 0
        # The final step is saved here too: after on_train_end the loop state no longer resumes cleanly.
        if periodic or (self.save_last and step >= trainer.max_steps > 0):
            self.save(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_last and trainer.global_step != self.last_saved_step:
            self.save(trainer, pl_module)
        self.wait()

    def wait(self) -> Optional[Path]:
        """Block until the save in flight (if any) is committed; raises what it raised. Returns the newest
        committed checkpoint."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        return self.last_saved

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # After an exception the save in flight is left unfinished: its folder stays .tmp-step-N (never
        # read), the previous checkpoint stays the newest complete one.
        if self._writer is not None:
            self._writer.shutdown(wait=self._pending is None)
            self._writer = None

    def _loop_state(self, trainer) -> Dict[str, Any]:
        state = trainer.fit_loop.state_dict()
        consumed = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if consumed >= trainer.num_training_batches:
            consumed = 0  # saved at the end of an epoch: Lightning moves on to the next one
        if isinstance(trainer.train_dataloader, ResumableDataLoader):
            state.setdefault("state_dict", {})["combined_loader"] = [{SKIP_BATCHES: consumed}]
        return state

    def save(self, trainer, pl_module) -> Path:
        """One checkpoint of this step, on every rank (it is collective); returns its final dir (with
        ``async_save``, the dir it will have once the background write commits it)."""
        self.wait()  # one save in flight at a time: .tmp-step-N dirs and the writer's group are not shared
        with quiet_state_dict_warnings():
            return self._save(trainer, pl_module)

    def _save(self, trainer, pl_module) -> Path:
        step, rank = trainer.global_step, trainer.global_rank
        started = time.monotonic()
        self.last_saved_step = step
        tmp, final = self.root / f".tmp-step-{step}", self.root / f"step-{step}"
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        trainer.strategy.barrier("shardlight-ckpt-mkdir")
        options = StateDictOptions(ignore_frozen_params=self.frozen_base is not None)
        model_sd, optim_sd = get_state_dict(trainer.strategy.model, trainer.optimizers, options=options)
        state = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
        written: Optional[Future] = None
        if self.async_save:  # copies the shards to host memory here; writes them on DCP's thread
            written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group,
                                     async_stager=HostCopyStager(), no_dist=not distributed())
        else:
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed())
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
        if rank == 0:
            self._write_hf_files(trainer, pl_module, tmp / HF_DIR)
        meta = {"format": FORMAT, "step": step, "world_size": trainer.world_size,
                "fsdp_version": getattr(getattr(trainer.strategy, "resolved", None), "version", None),
                "epoch": extra["epoch"], "batch_in_epoch": extra["batch_in_epoch"]}
        dims = getattr(getattr(trainer.strategy, "resolved", None), "parallel", None)
        if dims is not None:  # for inspect: the mesh the shards were cut on (any mesh can load them)
            meta["mesh"] = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp}
        if is_adapter_model(getattr(pl_module, "model", None)):
            meta["peft"] = {"method": pl_module.cfg.peft.method, "base_model": pl_module.cfg.model.name_or_path,
                            "base_in_checkpoint": self.frozen_base is None}
        if written is None:
            self._finish(tmp, final, rank, meta, None)
            trainer.strategy.barrier("shardlight-ckpt-done")
        else:
            self._pending = self._writer.submit(self._finish, tmp, final, rank, meta, written, started)
        return final

    def _finish(self, tmp: Path, final: Path, rank: int, meta: Dict[str, Any],
                written: Optional[Future], started: float = 0.0) -> Path:
        """Hash this rank's files, gather every rank's hashes, and (rank 0) commit: on the training thread,
        or on the writer thread once DCP's write is done."""
        if written is not None:
            written.result()
        mine = list(tmp.glob(f"__{rank}_*.distcp")) + [tmp / f"extra_rank{rank}.pt"]
        if rank == 0:
            mine.append(tmp / DCP_METADATA)
        gathered = all_gather_objects({p.name: describe_file(p) for p in mine}, group=self._group)
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            for p in sorted((tmp / HF_DIR).rglob("*")):
                if p.is_file():
                    files[str(p.relative_to(tmp))] = describe_file(p)
            if self.fault_kill_in_save_step == meta["step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            self._commit(tmp, final, {**meta, "files": files})
            self._prune(keep=final)
            if written is not None:
                ran = self._step_now - meta["step"]
                print(f"shardlight: checkpoint {final.name} written in the background in "
                      f"{time.monotonic() - started:.1f} s; training went on {ran} step(s) meanwhile",
                      file=sys.stderr)
        self.last_saved = final
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
        with quiet_state_dict_warnings():
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
    """The recipe's ``checkpoint:`` section and the run's resume decision → the callback (or None). A run that
    exports at its end always saves its final step first, so a failed export loses nothing: with checkpoints
    off, that one save is ``for_export`` (removed once the export verified)."""
    ck, resume, kill = cfg.checkpoint, ctx.resume_from, ctx.fault_kill_in_save_step
    frozen_base = cfg.model.name_or_path if base_is_referenced(cfg) else None
    if not ck.enabled:
        if not (resume or cfg.export.at_end):
            return None
        # Resuming still works with saving turned off.
        return CheckpointCallback(ctx.run_dir, None, None, save_last=cfg.export.at_end, resume_from=resume,
                                  fault_kill_in_save_step=kill, frozen_base=frozen_base,
                                  for_export=cfg.export.at_end)
    return CheckpointCallback(ctx.run_dir, ck.every_n_steps, ck.keep_last, save_last=ck.save_last or cfg.export.at_end,
                              resume_from=resume, fault_kill_in_save_step=kill, frozen_base=frozen_base,
                              async_save=ck.async_save)


def find_callback(trainer: Any) -> Optional[CheckpointCallback]:
    return next((c for c in trainer.callbacks if isinstance(c, CheckpointCallback)), None)
