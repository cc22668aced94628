"""Writing result files: one JSON writer for every report, summary and listing shardlight produces, and the
group-readable mode of what a run shares on a cluster."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Union

from shardlight.errors import ShardlightError


def write_json(path: Union[str, Path], data: Any) -> None:
    """``data`` as indented JSON (anything else as its ``str``), parent dirs made; an unwritable path is one
    clear error naming it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    except OSError as exc:
        raise ShardlightError(f"cannot write {path}: {exc.strerror or exc}") from None


def share_with_group(path: Union[str, Path]) -> None:
    """Make ``path`` (a file, or a folder and everything in it) readable by the owner's group, as files shared
    on a cluster must be: safetensors and friends are written owner-only (0600)."""
    path = Path(path)
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        extra = stat.S_IRGRP | (stat.S_IXGRP if entry.is_dir() else 0)
        os.chmod(entry, entry.stat().st_mode | extra)
