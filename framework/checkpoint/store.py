"""The on-disk format of a checkpoint: names, discovery, the newest complete one, verification.

Layout of ``run_dir/checkpoints/``::

    step-N/            .metadata + __<rank>_<i>.distcp (DCP: model and optimizer, sharded)
                       extra_rank<R>.pt (loop progress, LR schedulers, RNG states, data position)
                       hf/ (config, generation config, tokenizer: what an export needs besides weights)
                       shardlight.json (written last: step, world size, size + sha256 of every file)
    latest             "step-N", replaced atomically after step-N is renamed into place
    .tmp-step-N/       a save in progress; never read, removed by the next save

A checkpoint is complete when its ``shardlight.json`` and DCP's ``.metadata`` are there; it is trusted
when every file matches the size and sha256 recorded in ``shardlight.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from torch.distributed.checkpoint import FileSystemReader

from shardlight.errors import ShardlightError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "shardlight.json"
HF_DIR = "hf"
DCP_METADATA = ".metadata"
FORMAT = "shardlight-dcp-1"
# What one DCP save holds: {"model": get_state_dict's model part, "optim": its optimizer part}.
MODEL_KEY, OPTIM_KEY = "model", "optim"
# The LightningModule holds the HF model as ``model``: its weights are ``model.<HF name>`` in the module's
# state dict, and ``model.model.<HF name>`` in a checkpoint (under MODEL_KEY).
MODULE_PREFIX = "model."
WEIGHT_PREFIX = f"{MODEL_KEY}.{MODULE_PREFIX}"


def _step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / META).is_file() and (path / DCP_METADATA).is_file()


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
    if (path / META).is_file() or (path / DCP_METADATA).is_file():
        return path
    if (path / CHECKPOINTS).is_dir():
        return newest_checkpoint(path / CHECKPOINTS)
    return newest_checkpoint(path)


def locate_checkpoint(path: Path, what: str = "checkpoint") -> Path:
    """What a user named (a ``step-N`` dir, a run dir or its ``checkpoints/``) → a complete checkpoint,
    or one clear error."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ShardlightError(f"{what} {path} does not exist")
    found = checkpoint_in(path)
    if found is None:
        raise ShardlightError(f"no complete checkpoint in {path}")
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_file(path: Path) -> Dict[str, Any]:
    """What ``shardlight.json`` records of a file."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _matches(file: Path, info: Dict[str, Any]) -> bool:
    return file.stat().st_size == info["bytes"] and _sha256(file) == info["sha256"]


def verify_metadata_file(path: Path) -> None:
    """Just DCP's ``.metadata`` against its recorded hash (it is unpickled: never read it unchecked)."""
    meta_file = Path(path) / META
    if meta_file.is_file():
        info = json.loads(meta_file.read_text()).get("files", {}).get(DCP_METADATA)
        file = Path(path) / DCP_METADATA
        if info and file.is_file() and not _matches(file, info):
            raise ShardlightError(f"corrupt checkpoint file {file} (size or sha256 differs from {META})")


def verify_checkpoint(path: Path) -> Dict[str, Any]:
    """Every file the checkpoint recorded is there with its size and hash, and every file DCP's metadata
    points to is listed; else one error naming the file, before anything is loaded. Returns the metadata."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise ShardlightError(f"{path} is not a complete shardlight checkpoint (no {META})")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as exc:
        raise ShardlightError(f"corrupt checkpoint file {meta_file}: {exc}") from None
    files = meta.get("files", {})
    for name, info in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise ShardlightError(f"checkpoint file missing: {file}")
        if not _matches(file, info):
            raise ShardlightError(f"corrupt checkpoint file {file} (size or sha256 differs from {META})")
    storage = read_dcp_metadata(path).storage_data or {}
    for name in sorted({info.relative_path for info in storage.values()}):
        if name not in files:
            raise ShardlightError(f"checkpoint file {path / name} is not listed in {meta_file}")
    return meta


def read_dcp_metadata(path: Path) -> Any:
    """DCP's ``Metadata`` of a checkpoint (names, shapes, dtypes, which file holds which slice)."""
    try:
        return FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise ShardlightError(f"checkpoint file missing: {Path(path) / DCP_METADATA}") from None
    except Exception as exc:  # unpickling garbage raises anything
        raise ShardlightError(f"corrupt checkpoint file {Path(path) / DCP_METADATA}: {type(exc).__name__}") from None
