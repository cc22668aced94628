"""Which checkpoint a run resumes from (``resume``, ``resume_dir``), and loading its model and optimizer.

The decision is made once, by the launching process (:func:`resolve_resume`); the ranks inherit it
through ``RunContext``. :func:`load_sharded` reads DCP shards onto however many ranks run now.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardlight.checkpoint.store import (
    CHECKPOINTS,
    META,
    MODEL_KEY,
    OPTIM_KEY,
    checkpoint_in,
    locate_checkpoint,
    newest_checkpoint,
    verify_checkpoint,
)
from shardlight.errors import ShardlightError


def distributed() -> bool:
    """Whether a process group is up (else DCP reads and writes this process's view only)."""
    return dist.is_available() and dist.is_initialized()


def find_resume(cfg: Any) -> Optional[Path]:
    """``resume``: null (fresh run), ``auto`` (newest complete checkpoint of ``resume_dir`` or of the newest
    run of this recipe that has one; none found: fresh run) or a path. The checkpoint found is verified."""
    resume = cfg.resume
    if resume in (None, "", "none", "null", False):
        return None
    if str(resume) == "auto":
        if cfg.resume_dir:
            run_dir = Path(cfg.resume_dir).expanduser()
            if not run_dir.is_dir():
                raise ShardlightError(f"resume_dir {run_dir} does not exist")
            found = checkpoint_in(run_dir)
        else:
            # The run dir itself is searched too: a requeued job (same slurm-<id> dir) resumes from its own.
            runs_root = Path(cfg.output_dir).resolve() / cfg.name
            candidates = [newest_checkpoint(r / CHECKPOINTS) for r in runs_root.glob("*") if r.is_dir()]
            # Newest by when it was completed: run dir names (timestamps, slurm-<id>) need not sort by time.
            found = max((c for c in candidates if c is not None), key=lambda c: (c / META).stat().st_mtime,
                        default=None)
    else:
        found = locate_checkpoint(Path(str(resume)), what="resume checkpoint")
    if found is not None:
        verify_checkpoint(found)
    return found


def resolve_resume(cfg: Any) -> Optional[Path]:
    """The checkpoint this run resumes from (None: a fresh start), checked before anything is written."""
    if cfg.export.checkpoint and not cfg.checkpoint.enabled:
        raise ShardlightError("export.checkpoint: true exports the final checkpoint; it needs checkpoint.enabled: true")
    found = find_resume(cfg)
    if str(cfg.resume) == "auto" and found is None:
        print("shardlight: resume=auto found no complete checkpoint; starting fresh", file=sys.stderr)
    return found


def load_sharded(model: torch.nn.Module, optimizers: List[torch.optim.Optimizer], path: Path) -> None:
    """Model and optimizer from a DCP checkpoint, resharded onto however many ranks run now. A PEFT checkpoint
    that references its frozen base holds only the trainable weights; the base came with the model build."""
    referenced = _references_frozen_base(path)
    options = StateDictOptions(ignore_frozen_params=referenced, strict=not referenced)
    model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
    state = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not distributed())
    except Exception as exc:
        text = str(exc).strip()
        raise ShardlightError(f"could not load checkpoint {path}: {type(exc).__name__}: "
                              f"{text.splitlines()[0] if text else ''}") from None
    set_state_dict(model, optimizers, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIM_KEY],
                   options=options)


def _references_frozen_base(path: Path) -> bool:
    meta_file = Path(path) / META
    peft = json.loads(meta_file.read_text()).get("peft") if meta_file.is_file() else None
    return bool(peft) and not peft.get("base_in_checkpoint", True)
