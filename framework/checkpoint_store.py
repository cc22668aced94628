"""Where checkpoints are and whether they can be trusted: discovery, ``resume`` resolution, verification.

A checkpoint is complete when its ``shardlight.json`` (written last, before the atomic rename) and DCP's
``.metadata`` are there; it is trusted when every file matches the size and sha256 recorded in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from shardlight.errors import ShardlightError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "shardlight.json"
HF_DIR = "hf"


def _step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> List[Path]:
    """Complete ``step-N`` dirs under a checkpoints dir, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.name[5:].isdigit() and is_complete(p)]
    return sorted(found, key=_step_of)


def newest_checkpoint(root: Path) -> Optional[Path]:
    """The ``latest`` pointer when it names a complete checkpoint, else the highest complete step."""
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if is_complete(target):
            return target
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_in(path: Path) -> Optional[Path]:
    """A checkpoint dir, a run dir or a checkpoints dir → the checkpoint it means."""
    if (path / META).is_file() or (path / ".metadata").is_file():
        return path
    if (path / CHECKPOINTS).is_dir():
        return newest_checkpoint(path / CHECKPOINTS)
    return newest_checkpoint(path)


def find_resume(cfg: Any, exclude: Optional[Path] = None) -> Optional[Path]:
    """``resume``: null (fresh run), ``auto`` (newest complete checkpoint of ``resume_dir`` or of the newest
    run of this recipe that has one; none found: fresh run) or a path."""
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
            runs_root = Path(cfg.output_dir).resolve() / cfg.name
            candidates = [newest_checkpoint(r / CHECKPOINTS) for r in runs_root.glob("*")
                          if r.is_dir() and r != exclude]
            # Newest by when it was completed: run dir names (timestamps, slurm-<id>) need not sort by time.
            found = max((c for c in candidates if c is not None), key=lambda c: (c / META).stat().st_mtime,
                        default=None)
        if found is not None:
            verify_checkpoint(found)
        return found
    path = Path(str(resume)).expanduser()
    if not path.exists():
        raise ShardlightError(f"resume checkpoint {path} does not exist")
    found = checkpoint_in(path)
    if found is None:
        raise ShardlightError(f"no complete checkpoint in {path}")
    verify_checkpoint(found)
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_file(path: Path) -> Dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def verify_metadata_file(path: Path) -> None:
    """Just DCP's ``.metadata`` against its recorded hash (it is unpickled: never read it unchecked)."""
    meta_file = Path(path) / META
    if meta_file.is_file():
        info = json.loads(meta_file.read_text()).get("files", {}).get(".metadata")
        file = Path(path) / ".metadata"
        if info and file.is_file() and (file.stat().st_size != info["bytes"] or _sha256(file) != info["sha256"]):
            raise ShardlightError(f"corrupt checkpoint file {file} (size or sha256 differs from {META})")


def verify_checkpoint(path: Path) -> Dict[str, Any]:
    """Every file the checkpoint recorded is there with its size and hash, and every file DCP's metadata
    points to is listed; else one error naming the file, before anything is loaded."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise ShardlightError(f"{path} is not a complete shardlight checkpoint (no {META})")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as exc:
        raise ShardlightError(f"corrupt checkpoint file {meta_file}: {exc}") from None
    for name, info in sorted(meta.get("files", {}).items()):
        file = path / name
        if not file.is_file():
            raise ShardlightError(f"checkpoint file missing: {file}")
        if file.stat().st_size != info["bytes"] or _sha256(file) != info["sha256"]:
            raise ShardlightError(f"corrupt checkpoint file {file} (size or sha256 differs from {META})")
    for name in read_dcp_metadata(path).storage_data_files():
        if name not in meta.get("files", {}):
            raise ShardlightError(f"checkpoint file {path / name} is not listed in {meta_file}")
    return meta


class _DcpMetadata:
    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata

    def storage_data_files(self) -> List[str]:
        return sorted({info.relative_path for info in (self.metadata.storage_data or {}).values()})


def read_dcp_metadata(path: Path) -> _DcpMetadata:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return _DcpMetadata(FileSystemReader(str(path)).read_metadata())
    except FileNotFoundError:
        raise ShardlightError(f"checkpoint file missing: {Path(path) / '.metadata'}") from None
    except Exception as exc:  # unpickling garbage raises anything
        raise ShardlightError(f"corrupt checkpoint file {Path(path) / '.metadata'}: {type(exc).__name__}") from None


def resolve_resume(cfg: Any) -> Optional[Path]:
    """The checkpoint this run resumes from (None: a fresh start). Decided once, by the launching process;
    its ranks inherit the decision through ``RunContext``."""
    if cfg.export and not cfg.checkpoint.enabled:
        raise ShardlightError("export: true exports the final checkpoint; it needs checkpoint.enabled: true")
    # The run dir itself is searched too: a requeued job (same slurm-<id> dir) resumes from its own checkpoints.
    found = find_resume(cfg)
    if str(cfg.resume) == "auto" and found is None:
        print("shardlight: resume=auto found no complete checkpoint; starting fresh", file=sys.stderr)
    return found
